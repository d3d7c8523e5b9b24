"""A long-lived PushPull call to one shard, reused by consecutive steps.

Opening a streaming call costs gRPC Python about 1.5 ms (a request thread, a server handler);
a step on an open stream costs a few hundred microseconds. So each shard of a session keeps one
PushPull call open and sends every step's messages into it (the shard serves steps one after
another on one call, see data.proto). The call is reopened when it:

- was idle for ``idle_s`` (the request iterator ends it; the shard holds no thread for it meanwhile);
- is older than ``reuse_s`` (the call's deadline is ``timeout + reuse_s``, so every step still
  gets at least ``timeout`` seconds);
- failed, or the shard ended it after a step (``StepDone.stream_closing``: it holds too many).

Each step still has its own deadline: a step not done within ``timeout`` cancels its call and
raises :class:`~optserve.client.errors.DeadlineExceededError` (the call's own, longer deadline
only ends a call that outlived its reuse).

A step is atomic on the shard whatever happens to the call (a broken stream stages nothing) and
retried steps reuse their sequence number, so reopening never applies a push twice.

The steps one attempt sends to a session's shards form a :class:`StepGroup` (see
:func:`step_group`): when one of their calls fails (UNAVAILABLE: its connection was found dead by
keepalive, its shard is gone; or DEADLINE_EXCEEDED), the others are ended at once (their finish
raises :class:`~optserve.client.errors.UnavailableError`, or DeadlineExceededError after a
deadline): they would wait on a vote that the failed shard cannot cast, and the attempt is sent
again (same sequence) once the shard map has been read again. A DEADLINE_EXCEEDED the shard sent
itself ends the others :data:`PEER_DEADLINE_GRACE_S` later: they wait on the same step with the
same deadline and answer their own, the home shard's naming what the step waited for.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
import weakref
from typing import Callable, Iterable, Iterator, Optional

import grpc

from optserve.client import _loop
from optserve.client._deadlines import DEADLINES
from optserve.client.errors import DeadlineExceededError, UnavailableError
from optserve.protos import contract
from optserve.protos.optserve.v1 import data_pb2

_END = object()
_FAILED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)  # a call ended so ends its group
# A shard's own DEADLINE_EXCEEDED ends its peers' parts this much later: they wait on the same step
# with the same deadline, so each answers its own within moments, and the home shard's answer names
# what the step waited for (an elastic session's members that did not push); a peer that does not
# answer (its host gone) is ended then, still before the client's own deadline (a shard answers
# ``_ANSWER_MARGIN_S`` = 1 s before it)
PEER_DEADLINE_GRACE_S = 0.5
# The details gRPC gives a call this process ended itself (``cancel()``; its channel closed)
_LOCAL_CANCELS = ("Locally cancelled by application!", "Channel closed!")
_local = threading.local()  # .group: the StepGroup of the attempt this thread works for
_GOODBYE = data_pb2.PushPullRequest(goodbye=True)  # the call ends on purpose: this client is alive
_STREAMS: "weakref.WeakSet[StepStream]" = weakref.WeakSet()  # every StepStream that opened a shared call
FORK_QUIESCE_S = 2.0  # how long a fork waits for the idle shared calls it ends (then cancels them)


class StreamBroken(Exception):
    """The shard had ended the call before it took the step (see :func:`_never_started`): the
    step did not start there, and is safe to send again."""


class StepGroup:
    """The steps of one attempt on a session's shards: the first whose call fails ends the others."""

    def __init__(self):
        self._lock = threading.Lock()
        self._handles: list = []
        self.failed: Optional[str] = None  # why the first failed call failed

    def add(self, handle: "StepHandle") -> None:
        with self._lock:
            failed = self.failed
            if failed is None:
                self._handles.append(handle)
        if failed is not None:
            handle._abort(failed)

    def fail(self, details: str, source: "StepHandle") -> None:
        """``source``'s call failed: every other step of the attempt is ended (once)."""
        with self._lock:
            if self.failed is not None:
                return
            self.failed, handles = details, list(self._handles)
        for handle in handles:
            if handle is not source:
                handle._abort(details)


