"""The process's event loop for the data plane's long-lived calls (see :mod:`optserve.client._loop_call`).

gRPC Python's synchronous calls cost a waiting client CPU while nothing happens: each channel
with a call open has a thread of its own that wakes every 200 ms, and each thread waiting for a
response wakes every 100 ms. A process of many clients (a crowd of workers, each with its own
connections) spends most of its CPU on those wake-ups once its steps wait, and takes it from
the server on the same machine. ``grpc.aio`` instead waits on one completion queue per process
and an event loop: a waiting call costs nothing.

:func:`shared` is that loop, one per process, in a daemon thread started on first use. gRPC
does not carry ``grpc.aio`` across ``fork``: a child forked after its parent started the loop
uses gRPC's synchronous calls instead (:func:`usable`), and calls open on the loop when a
process forks are ended first (see :mod:`optserve.client._step_stream`). Code on other threads hands it coroutines with :meth:`run` (which
blocks on a future, not a polling loop) or callables with :meth:`call_soon`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from typing import Any, Awaitable, Callable, Optional


class EventLoopThread:
    """An asyncio event loop running in a daemon thread of its own."""

    def __init__(self, name: str = "optserve-loop"):
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(started,), name=name, daemon=True)
        self._thread.start()
        started.wait()

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(started.set)
        self.loop.run_forever()

    def in_loop(self) -> bool:
        """Whether the caller runs on the loop's own thread."""
        return threading.current_thread() is self._thread

    def run(self, awaitable: Awaitable, timeout: Optional[float] = None) -> Any:
        """``await awaitable`` on the loop; blocks this thread until it is done and returns its
        result or raises its exception (``concurrent.futures.CancelledError`` if it was cancelled,
        ``TimeoutError`` after ``timeout`` seconds). Never called from the loop's own thread."""
        if self.in_loop():
            raise RuntimeError("EventLoopThread.run from the loop's own thread would wait on itself")
        return asyncio.run_coroutine_threadsafe(_awaited(awaitable), self.loop).result(timeout)

    def call_soon(self, fn: Callable, *args) -> None:
        """``fn(*args)`` on the loop: at once when called from the loop's thread, else next."""
        if self.in_loop():
            fn(*args)
        else:
            self.loop.call_soon_threadsafe(fn, *args)


async def _awaited(awaitable: Awaitable) -> Any:
    return await awaitable


_lock = threading.Lock()
_shared: Optional[tuple[int, EventLoopThread]] = None  # (the pid that started it, the loop)
CANCELLED = (asyncio.CancelledError, concurrent.futures.CancelledError)  # what an awaited cancel raises


def usable() -> bool:
    """Whether this process may put calls on the loop: grpc.aio does not survive ``fork``, so a
    child forked after its parent had started the loop may not (it uses the synchronous stack)."""
    entry = _shared
    return entry is None or entry[0] == os.getpid()


def running() -> bool:
    """Whether this process has started its loop."""
    entry = _shared
    return entry is not None and entry[0] == os.getpid()


def shared() -> EventLoopThread:
    """This process's loop, started on first use. Refused where not :func:`usable`."""
    global _shared
    with _lock:
        if _shared is None:
            _shared = (os.getpid(), EventLoopThread())
        elif _shared[0] != os.getpid():
            raise RuntimeError("grpc.aio was started before this process was forked: use the synchronous stack")
        return _shared[1]
