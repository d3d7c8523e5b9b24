"""A long-lived PushPull call to one shard, reused by consecutive steps.

Opening a streaming call costs gRPC Python about 1.5 ms (a request thread, a server handler);
a step on an open stream costs a few hundred microseconds. So each shard of a session keeps one
PushPull call open and sends every step's messages into it (the shard serves steps one after
another on one call, see data.proto). The call is reopened when it:

- was idle for ``idle_s`` (the request iterator ends it, freeing the shard's thread);
- is older than ``reuse_s`` (the call's deadline is ``timeout + reuse_s``, so every step still
  gets at least ``timeout`` seconds);
- failed, or the shard ended it after a step (``StepDone.stream_closing``: it holds too many).

Each step still has its own deadline: a step not done within ``timeout`` cancels its call and
raises :class:`~optserve.client.errors.DeadlineExceededError` (the call's own, longer deadline
only ends a call that outlived its reuse).

A step is atomic on the shard whatever happens to the call (a broken stream stages nothing) and
retried steps reuse their sequence number, so reopening never applies a push twice.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Iterable, Optional

import grpc

from optserve.client._deadlines import DEADLINES
from optserve.client.errors import DeadlineExceededError
from optserve.protos import contract
from optserve.protos.optserve.v1 import data_pb2

_END = object()
_GOODBYE = data_pb2.PushPullRequest(goodbye=True)  # the call ends on purpose: this client is alive


class StreamBroken(Exception):
    """A reused call had already ended when a step was sent into it: the step did not start."""


class StepStream:
    """Consecutive steps on one PushPull call (one step at a time; see the module docstring).

    Args:
      open_call: ``open_call(request_iterator, timeout)`` -> the call's response iterator of
        ``(kind, value)`` pairs (the SDK's ``ShardCalls.push_pull``, :mod:`optserve.client._fanout`).
      timeout: the per-step deadline in seconds (None: none).
      idle_s: an open call unused this long is ended.
      reuse_s: a call is reused for steps that start within this many seconds of its opening.
    """

    def __init__(self, open_call: Callable, timeout: Optional[float], idle_s: float = 10.0, reuse_s: float = 60.0):
        self._open_call = open_call
        self._timeout = timeout
        self._idle_s = idle_s
        self._reuse_s = reuse_s
        self._busy = threading.Lock()  # one step at a time on the open call
        self._mutex = threading.Lock()  # guards the fields below
        self._requests: Optional[queue.SimpleQueue] = None
        self._responses = None
        self._opened_at = 0.0

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
            return StepHandle(self, self._open_call(iter(messages), self._timeout), reused=False, owns=False)
        try:
            with self._mutex:
                reused = self._requests is not None and time.monotonic() - self._opened_at < self._reuse_s
                if not reused:
                    self._close_locked()
                    self._open_locked()
                self._requests.put(messages)  # under the mutex: the idle check sees a non-empty queue
                return StepHandle(self, self._responses, reused=reused, owns=True)
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
        self._responses = self._open_call(self._request_iterator(requests), deadline)
        self._opened_at = time.monotonic()

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


def _never_started(exc: grpc.RpcError) -> bool:
    """Whether a reused call's failure before any response means its step never reached the
    shard: CANCELLED (a crowded shard ends a call it found idle), or UNAVAILABLE from the transport
    (a dropped connection). An UNAVAILABLE the shard sent itself (``ANSWERED_KEY``: e.g. its disk
    had no room) answered this very step: sent again on a fresh call as the same try, it would
    vote in a vote of its own that the other shards, which answered the try already, never join."""
    if exc.code() == grpc.StatusCode.CANCELLED:
        return True
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    return not any(key == contract.ANSWERED_KEY for key, _ in (trailing or ()))


class StepHandle:
    """The responses of one step started by :meth:`StepStream.start`."""

    def __init__(self, stream: StepStream, responses, reused: bool, owns: bool):
        self._stream = stream
        self._responses = responses
        self._reused = reused
        self._owns = owns  # the step runs on the stream's shared call (else on a call of its own)
        self._expired = False  # the step's deadline passed: its call was cancelled

    def _expire(self) -> None:
        self._expired = True
        self._responses.cancel()

    def finish(self, on_response: Callable[[str, object], bool]) -> bool:
        """Feeds the step's responses to ``on_response`` until it returns True (``done``);
        returns False if the call ended before that.

        gRPC errors propagate (``grpc.RpcError``); a reused call found ended before any response
        (see :func:`_never_started`) raises :class:`StreamBroken` (the step did not start: safe to resend).
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
            if self._expired:
                raise DeadlineExceededError(f"the step was not done within the client's timeout of {timeout:g} s",
                                            "DEADLINE_EXCEEDED") from None
            if self._reused and not started and _never_started(exc):
                raise StreamBroken(exc.details()) from exc
            raise
        except BaseException:
            if self._owns:
                self._stream.close()
            raise
        finally:
            if timer is not None:
                DEADLINES.cancel(timer)
            if self._owns:
                self._stream._busy.release()
