"""A call served on an event loop whose work runs in a thread pool: what the thread sees of it.

A PushPull call (:mod:`~optserve.server.wire.push_pull`) waits for each step's first message on
the :class:`~optserve.server.wire.loop_server.LoopServer`'s loop, holding no thread, and runs the
step itself in the server's thread pool. The step's code was written for the synchronous server:
it reads the step's further messages from an iterator (:class:`LoopRequests`, which gives a
:class:`~optserve.server.domain.waits.Wait` while the next one is on its way) and asks the call's
context (:class:`LoopCallContext`) whether the call is still active, how long it may take, and
whose it is. :class:`PoolRuns` advances a step's generator one answer at a time in the pool.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Executor, Future
from typing import Any, Callable, Generator, Optional

import grpc

from optserve.server.domain.errors import OptservError
from optserve.server.domain.waits import Wait

_log = logging.getLogger(__name__)


class CallEnded(grpc.RpcError):
    """The call's messages cannot be read any more: the client cancelled it, or it timed out."""


class LoopCallContext:
    """The synchronous context API a step's code uses, for a ``grpc.aio`` call it runs beside.

    Built on the loop (it reads what it needs of the call there); its methods may be called from
    any thread. ``cancel()`` ends the call from any thread: :attr:`cancelled` turns True, and a
    :meth:`read` waiting on the loop raises :class:`CallEnded`.
    """

    def __init__(self, context: grpc.aio.ServicerContext, loop: asyncio.AbstractEventLoop):
        self.aio = context
        self._loop = loop
        self._ended = threading.Event()
        self._metadata = tuple(context.invocation_metadata() or ())
        self._peer = context.peer()
        remaining = context.time_remaining()
        self._deadline = None if remaining is None else time.monotonic() + remaining
        self.cancelled = False  # set on the loop by cancel()
        self._reading: Optional[asyncio.Future] = None  # the read waiting on the loop
        context.add_done_callback(lambda _context: self._ended.set())

    def is_active(self) -> bool:
        return not self._ended.is_set() and not self.cancelled

    def time_remaining(self) -> Optional[float]:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def invocation_metadata(self):
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def cancel(self) -> None:
        """Ends the call: its client hears CANCELLED (from any thread)."""
        self._loop.call_soon_threadsafe(self._cancel)

    def _cancel(self) -> None:
        self.cancelled = True
        if self._reading is not None:
            self._reading.cancel()

    async def read(self):
        """The call's next message (None once the client ended its side), or raises
        :class:`CallEnded` once the call was cancelled (by :meth:`cancel` or the client)."""
        if self.cancelled:
            raise CallEnded()
        self._reading = reading = asyncio.ensure_future(self.aio.read())
        try:
            message = await reading
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # this task was cancelled (the client went away)
                reading.cancel()
                raise
            raise CallEnded() from None  # cancel() ended the read
        except Exception as exc:  # noqa: BLE001 - the call ended under the read (cancelled, server stopping)
            raise CallEnded() from exc
        finally:
            self._reading = None
        return None if message is grpc.aio.EOF else message


class LoopRequests:
    """A step's further messages, read on the loop, for its code in a pool thread: each ``next``
    gives the message read, or a :class:`~optserve.server.domain.waits.Wait` for it while it is
    on its way (the step yields that and asks again: it holds no thread meanwhile). Ends at the
    client's end of the call; raises :class:`CallEnded` when the call was cancelled.

    ``read_ahead(message)``: whether another message of the step follows ``message`` (a chunk
    before the ``seal``): its read starts at once, overlapping the step's work on this one.
    """

    def __init__(self, context: LoopCallContext, loop: asyncio.AbstractEventLoop,
                 read_ahead: Callable[[Any], bool] = lambda _message: False):
        self._context = context
        self._loop = loop
        self._read_ahead = read_ahead
        self._reading: Optional[Future] = None

    def __iter__(self):
        return self

    def __next__(self):
        reading = self._reading
        if reading is None:
            reading = self._reading = self._read()
        if not reading.done():
            return Wait(reading, None)
        self._reading = None
        if reading.cancelled():  # the loop stopped under the read (the server stops)
            raise CallEnded()
        message = reading.result()  # raises CallEnded
        if message is None:
            raise StopIteration
        if self._read_ahead(message):
            self._reading = self._read()
        return message

    def _read(self) -> Future:
        if not self._loop.is_running():  # the server stopped
            raise CallEnded()
        return asyncio.run_coroutine_threadsafe(self._context.read(), self._loop)