@contextlib.contextmanager
def step_group() -> Iterator[StepGroup]:
    """The steps this thread starts meanwhile form one :class:`StepGroup` (threads working for the
    same attempt join it with :func:`joined`)."""
    previous, _local.group = getattr(_local, "group", None), StepGroup()
    try:
        yield _local.group
    finally:
        _local.group = previous


def current_group() -> Optional[StepGroup]:
    return getattr(_local, "group", None)


def joined(group: Optional[StepGroup], fn: Callable, *args):
    """``fn(*args)`` in this thread as part of ``group`` (None: of no group)."""
    previous, _local.group = getattr(_local, "group", None), group
    try:
        return fn(*args)
    finally:
        _local.group = previous


class StepStream:
    """Consecutive steps on one PushPull call (one step at a time; see the module docstring).

    Args:
      open_call: ``open_call(request_iterator, timeout)`` -> the call's response iterator of
        ``(kind, value)`` pairs (the SDK's ``ShardCalls.push_pull``, :mod:`optserve.client._fanout`).
      timeout: the per-step deadline in seconds (None: none).
      idle_s: an open call unused this long is ended.
      reuse_s: a call is reused for steps that start within this many seconds of its opening.
    """

    def __init__(self, open_call: Callable, timeout: Optional[float], idle_s: float = 60.0, reuse_s: float = 600.0):
        self._open_call = open_call
        self._timeout = timeout
        self._idle_s = idle_s
        self._reuse_s = reuse_s
        self._busy = threading.Lock()  # one step at a time on the open call
        self._mutex = threading.Lock()  # guards the fields below
        self._requests: Optional[queue.SimpleQueue] = None
        self._responses = None
        self._opened_at = 0.0
        self._running: Optional[StepHandle] = None  # the step on the shared call now

    def step(self, messages: Iterable, on_response: Callable[[str, object], bool]) -> bool:
        """Sends one step's ``messages`` and feeds its responses to ``on_response`` until it
        returns True (the step's ``done``); returns False if the call ended before that.

        Same as ``start(messages).finish(on_response)``.
        """
        return self.start(messages).finish(on_response)

    def start(self, messages: Iterable) -> "StepHandle":
        """Sends one step's ``messages`` (gRPC's request thread sends them) and returns the
        handle that receives its responses; call its ``finish`` exactly once.

        A step started while another runs goes on a call of its own.
        """
        if not self._busy.acquire(blocking=False):
            responses = self._open_call(iter(messages), self._timeout)
            handle = StepHandle(self, responses, reused=False, owns=False)
            _on_end(responses, lambda call: handle._call_ended(call))
            return _grouped(handle)
        try:
            with self._mutex:
                reused = (self._requests is not None and time.monotonic() - self._opened_at < self._reuse_s
                          and not _has_ended(self._responses))  # an ended call would never carry the step
                if not reused:
                    self._close_locked()
                    self._open_locked()
                self._requests.put(messages)  # under the mutex: the idle check sees a non-empty queue
                self._running = StepHandle(self, self._responses, reused=reused, owns=True)
                return _grouped(self._running)
        except BaseException:
            self._busy.release()
            raise

    def end_after_step(self) -> None:
        """The shard ends the call after this step (``stream_closing``): the next one reopens."""
        self.close()

    def close(self) -> None:
        """Ends the open call, if any (its shard thread is freed once the call ends)."""
        with self._mutex:
            self._close_locked()

    # ----------------------------------------------------------------- internals
    def _open_locked(self) -> None:
        requests: queue.SimpleQueue = queue.SimpleQueue()
        deadline = None if self._timeout is None else self._timeout + self._reuse_s
        self._requests = requests
        self._responses = responses = self._open_call(self._request_iterator(requests), deadline)
        self._opened_at = time.monotonic()
        _on_end(responses, lambda call: self._call_ended(responses, call))
        _STREAMS.add(self)

    def _call_ended(self, responses, call) -> None:
        """The shared call ended: a failure ends the group of the step running on it."""
        running = self._running  # no lock: gRPC may run this at once, inside _open_locked
        if running is not None and running._responses is responses:
            running._call_ended(call)

    def _close_locked(self) -> None:
        if self._requests is not None:
            self._requests.put(_END)
        self._requests, self._responses = None, None

    def _request_iterator(self, requests: queue.SimpleQueue):
        """The call's request messages: each step's, in order; ends when idle or closed."""
        while True:
            try:
                item = requests.get(timeout=self._idle_s)
            except queue.Empty:
                with self._mutex:
                    if requests.empty():  # idle: end the call (a step that starts now opens anew)
                        if self._requests is requests:
                            self._requests, self._responses = None, None
                        yield _GOODBYE
                        return
                continue
            if item is _END:
                yield _GOODBYE
                return
            yield from item


