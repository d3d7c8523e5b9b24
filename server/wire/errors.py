"""The one table from domain errors to gRPC status codes, and the decorator servicers use.

Servicers never choose status codes themselves: they wrap their methods with
:func:`grpc_errors`, which aborts the RPC with :func:`status_code_for` the exception and, for a
refused push, trailing metadata the client reads (:mod:`optserve.protos.contract`).
"""

from __future__ import annotations

import functools
import inspect
import logging

import grpc

from optserve.protos import contract
from optserve.server.domain import errors
from optserve.server.domain.events import log_event

log = logging.getLogger(__name__)

# Most specific class first: the first match wins.
STATUS_CODES: tuple[tuple[type[errors.OptservError], grpc.StatusCode], ...] = (
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),  # NonFinite included
    (errors.Stale, grpc.StatusCode.ABORTED),
    (errors.PeerRefused, grpc.StatusCode.ABORTED),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.Cancelled, grpc.StatusCode.CANCELLED),
    (errors.Timeout, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.SessionLost, grpc.StatusCode.DATA_LOSS),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
)


def status_code_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status for an exception (unwrapped from a Ray error): its class's code, else INTERNAL."""
    exc = errors.unwrap(exc)
    for cls, code in STATUS_CODES:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def _abort(context: grpc.ServicerContext, exc: BaseException, rpc: str = "", refusal_level: int = logging.DEBUG):
    """Ends the RPC with the exception's status. One log line: a server fault (INTERNAL) as
    ``event=server_error`` at ERROR with its traceback; a refusal as ``event=rpc_refused`` at
    ``refusal_level`` (the servicer's; the shards log refused pushes themselves)."""
    if not context.is_active():  # the client went away: nobody to tell
        log.debug("RPC ended by the client: %s", exc)
        return
    inner = errors.unwrap(exc)
    code = status_code_for(inner)
    if code is grpc.StatusCode.INTERNAL:
        log_event(log, logging.ERROR, "server_error", rpc=rpc, error=type(inner).__name__, exc_info=exc)
        message = f"internal error: {type(inner).__name__}: {inner}"
    else:
        message = str(inner)
        log_event(log, refusal_level, "rpc_refused", rpc=rpc, code=code.name, message=message)
    if isinstance(inner, errors.Stale):
        context.set_trailing_metadata(((contract.CURRENT_VERSION_KEY, str(inner.current_version)),))
    elif isinstance(inner, errors.PeerRefused):
        context.set_trailing_metadata(((contract.PEER_REFUSED_KEY, "1"),))
    context.abort(code, message)


def grpc_errors(method):
    """Decorates a servicer method (unary or streaming) so domain errors become statuses."""
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream_wrapper(self, request, context):
            try:
                yield from method(self, request, context)
            except Exception as exc:  # noqa: BLE001 - mapped to a status, never swallowed
                if isinstance(exc, grpc.RpcError) and context.code() is not None:
                    raise
                _abort(context, exc, _rpc_name(self, method), getattr(self, "refusal_log_level", logging.DEBUG))

        return stream_wrapper

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, grpc.RpcError) and context.code() is not None:
                raise
            _abort(context, exc, _rpc_name(self, method), getattr(self, "refusal_log_level", logging.DEBUG))

    return wrapper


def _rpc_name(servicer, method) -> str:
    """``Service/Method`` for log lines (the servicer class without its ``Servicer`` suffix)."""
    return f"{type(servicer).__name__.removesuffix('Servicer')}/{method.__name__}"
