"""A step's waits as values, so that a step waiting for its vote or its turn holds no thread.

Code on a step's path that must wait (for the other shards' votes, for its turn in the apply
order, for its sync round) is written as a generator: where it would block it yields a
:class:`Wait` and is resumed with whether the wait ended before its timeout. Two drivers run
such a generator: :func:`drive` blocks the calling thread on each wait (unary calls, tests);
the shard's event loop (:class:`~optserve.server.wire.loop_calls.PoolRuns`) awaits each wait
without a thread and runs only the code between waits in its thread pool.

:class:`SignalCondition` is the condition such code waits on: a ``threading.Condition`` whose
``notify_all`` also completes the futures handed out by :meth:`SignalCondition.waiter`.
"""

from __future__ import annotations

import collections
import threading
from concurrent.futures import Future, InvalidStateError
from typing import Generator, Iterator, Optional, TypeVar

T = TypeVar("T")
Steps = Generator["Wait", bool, T]  # a generator of waits returning T

_PRUNE_FROM = 64  # waiters kept before the ones given up on are first looked for
LOCK_POLL_S = 0.25  # a step waiting for a condition's lock tries again at least this often


class Wait:
    """Wait until ``future`` is done, or ``timeout_s`` seconds (None: no limit).

    ``future``: anything with ``add_done_callback(fn)`` calling ``fn(future)`` once done (a
    ``concurrent.futures.Future``, a gRPC call future). A timed-out wait on a
    :meth:`SignalCondition.waiter` future cancels it (``signal`` True), so the condition drops it.
    """

    __slots__ = ("future", "timeout_s", "signal")

    def __init__(self, future, timeout_s: Optional[float], signal: bool = False):
        self.future = future
        self.timeout_s = timeout_s
        self.signal = signal

    def over(self) -> bool:
        """Whether the future is done already (then the wait ends at once, in time)."""
        done = getattr(self.future, "done", None)
        return done is not None and done()

    def gave_up(self) -> None:
        """The wait timed out."""
        if self.signal:
            self.future.cancel()

    def block(self) -> bool:
        """Waits in this thread; returns whether the future was done in time."""
        done = threading.Event()
        self.future.add_done_callback(lambda _future: done.set())
        if done.wait(self.timeout_s):
            return True
        self.gave_up()
        return False


def drive(steps: Steps[T]) -> T:
    """Runs ``steps`` to its end in this thread, blocking on each of its waits; returns its value."""
    try:
        wait = next(steps)
        while True:
            wait = steps.send(wait.block())
    except StopIteration as stop:
        return stop.value


def next_of(items: Iterator) -> Steps[Optional[object]]:
    """The next item of ``items`` (None at its end) that is not a :class:`Wait`: an iterator of
    messages that arrive over time gives a ``Wait`` while its next one is not there yet, and
    each is passed on (yielded) before asking again."""
    for item in items:
        if isinstance(item, Wait):
            yield item
            continue
        return item
    return None


def returns(value: T) -> Steps[T]:
    """A generator of no waits that returns ``value`` (where a step's code expects waits)."""
    return value
    yield  # noqa: unreachable - makes this function a generator


class SignalCondition(threading.Condition):
    """A ``threading.Condition`` (re-entrant by default) whose :meth:`notify_all` also completes
    the futures of :meth:`waiter`: a step waits for the condition's next notification without a
    thread by yielding ``Wait(cond.waiter(), timeout, signal=True)`` (see :meth:`wait_step`).

    A step also takes the lock itself without a thread: ``with (yield from cond.hold_steps()):``
    yields waits while another thread holds it (see :meth:`hold_steps`)."""

    def __init__(self, lock=None):
        super().__init__(lock)
        self._futures: list[Future] = []
        self._prune_at = _PRUNE_FROM  # the list's length at which given-up futures are dropped
        self._lock_waiters: collections.deque[Future] = collections.deque()  # steps waiting for the lock, in order
        self._lock_waiters_lock = threading.Lock()
        self._lock_prune_at = _PRUNE_FROM
        self.release = self._release  # threading.Condition binds its lock's own release here
        release_save = self._release_save  # and the release of wait(), which lets the lock go too

        def release_for_wait():
            state = release_save()
            self._wake_next()
            return state

        self._release_save = release_for_wait

    def waiter(self) -> Future:
        """A future done at the next :meth:`notify_all` (call with the lock held, then release
        it before waiting on the future)."""
        if len(self._futures) >= self._prune_at:  # amortised: at most once per doubling
            self._futures = [f for f in self._futures if not f.cancelled()]
            self._prune_at = max(_PRUNE_FROM, 2 * len(self._futures))
        future: Future = Future()
        self._futures.append(future)
        return future

    def wait_step(self, timeout_s: Optional[float]) -> Wait:
        """The :class:`Wait` for the next notification (call with the lock held)."""
        return Wait(self.waiter(), timeout_s, signal=True)

    def notify_all(self) -> None:
        super().notify_all()
        futures, self._futures = self._futures, []
        self._prune_at = _PRUNE_FROM
        for future in futures:
            try:
                future.set_result(True)
            except InvalidStateError:  # given up on (cancelled) meanwhile
                pass

    def hold_steps(self) -> Steps["_Held"]:
        """Takes the lock, yielding a :class:`Wait` for its release while another thread holds it;
        returns a context manager that releases it: ``with (yield from cond.hold_steps()):``.

        Each release of the lock for good (a ``with cond`` block's end, :meth:`release`, a
        ``cond.wait()``) ends the wait of the step that has waited longest, which tries again;
        every wait also ends after :data:`LOCK_POLL_S` (a step woken that never came to try).
        Code between the acquisition and the release must not yield (a lock belongs to the
        thread that took it)."""
        while not self._lock.acquire(blocking=False):
            future: Future = Future()
            with self._lock_waiters_lock:
                if len(self._lock_waiters) >= self._lock_prune_at:  # waits that timed out (a long hold)
                    self._lock_waiters = collections.deque(f for f in self._lock_waiters if not f.cancelled())
                    self._lock_prune_at = max(_PRUNE_FROM, 2 * len(self._lock_waiters))
                self._lock_waiters.append(future)
            if self._lock.acquire(blocking=False):  # released before the future was listed
                future.cancel()
                break
            yield Wait(future, LOCK_POLL_S, signal=True)
        return _Held(self)

    def __exit__(self, *exc_info) -> None:
        self._release()

    def _release(self) -> None:
        self._lock.release()
        if self._lock_waiters and not self._is_owned():  # released for good
            self._wake_next()

    def _wake_next(self) -> None:
        """Ends the wait of the step that has waited longest for the lock (one at a time: it wakes
        the next when it lets the lock go, so that a crowd of waiters is not woken at every release)."""
        with self._lock_waiters_lock:
            while self._lock_waiters:
                future = self._lock_waiters.popleft()
                try:
                    future.set_result(True)
                    return
                except InvalidStateError:  # given up on (timed out) meanwhile: the next one
                    continue
            self._lock_prune_at = _PRUNE_FROM


class _Held:
    """The lock :meth:`SignalCondition.hold_steps` took, released at the end of its ``with`` block."""

    __slots__ = ("_cond",)

    def __init__(self, cond: SignalCondition):
        self._cond = cond

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info) -> None:
        self._cond.release()
