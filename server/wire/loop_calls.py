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
import logging
import threading
import time
from concurrent.futures import Executor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Generator, Optional

import grpc

from optserve.server.domain.errors import OptservError
from optserve.server.domain.waits import Wait

_log = logging.getLogger(__name__)
_LOOP_CHECK_S = 1.0  # how often a thread reading a call's messages looks whether the server stopped


class CallEnded(grpc.RpcError):
    """The call's messages cannot be read any more: the client cancelled it, or it timed out."""


class LoopCallContext:
    """The synchronous context API a step's code uses, for a ``grpc.aio`` call it runs beside.

    Built on the loop (it reads what it needs of the call there); its methods may be called from
    any thread. ``cancel()`` ends the call from any thread: it sets :attr:`cancelled`, and a
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
        finally:  # also when this task is cancelled (the client went away): nothing left behind
            for task in (reading, cancelled):
                if not task.done():
                    task.cancel()
        if reading.cancelled():
            raise CallEnded()
        try:
            message = reading.result()
        except Exception as exc:  # noqa: BLE001 - the call ended under the read (cancelled, server stopping)
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
        if not self._loop.is_running():  # the server stopped
            raise CallEnded()
        reading = asyncio.run_coroutine_threadsafe(self._context.read(), self._loop)
        while True:
            try:
                message = reading.result(timeout=_LOOP_CHECK_S)
                break
            except FutureTimeout:
                if not self._loop.is_running():
                    reading.cancel()
                    raise CallEnded() from None
        if message is None:
            raise StopIteration
        return message


_ANSWER, _RETURNED = 0, 1


def _advance(generator: Generator, sent: Optional[bool]) -> tuple[int, Any]:
    try:
        return _ANSWER, generator.send(sent)
    except StopIteration as stop:
        return _RETURNED, stop.value


def _log_unheard(exc: BaseException) -> None:
    """A step whose call ended failed: a refusal has nobody to go to; a fault is logged."""
    if isinstance(exc, OptservError):
        _log.debug("a step whose call ended was refused: %s", exc)
    else:
        _log.error("event=server_error rpc=ShardData/PushPull (a step whose call ended)", exc_info=exc)


async def _waited(wait: Wait) -> bool:
    """Waits on the loop (no thread) for ``wait``; returns whether it ended before its timeout."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def wake(_future) -> None:
        loop.call_soon_threadsafe(lambda: done.done() or done.set_result(True))

    wait.future.add_done_callback(wake)
    try:
        return await asyncio.wait_for(done, wait.timeout_s)
    except asyncio.TimeoutError:
        wait.gave_up()
        return False


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

    async def _hop(self, generator: Generator, sent: Optional[bool]) -> tuple[int, Any]:
        """One stretch of the generator in the pool (shielded: a cancelled call never drops a
        stretch queued in the pool, see :meth:`run`)."""
        return await asyncio.shield(asyncio.wrap_future(self._pool.submit(_advance, generator, sent)))

    async def run(self, generator: Generator):
        """Runs ``generator`` in the pool between its waits: each :class:`~optserve.server.domain.waits.Wait`
        it yields is awaited on the loop (no thread held) and answered with whether it ended in
        time; every other item is yielded, then :class:`Returned` with what it returned.

        Cancelled (the client went away), the step goes on without it up to its next answer, as
        a thread of a synchronous server would (its part of a decided push is applied here):
        :meth:`_finish`, awaited by :meth:`after`."""
        sent = None
        while True:
            hop = asyncio.ensure_future(self._hop(generator, sent))
            try:
                kind, value = await asyncio.shield(hop)
            except asyncio.CancelledError:
                self._running = _kept(asyncio.ensure_future(self._finish(generator, hop=hop)))
                raise
            if kind == _RETURNED:
                yield Returned(value)
                return
            if isinstance(value, Wait):
                try:
                    sent = await _waited(value)
                except asyncio.CancelledError:
                    self._running = _kept(asyncio.ensure_future(self._finish(generator, wait=value)))
                    raise
                continue
            sent = None
            yield value

    async def _finish(self, generator: Generator, hop: Optional[asyncio.Future] = None,
                      wait: Optional[Wait] = None) -> None:
        """A step whose call ended: from its stretch running in the pool (``hop``) or its
        ``wait``, it runs on (its waits on the loop) up to its next answer, then is closed."""
        try:
            if hop is not None:
                kind, item = await hop
                if kind == _RETURNED or not isinstance(item, Wait):
                    return
                wait = item
            while True:
                kind, item = await self._hop(generator, await _waited(wait))
                if kind == _RETURNED or not isinstance(item, Wait):
                    return
                wait = item
        except Exception as exc:  # noqa: BLE001 - nobody to answer: see _log_unheard
            _log_unheard(exc)
        finally:
            await asyncio.wrap_future(self._pool.submit(generator.close))

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


class Returned:
    """The value a generator run by :meth:`PoolRuns.run` returned (its last item)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value
