"""A call served on an event loop whose work runs in a thread pool: what the thread sees of it.

A PushPull call (:mod:`~optserve.server.wire.push_pull`) waits for each step's first message on
the :class:`~optserve.server.wire.loop_server.LoopServer`'s loop, holding no thread, and runs the
step itself in the server's thread pool. The step's code was written for the synchronous server:
it reads the step's further messages from an iterator (:class:`LoopRequests`) and asks the call's
context (:class:`LoopCallContext`) whether the call is still active, how long it may take, and
whose it is. :class:`PoolRuns` advances a step's generator one answer at a time in the pool.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Executor, Future
from typing import Any, Callable, Generator, Optional

import grpc


class CallEnded(grpc.RpcError):
    """The call's messages cannot be read any more: the client cancelled it, or it timed out."""


class LoopCallContext:
    """The synchronous context API a step's code uses, for a ``grpc.aio`` call it runs beside.

    Built on the loop (it reads what it needs of the call there); its methods may be called from
    any thread. ``cancel()`` ends the call from any thread: the loop's waits raise
    :attr:`cancelled`'s event (see :meth:`wait_cancelled`).
    """

    def __init__(self, context: grpc.aio.ServicerContext, loop: asyncio.AbstractEventLoop):
        self.aio = context
        self._loop = loop
        self._ended = threading.Event()
        self._metadata = tuple(context.invocation_metadata() or ())
        self._peer = context.peer()
        remaining = context.time_remaining()
        self._deadline = None if remaining is None else time.monotonic() + remaining
        self.cancelled = asyncio.Event()  # set on the loop by cancel()
        context.add_done_callback(lambda _context: self._ended.set())

    def is_active(self) -> bool:
        return not self._ended.is_set() and not self.cancelled.is_set()

    def time_remaining(self) -> Optional[float]:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def invocation_metadata(self):
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def cancel(self) -> None:
        """Ends the call: its client hears CANCELLED (from any thread)."""
        self._loop.call_soon_threadsafe(self.cancelled.set)

    async def read(self):
        """The call's next message (None once the client ended its side), or raises
        :class:`CallEnded` once the call was cancelled (by :meth:`cancel` or the client)."""
        if self.cancelled.is_set():
            raise CallEnded()
        reading = asyncio.ensure_future(self.aio.read())
        cancelled = asyncio.ensure_future(self.cancelled.wait())
        try:
            await asyncio.wait((reading, cancelled), return_when=asyncio.FIRST_COMPLETED)
        finally:
            cancelled.cancel()
        if not reading.done():
            reading.cancel()
            raise CallEnded()
        try:
            message = reading.result()
        except (asyncio.CancelledError, grpc.RpcError, RuntimeError) as exc:
            raise CallEnded() from exc
        return None if message is grpc.aio.EOF else message


class LoopRequests:
    """The call's further messages as a blocking iterator, for a step's code in a pool thread
    (each ``next`` waits for the loop to read one); ends at the client's end of the call, and
    raises :class:`CallEnded` when the call was cancelled."""

    def __init__(self, context: LoopCallContext, loop: asyncio.AbstractEventLoop):
        self._context = context
        self._loop = loop

    def __iter__(self):
        return self

    def __next__(self):
        message = asyncio.run_coroutine_threadsafe(self._context.read(), self._loop).result()
        if message is None:
            raise StopIteration
        return message


_ANSWER, _RETURNED = 0, 1


def _advance(generator: Generator) -> tuple[int, Any]:
    try:
        return _ANSWER, next(generator)
    except StopIteration as stop:
        return _RETURNED, stop.value


class PoolRuns:
    """Runs a call's steps in a thread pool (see :meth:`run`), and the call's cleanup after the
    last of them (:meth:`after`)."""

    def __init__(self, pool: Executor):
        self._pool = pool
        self._running: Optional[Future] = None

    async def run(self, generator: Generator):
        """Runs ``generator`` in the pool one item at a time; yields each item, then
        :class:`Returned` with what it returned. Cancelled while the generator runs (the client
        went away), it closes the generator once the pool is done with it, never under it."""
        while True:
            self._running = running = self._pool.submit(_advance, generator)
            try:
                kind, value = await asyncio.wrap_future(running)
            except asyncio.CancelledError:
                running.add_done_callback(lambda _future: generator.close())
                raise
            if kind == _RETURNED:
                yield Returned(value)
                return
            yield value

    def after(self, cleanup: Callable[[], None]) -> None:
        """``cleanup()`` now, or in the pool once a step still running there ends: a step goes on
        after its call was cancelled, and what the call's end undoes (e.g. its worker leaving an
        elastic session) must come after what the step does (its push joining a round)."""
        running = self._running
        if running is None or running.done():
            cleanup()
        else:
            running.add_done_callback(lambda _future: cleanup())


class Returned:
    """The value a generator run by :meth:`PoolRuns.run` returned (its last item)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value