_ANSWER, _RETURNED = 0, 1


def _advance(generator: Generator, sent: Optional[bool]) -> tuple[int, Any]:
    """One stretch of a step, in the pool: up to its next answer, a wait not over yet, or its end
    (a wait already over when it is yielded is answered at once, in the same stretch)."""
    try:
        item = generator.send(sent)
        while isinstance(item, Wait) and item.over():
            item = generator.send(True)
    except StopIteration as stop:
        return _RETURNED, stop.value
    return _ANSWER, item


def _log_unheard(exc: BaseException) -> None:
    """A step whose call ended failed: a refusal has nobody to go to; a fault is logged."""
    if isinstance(exc, OptservError):
        _log.debug("a step whose call ended was refused: %s", exc)
    else:
        _log.error("event=server_error rpc=ShardData/PushPull (a step whose call ended)", exc_info=exc)


class _Stretch:
    """A step's next stretch in the pool (:func:`_advance`), its outcome delivered to
    :attr:`landed`, a future of the loop.

    Started at once (:meth:`start`), or once a :class:`Wait` is over (:meth:`after`): then by the
    thread that completes the wait's future (a vote arriving, a turn coming), straight into the
    pool without waking the loop, or by the wait's timer on the loop, whichever comes first.
    """

    __slots__ = ("loop", "landed", "_claim", "_timer", "_work")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.landed = loop.create_future()
        self._claim = threading.Lock()  # taken (never released) by whoever starts the stretch
        self._timer: Optional[asyncio.TimerHandle] = None
        self._work: Optional[Future] = None  # the stretch, once it ended (set on the loop)

    def start(self, pool: Executor, fn: Callable, *args) -> "_Stretch":
        """``fn(*args)`` in ``pool`` now."""
        try:
            work = pool.submit(fn, *args)
        except RuntimeError as exc:  # the pool shut down (the server stops)
            work = Future()
            work.set_exception(exc)
        work.add_done_callback(self._back)
        return self

    def after(self, pool: Executor, generator: Generator, wait: Wait) -> "_Stretch":
        """The stretch that resumes ``generator`` with whether ``wait`` ended before its timeout."""
        def over(_future) -> None:  # in the thread that completed the future
            if self._claim.acquire(blocking=False):
                self.start(pool, _advance, generator, True)

        def timed_out() -> None:  # on the loop
            if self._claim.acquire(blocking=False):
                wait.gave_up()
                self.start(pool, _advance, generator, False)

        if wait.timeout_s is not None:
            self._timer = self.loop.call_later(wait.timeout_s, timed_out)
        wait.future.add_done_callback(over)
        return self

    def _back(self, work: Future) -> None:
        try:
            self.loop.call_soon_threadsafe(self._settle, work)
        except RuntimeError:  # the loop closed (the server stopped): nobody awaits it
            pass

    def _settle(self, work: Future) -> None:
        """On the loop: the stretch ended; its outcome goes to :attr:`landed` (kept for
        :meth:`redirect` when the task awaiting it was cancelled first)."""
        if self._timer is not None:
            self._timer.cancel()
        self._work = work
        self._deliver()

    def _deliver(self) -> None:
        landed, work = self.landed, self._work
        if work is None or landed.done():
            return
        if work.cancelled():
            landed.cancel()
        elif work.exception() is not None:
            landed.set_exception(work.exception())
        else:
            landed.set_result(work.result())

    def redirect(self) -> asyncio.Future:
        """On the loop, once the task awaiting :attr:`landed` was cancelled (which cancels
        :attr:`landed` too): a future that gets the stretch's outcome instead, at once if it
        ended already."""
        self.landed = self.loop.create_future()
        self._deliver()
        return self.landed


