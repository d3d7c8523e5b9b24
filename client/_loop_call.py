"""A ``grpc.aio`` stream-stream call used from ordinary threads as a synchronous one is.

The client's :class:`~optserve.client._step_stream.StepStream` keeps a PushPull call open per
shard between steps. On gRPC's synchronous stack every such call keeps its channel's polling
thread awake and every step's wait polls (see :mod:`optserve.client._loop`); here the call lives
on the process's event loop and a thread waiting for a response blocks on a future.

:class:`LoopStreamCall` offers what the step code uses of a synchronous call: iteration over the
responses (a failed call raises its :class:`grpc.RpcError`; one this process cancelled raises
CANCELLED with gRPC's "Locally cancelled by application!"), ``cancel()`` from any thread,
``done()``, ``add_done_callback(fn)`` (``fn(call)`` runs on the loop's thread once the call ended,
or at once if it has) and, once ended, ``code()``, ``details()`` and ``trailing_metadata()``.

Its request messages come from a synchronous iterator that may block between steps (a queue the
step code feeds): a thread of the call's own takes each message from it and hands it to the
call, at most a few ahead of what the call took (a large step's chunks are not all queued).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from typing import Callable, Iterable, Optional

import grpc

from optserve.client import _loop
from optserve.client._loop import CANCELLED, EventLoopThread

_LOCALLY_CANCELLED = "Locally cancelled by application!"  # the details gRPC gives a call its process cancelled
_log = logging.getLogger(__name__)
_EOF = object()  # the responses ended (OK), or the requests did
WRITES_AHEAD = 4  # request messages handed to the loop before the call took them


class LocallyCancelledError(grpc.RpcError):
    """A read of a call this process cancelled (grpc.aio raises asyncio's CancelledError there;
    the step code expects the synchronous stack's CANCELLED error)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.CANCELLED

    def details(self) -> str:
        return _LOCALLY_CANCELLED

    def trailing_metadata(self) -> tuple:
        return ()

    def __str__(self) -> str:
        return f"CANCELLED: {_LOCALLY_CANCELLED}"


class LoopStreamStream:
    """A stream-stream method called like a synchronous multicallable:
    ``method(request_iterator, timeout)`` -> :class:`LoopStreamCall`, or, in a process where the
    loop is not :func:`~optserve.client._loop.usable` (a forked child), ``fallback``'s call.

    Args:
      channel: ``channel()`` -> the ``grpc.aio.Channel`` to call on (asked on the loop's thread at
        each call; opened there on first use).
      method, request_serializer, response_deserializer: as ``grpc.aio.Channel.stream_stream``'s.
      fallback: the same method on a synchronous channel.
    """

    def __init__(self, channel: Callable[[], "grpc.aio.Channel"], method: str, request_serializer: Callable,
                 response_deserializer: Callable, fallback: Callable):
        self._channel = channel
        self._method = method
        self._serializer = request_serializer
        self._deserializer = response_deserializer
        self._fallback = fallback
        self._on: tuple = (None, None)  # (the channel, its multicallable of the method)

    def __call__(self, request_iterator: Iterable, timeout: Optional[float] = None):
        if not _loop.usable():
            return self._fallback(request_iterator, timeout)
        return LoopStreamCall(_loop.shared(), self._open, request_iterator, timeout)

    async def _open(self, timeout: Optional[float]):
        channel = self._channel()
        if self._on[0] is not channel:  # (a Client closed and used again opens a new channel)
            self._on = (channel, channel.stream_stream(self._method, request_serializer=self._serializer,
                                                       response_deserializer=self._deserializer))
        return self._on[1](timeout=timeout)


class LoopStreamCall:
    """One call (see the module docstring); made by :class:`LoopStreamStream`.

    On the loop, a reader task takes every response as it arrives and puts it, then how the call
    ended, on a queue the iterating thread blocks on; a writer task writes what the request thread
    hands it, at most :data:`WRITES_AHEAD` messages ahead of the call."""

    def __init__(self, loop: EventLoopThread, open_call: Callable, requests: Iterable, timeout: Optional[float]):
        self._loop = loop
        self._lock = threading.Lock()
        self._status: Optional[tuple] = None  # (code, details, trailing metadata) once ended
        self._callbacks: Optional[list] = []  # None once they ran
        self._responses: queue.SimpleQueue = queue.SimpleQueue()  # messages, then _EOF or the error
        self._room = threading.Semaphore(WRITES_AHEAD)  # requests handed to the writer, not yet taken
        self._writing = True  # False once the writer stopped (the call ended): the request thread stops
        self._outbox: Optional[asyncio.Queue] = None  # the writer task's, made on the loop
        self._writer: Optional[asyncio.Task] = None
        self._call = None  # the grpc.aio call, set on the loop (it may end before run() returns)
        loop.run(self._started(open_call, timeout))
        threading.Thread(target=self._send, args=(iter(requests),), name="optserve-send", daemon=True).start()

    async def _started(self, open_call: Callable, timeout: Optional[float]):
        call = await open_call(timeout)
        self._call = call  # before its end can be seen: _ended reads it
        self._outbox = asyncio.Queue()
        call.add_done_callback(lambda _: self._loop.loop.create_task(self._ended()))
        self._loop.loop.create_task(self._read_all(call))
        self._writer = self._loop.loop.create_task(self._write_all(call))
        # a writer cancelled before its first step (the call over already) never runs its body:
        # the end of writing is told from the task's end, whichever way it ends
        self._writer.add_done_callback(self._writing_ended)
        return call

    async def _ended(self) -> None:
        self._writer.cancel()  # a writer waiting for requests stops (and so does the request thread)
        status = await self._status_of_call()
        with self._lock:
            self._status = status
            callbacks, self._callbacks = self._callbacks, None
        # let go of the call: it and its callback hold this object, and until that cycle is
        # collected the channel's connection stays open (a closed grpc.aio channel keeps it)
        self._call = self._writer = None
        for fn in callbacks:
            fn(self)

    async def _read_all(self, call) -> None:
        """The reader task: each response onto the queue, then _EOF or the call's error."""
        try:
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    self._responses.put(_EOF)
                    return
                self._responses.put(message)
        except CANCELLED:
            self._responses.put(LocallyCancelledError())
        except Exception as error:  # noqa: BLE001 - the call's failure (grpc.RpcError), for its reader
            self._responses.put(error)

    async def _write_all(self, call) -> None:
        """The writer task: the request thread's messages into the call, then the end of writing."""
        try:
            while True:
                message = await self._outbox.get()
                self._room.release()
                if message is _EOF:
                    await call.done_writing()
                    return
                await call.write(message)
        except (Exception, *CANCELLED):  # noqa: BLE001 - the call ended: its reader gets why
            pass

    def _writing_ended(self, _writer: asyncio.Task) -> None:
        self._writing = False
        self._room.release(WRITES_AHEAD + 1)  # a request thread waiting for room sees the end

    def _send(self, requests) -> None:
        """The request thread: each message to the writer task, then the end of the requests."""
        try:
            for message in itertools.chain(requests, (_EOF,)):
                self._room.acquire()
                if not self._writing:
                    return
                try:
                    self._loop.loop.call_soon_threadsafe(self._outbox.put_nowait, message)
                except RuntimeError:  # the loop closed (the interpreter is ending)
                    return
        except Exception:  # noqa: BLE001 - the requests failed: the call is cancelled (as gRPC's own stack does)
            _log.debug("a PushPull call's requests raised; cancelling the call", exc_info=True)
            self.cancel()

    # ----------------------------------------------------------------- the synchronous call's API
    def __iter__(self) -> "LoopStreamCall":
        return self

    def __next__(self):
        item = self._responses.get()
        if item is _EOF or isinstance(item, BaseException):
            self._responses.put(item)  # the next read ends the same way
            if item is _EOF:
                raise StopIteration
            raise item
        return item

    def cancel(self) -> bool:
        """Ends the call (CANCELLED) unless it has ended; returns at once."""
        call = self._call
        if call is None or call.done():
            return False
        self._loop.call_soon(call.cancel)
        return True

    def done(self) -> bool:
        call = self._call
        return call is None or call.done()

    def add_done_callback(self, fn: Callable[["LoopStreamCall"], None]) -> None:
        with self._lock:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                return
        fn(self)

    def code(self) -> grpc.StatusCode:
        return self._final()[0]

    def details(self) -> str:
        return self._final()[1]

    def trailing_metadata(self) -> tuple:
        return self._final()[2]

    def _final(self) -> tuple:
        """The call's status (waits for the call to end where it has not)."""
        status = self._status
        return status if status is not None else self._loop.run(self._status_of_call())

    async def _status_of_call(self) -> tuple:
        if self._status is not None:  # (it ended, and let go of the call, meanwhile)
            return self._status
        call = self._call
        return await call.code(), await call.details(), tuple(await call.trailing_metadata())