def _end_idle_calls_before_fork() -> None:
    """``os.fork``'s ``before`` hook: ends every idle shared call (as :meth:`StepStream.close`
    does) and waits up to :data:`FORK_QUIESCE_S` for them to end, then cancels those still open.

    gRPC's fork handlers break a child forked while ``grpc.aio`` calls are open (it crashes), and
    the shared calls live on the process's event loop (:mod:`optserve.client._loop`): a PyTorch
    DataLoader forking its workers between two steps would otherwise meet them. The next step
    reopens its call. A step in flight on another thread at the fork is not waited for."""
    if not _loop.running():
        return
    ended = []
    for stream in list(_STREAMS):
        if not stream._busy.acquire(blocking=False):
            continue  # a step runs on it
        try:
            with stream._mutex:
                call = stream._responses
                stream._close_locked()
        finally:
            stream._busy.release()
        if call is not None and hasattr(call, "add_done_callback"):
            done = threading.Event()
            call.add_done_callback(lambda _, done=done: done.set())
            ended.append((call, done))
    deadline = time.monotonic() + FORK_QUIESCE_S
    for call, done in ended:
        if not done.wait(max(0.0, deadline - time.monotonic())):
            call.cancel()
            done.wait(FORK_QUIESCE_S)


os.register_at_fork(before=_end_idle_calls_before_fork)


def _on_end(call, fn: Callable) -> None:
    """``fn(call)`` once ``call`` ends (calls without callbacks, e.g. a test's fake: never)."""
    if hasattr(call, "add_done_callback"):
        call.add_done_callback(fn)


def _grouped(handle: "StepHandle") -> "StepHandle":
    group = current_group()
    if group is not None:
        handle._group = group
        group.add(handle)
        if not handle._reused and _has_ended(handle._responses):
            # its call failed before the handle joined the group (a shard that refuses at once:
            # its end callback found no step or no group to tell): the peers' parts end now, not
            # after waiting on a vote this shard will never cast
            handle._call_ended(handle._responses)
    return handle


def _has_ended(call) -> bool:
    """Whether ``call`` (a gRPC call) has ended (calls without ``done``, e.g. a test's: never)."""
    return call is not None and hasattr(call, "done") and call.done()


def _answered(call) -> bool:
    """Whether the shard itself ended ``call`` (a failed gRPC call or its error) with its status
    (``ANSWERED_KEY`` in the trailing metadata), not the transport or the call's own deadline."""
    trailing = call.trailing_metadata() if hasattr(call, "trailing_metadata") else None
    return any(key == contract.ANSWERED_KEY for key, _ in (trailing or ()))


def _never_started(exc: grpc.RpcError, reused: bool) -> bool:
    """Whether a call's failure before any response means its step never reached the shard.

    CANCELLED, on any call, unless this process cancelled it (its channel closed: ``Client.close``
    during a step) or the shard answered with its own Cancelled (``ANSWERED_KEY``): a crowded shard
    ends a call it finds idle, a reused one between steps or a fresh one whose step's first message
    had not come within its wait for new calls (a loaded client), before the step's first message
    was taken. (A shard stopping ends its calls the same way; a step it had taken is then resent
    with its sequence and applied once.) On a reused call also UNAVAILABLE
    from the transport (a dropped connection; on a fresh call that is the retry policy's). An
    UNAVAILABLE the shard sent itself (``ANSWERED_KEY``: e.g. its disk had no room) answered this
    very step: sent again on a fresh call as the same try, it would vote in a vote of its own that
    the other shards, which answered the try already, never join."""
    if exc.code() == grpc.StatusCode.CANCELLED:  # not this process's own cancel, nor the shard's Cancelled
        return exc.details() not in _LOCAL_CANCELS and not _answered(exc)
    return reused and exc.code() == grpc.StatusCode.UNAVAILABLE and not _answered(exc)