_FINISHING: set = set()  # steps going on after their calls ended (the loop keeps only weak references)


def _kept(task: asyncio.Future) -> asyncio.Future:
    _FINISHING.add(task)
    task.add_done_callback(_FINISHING.discard)
    return task


class PoolRuns:
    """Runs a call's steps (see :meth:`run`), and the call's cleanup after the last of them (:meth:`after`)."""

    def __init__(self, pool: Executor):
        self._pool = pool
        self._running: Optional[asyncio.Future] = None  # a step going on after its call was cancelled

    async def run(self, generator: Generator):
        """Runs ``generator`` in the pool between its waits: each :class:`~optserve.server.domain.waits.Wait`
        it yields is waited for without a thread (:class:`_Stretch`) and answered with whether it
        ended in time; every other item is yielded, then :class:`Returned` with what it returned
        (a returned :class:`Answered` is its last answer, yielded first).

        Cancelled (the client went away), the step goes on without it up to its next answer, as
        a thread of a synchronous server would (its part of a decided push is applied here):
        :meth:`_finish`, awaited by :meth:`after`."""
        loop = asyncio.get_running_loop()
        stretch = _Stretch(loop).start(self._pool, _advance, generator, None)
        while True:
            try:
                kind, value = await stretch.landed
            except asyncio.CancelledError:
                self._running = _kept(asyncio.ensure_future(self._finish(generator, stretch.redirect())))
                raise
            if kind == _RETURNED:
                if isinstance(value, Answered):
                    yield value.answer
                    value = value.value
                yield Returned(value)
                return
            if isinstance(value, Wait):
                stretch = _Stretch(loop).after(self._pool, generator, value)
                continue
            yield value
            stretch = _Stretch(loop).start(self._pool, _advance, generator, None)

    async def _finish(self, generator: Generator, landed: asyncio.Future) -> None:
        """A step whose call ended: from its stretch (its outcome to ``landed``), it runs on (its
        waits without a thread) up to its next answer, then is closed."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                kind, item = await landed
                if kind == _RETURNED or not isinstance(item, Wait):
                    return
                landed = _Stretch(loop).after(self._pool, generator, item).landed
        except Exception as exc:  # noqa: BLE001 - nobody to answer: see _log_unheard
            _log_unheard(exc)
        finally:
            try:
                await _Stretch(loop).start(self._pool, generator.close).landed
            except Exception as exc:  # noqa: BLE001 - the step's cleanup failed: nobody to answer
                _log_unheard(exc)

    async def result(self, generator: Generator):
        """What ``generator`` (a generator of waits only) returns, run as :meth:`run` runs it."""
        async for item in self.run(generator):
            if isinstance(item, Returned):
                return item.value
            raise TypeError(f"a generator of waits yielded {type(item).__name__}")

    def after(self, cleanup: Callable[[], None]) -> None:
        """``cleanup()`` in the pool (it may take a session's locks: never on the loop), after a
        step still going on without its call: what the call's end undoes (e.g. its worker
        leaving an elastic session) must come after what the step does (its push joining a
        round). Call on the loop."""
        def in_pool(_task=None) -> None:
            try:
                self._pool.submit(cleanup)
            except RuntimeError:  # the pool shut down (the server stops): here, then
                cleanup()

        running = self._running
        if running is None or running.done():
            in_pool()
        else:
            running.add_done_callback(in_pool)


class Answered:
    """What a step run by :meth:`PoolRuns.run` returns with its last answer: ``answer`` is sent,
    and ``value`` is what it returns, without running the step once more to reach its end."""

    __slots__ = ("answer", "value")

    def __init__(self, answer, value):
        self.answer = answer
        self.value = value


class Returned:
    """The value a generator run by :meth:`PoolRuns.run` returned (its last item)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value
