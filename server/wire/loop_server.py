"""A gRPC server whose calls wait on an event loop: an open call holds no thread while it waits.

A shard's ShardData runs on :class:`LoopServer`: ``grpc.aio`` on an event loop of its own thread,
with the synchronous server's surface (handlers added, ports bound, ``start``, ``stop``) so the
shard actor builds it as it built ``grpc.server``. Handlers written as coroutines or async
generators (PushPull, :mod:`~optserve.server.wire.push_pull`) run on the loop; every other handler
runs in the thread pool, as before, and gets a context with the synchronous API it was written
for (:class:`SyncCallContext`). The synchronous interceptors (:mod:`~optserve.server.wire.security`)
run unchanged through :class:`_LoopInterceptor`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import threading
from concurrent.futures import Executor
from typing import Any, Callable, Optional, Sequence

import grpc

_START_TIMEOUT_S = 30.0
_log = logging.getLogger(__name__)
_GRPC_AIO_LOGGER = "grpc._cython.cygrpc"


class _ClientGoneOneLine(logging.Filter):
    """grpc.aio logs an ERROR with a traceback when a servicer method's call could not be ended
    because the call was over already (``ExecuteBatchError: Failed "execute_batch"``: its client
    left, or its deadline passed, before its status or last message was sent): an expected
    condition, made one INFO line. A batch core refused to start (``Failed
    grpc_call_start_batch``: the server misused the call) and every other record stay as they were."""

    _PREFIX = "ExecuteBatchError raised in core by servicer method ["

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        message = record.getMessage()
        if (type(error).__name__ != "ExecuteBatchError" or not message.startswith(self._PREFIX)
                or not str(error).startswith('Failed "execute_batch"')):
            return True
        _log.info("event=call_end_not_sent method=%s reason=%s", message[len(self._PREFIX):].rstrip("]"),
                  json.dumps("the call was over (its client left or its deadline passed) before its end was sent"))
        return False


_filter_lock = threading.Lock()
_filter_installed = False


def quiet_client_gone() -> None:
    """Makes grpc.aio's report of a call whose client left before its end was sent one line
    (:class:`_ClientGoneOneLine`), once per process."""
    global _filter_installed
    with _filter_lock:
        if not _filter_installed:
            logging.getLogger(_GRPC_AIO_LOGGER).addFilter(_ClientGoneOneLine())
            _filter_installed = True


class SyncCallContext:
    """The context a thread-pool handler of a :class:`LoopServer` sees: grpc.aio's synchronous
    context (no ``is_active``, ``code`` or ``cancel``) with the two it lacks that our handlers
    ask: ``code()`` (the status the handler set or aborted with, None before) and ``is_active()``.
    grpc.aio tells a synchronous handler of its call's end only once a unary answer was sent, so
    ``is_active()`` stays True while the handler runs: a client gone mid-upload shows as its
    request stream ending early (an incomplete push, refused and applied nowhere)."""

    __slots__ = ("_context", "_ended", "_code")

    def __init__(self, context):
        self._context = context
        self._ended = threading.Event()
        self._code: Optional[grpc.StatusCode] = None
        context.add_callback(self._ended.set)

    def is_active(self) -> bool:
        return not self._ended.is_set()

    def code(self) -> Optional[grpc.StatusCode]:
        return self._code

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code
        self._context.set_code(code)

    def abort(self, code: grpc.StatusCode, details: str = ""):
        self._code = code
        self._context.abort(code, details)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def _with_sync_context(behavior: Callable, streaming: bool) -> Callable:
    """``behavior(request, context)`` called with a :class:`SyncCallContext`. A streaming answer's
    behavior is always a generator here, also one that returns its iterator or aborts before
    answering (grpc.aio leaves a plain function's abort unanswered, and the call hangs)."""
    if streaming:
        def answers(request, context):
            result = behavior(request, SyncCallContext(context))
            if result is not None:
                yield from result
        return answers

    def unary(request, context):
        return behavior(request, SyncCallContext(context))
    return unary


def _is_async(behavior: Optional[Callable]) -> bool:
    return inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)


def loop_handler(handler: Optional[grpc.RpcMethodHandler]) -> Optional[grpc.RpcMethodHandler]:
    """``handler`` with its synchronous behavior given a :class:`SyncCallContext` (an async one
    as it is)."""
    if handler is None:
        return None
    for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        behavior = getattr(handler, kind)
        if behavior is not None and not _is_async(behavior):
            return handler._replace(**{kind: _with_sync_context(behavior, kind.endswith("_stream"))})
    return handler


class _LoopGenericHandler(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler):
        self._inner = inner

    def service(self, handler_call_details):
        return loop_handler(self._inner.service(handler_call_details))


class _LoopInterceptor(grpc.aio.ServerInterceptor):
    """A synchronous ``grpc.ServerInterceptor`` on a grpc.aio server: it gets the handler the
    rest of the chain resolved, and what it returns (a refusal) is served like any handler."""

    def __init__(self, inner: grpc.ServerInterceptor):
        self._inner = inner

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        return loop_handler(self._inner.intercept_service(lambda _details: handler, handler_call_details))


class LoopServer:
    """``grpc.aio`` on an event loop of its own (daemon) thread, built and driven from any thread.

    Args:
      thread_pool: where the synchronous handlers run.
      options: channel options, as for ``grpc.server``.
      interceptors: synchronous interceptors (checked in order before each call's handler).
      name: the loop thread's name.

    Attributes:
      loop: the event loop the server's async handlers run on.
    """

    def __init__(self, thread_pool: Executor, options: Sequence = (),
                 interceptors: Sequence[grpc.ServerInterceptor] = (), name: str = "optserve-loop"):
        quiet_client_gone()
        self.thread_pool = thread_pool
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

        async def build():
            return grpc.aio.server(migration_thread_pool=thread_pool, options=tuple(options),
                                   interceptors=[_LoopInterceptor(i) for i in interceptors])

        self._server = self._call(build())

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def _call(self, coroutine, timeout: Optional[float] = _START_TIMEOUT_S):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def _on_loop(self, function: Callable, *args):
        async def call():
            return function(*args)
        return self._call(call())

    # the synchronous server's surface (what grpc's generated add_*_to_server functions call)
    def add_generic_rpc_handlers(self, handlers) -> None:
        self._on_loop(self._server.add_generic_rpc_handlers, tuple(_LoopGenericHandler(h) for h in handlers))

    def add_registered_method_handlers(self, service_name: str, handlers: dict) -> None:
        self._on_loop(self._server.add_registered_method_handlers, service_name,
                      {name: loop_handler(h) for name, h in handlers.items()})

    def add_insecure_port(self, address: str) -> int:
        return self._on_loop(self._server.add_insecure_port, address)

    def add_secure_port(self, address: str, credentials: grpc.ServerCredentials) -> int:
        return self._on_loop(self._server.add_secure_port, address, credentials)

    def start(self) -> None:
        self._call(self._server.start())

    def stop(self, grace: Optional[float] = None) -> None:
        """Ends every call (those running get ``grace`` seconds) and stops the loop's thread."""
        if not self._thread.is_alive():
            return
        try:
            self._call(self._server.stop(grace), timeout=None)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5.0)