class StepHandle:
    """The responses of one step started by :meth:`StepStream.start`."""

    def __init__(self, stream: StepStream, responses, reused: bool, owns: bool):
        self._stream = stream
        self._responses = responses
        self._reused = reused
        self._owns = owns  # the step runs on the stream's shared call (else on a call of its own)
        self._expired = False  # the step's deadline passed: its call was cancelled
        self._group: Optional[StepGroup] = None
        self._ended = False  # finish returned or raised
        self._aborted: Optional[str] = None  # a peer's call failed: this step was ended (why)

    def _expire(self) -> None:
        self._expired = True
        self._responses.cancel()
        if self._group is not None:  # the peers' parts end now too, not each after a deadline of its own
            self._group.fail(f"DEADLINE_EXCEEDED: not done within {self._stream._timeout:g} s", self)

    def _call_ended(self, call) -> None:
        if self._group is not None and not self._ended and self._aborted is None:
            code = call.code() if hasattr(call, "code") else None
            if code in _FAILED:
                self._call_failed(call)

    def _call_failed(self, call) -> None:
        """This step's call ended with a status of ``_FAILED`` (``call``: the call or its error):
        the peers' parts end now, or after :data:`PEER_DEADLINE_GRACE_S` when the shard itself
        answered that the step ran out of time."""
        code = call.code()
        group, why = self._group, f"{code.name}: {call.details()}"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and _answered(call):
            DEADLINES.call_later(PEER_DEADLINE_GRACE_S, lambda: group.fail(why, self))
        else:
            group.fail(why, self)

    def _abort(self, why: str) -> None:
        """A peer step's call failed: ends this one (its finish raises UnavailableError, or
        DeadlineExceededError when the peer's step ran out of time), unless its call has ended
        already (its own answer is what its finish raises)."""
        if not self._ended and not _has_ended(self._responses) and hasattr(self._responses, "cancel"):
            self._aborted = why
            self._responses.cancel()

    def finish(self, on_response: Callable[[str, object], bool]) -> bool:
        """Feeds the step's responses to ``on_response`` until it returns True (``done``);
        returns False if the call ended before that.

        gRPC errors propagate (``grpc.RpcError``); a call the shard ended before any response (see
        :func:`_never_started`) raises :class:`StreamBroken` (the step did not start: safe to resend).
        """
        started = False
        timeout = self._stream._timeout
        timer = None
        if timeout is not None and hasattr(self._responses, "cancel"):
            timer = DEADLINES.call_later(timeout, self._expire)
        try:
            for kind, value in self._responses:
                started = True
                if on_response(kind, value):
                    return True
            if self._owns:
                self._stream.close()
            if self._reused and not started:
                raise StreamBroken("the shard had ended the call")
            return False
        except grpc.RpcError as exc:
            if self._owns:
                self._stream.close()
            if self._aborted is not None and exc.code() == grpc.StatusCode.CANCELLED:  # ended by _abort: applied
                # nowhere or once, resent with its sequence, applied once
                error = DeadlineExceededError if self._aborted.startswith("DEADLINE_EXCEEDED") else UnavailableError
                raise error(f"a peer shard's part of this step failed ({self._aborted})", error.code) from None
            if self._expired:
                raise DeadlineExceededError(f"the step was not done within the client's timeout of {timeout:g} s",
                                            "DEADLINE_EXCEEDED") from None
            if not started and _never_started(exc, self._reused):
                raise StreamBroken(exc.details()) from exc
            if self._group is not None and exc.code() in _FAILED:  # (its done-callback may come later)
                self._call_failed(exc)
            raise
        except BaseException:
            if self._owns:
                self._stream.close()
            raise
        finally:
            self._ended = True
            if timer is not None:
                DEADLINES.cancel(timer)
            if self._owns:
                with self._stream._mutex:
                    if self._stream._running is self:
                        self._stream._running = None
                self._stream._busy.release()
