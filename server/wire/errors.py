"""The one table from domain errors to gRPC status codes, and the decorator servicers use.

Servicers never choose status codes themselves: they wrap their methods with
:func:`grpc_errors`, which aborts the RPC with :func:`status_code_for` the exception and, for a
refused push, trailing metadata the client reads (:mod:`optserve.protos.contract`).

Requests that do not decode never reach gRPC's own handling (which answers INTERNAL): services
register :func:`safe_decoder` deserializers, which turn such bytes into a :class:`Malformed`
request, and :func:`grpc_errors` refuses it as INVALID_ARGUMENT (in a stream, when the servicer
reaches it). Any other exception escaping a servicer is a server fault: INTERNAL, logged with its
traceback; no handler answers UNKNOWN.
"""

from __future__ import annotations

import collections.abc
import functools
import inspect
import logging
import re
import uuid
from typing import Any, Callable

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
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
)


class Malformed:
    """A request whose bytes did not decode (what :func:`safe_decoder` returns instead of raising)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


def safe_decoder(decode: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """A gRPC request deserializer: ``decode(bytes)``, or a :class:`Malformed` request when it raises."""

    def deserialize(serialized: bytes):
        try:
            return decode(serialized)
        except Exception as exc:  # noqa: BLE001 - any failure to decode is the request's fault
            return Malformed(f"{type(exc).__name__}: {exc}"[:200])

    return deserialize


def add_unary_service(server, pb2_module, service: str, servicer) -> None:
    """Serves ``service`` (every method unary, described in ``pb2_module``) by ``servicer``'s
    methods of the same names, like the generated ``add_<Service>Servicer_to_server`` but with
    deserializers that hand undecodable requests to the servicer (:func:`safe_decoder`), which
    refuses them INVALID_ARGUMENT (gRPC's own answer would be INTERNAL)."""
    import grpc

    descriptor = pb2_module.DESCRIPTOR.services_by_name[service]
    handlers = {}
    for method in descriptor.methods:
        request, response = (getattr(pb2_module, t.name) for t in (method.input_type, method.output_type))
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, method.name), request_deserializer=safe_decoder(request.FromString),
            response_serializer=response.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(descriptor.full_name, handlers),))


def _refuse_malformed(request: Malformed, method: str):
    raise errors.InvalidArgument(f"{method}: the request could not be parsed ({request.reason})")


def checked_message(request, method: str):
    """``request``, or InvalidArgument when its bytes did not decode (a :class:`Malformed`)."""
    if isinstance(request, Malformed):
        _refuse_malformed(request, method)
    return request


def checked_messages(requests, method: str):
    """A request stream whose malformed messages raise InvalidArgument where they are read."""
    for request in requests:
        if isinstance(request, Malformed):
            _refuse_malformed(request, method)
        yield request


def _checked(request, method: str):
    """The request (or request stream) a servicer method may read; a malformed one is refused."""
    if isinstance(request, Malformed):
        _refuse_malformed(request, method)
    if isinstance(request, collections.abc.Iterator):
        return checked_messages(request, method)
    return request


def status_code_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status for an exception (unwrapped from a Ray error): its class's code, else INTERNAL."""
    exc = errors.unwrap(exc)
    for cls, code in STATUS_CODES:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


# Status details travel in trailing metadata, which clients refuse past 16 KiB (the call then fails
# with a transport RESOURCE_EXHAUSTED instead of its status): messages echo names the client sent
# (a session name may be megabytes), so they are cut to this many characters.
MAX_DETAILS_CHARS = 2048


_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_TRACEBACK = "Traceback (most recent call last)"


def clean_message(message: str) -> str:
    """A status message fit for a client: terminal escape codes removed, and a traceback carried
    inside it (a Ray error's text) cut off, keeping the lines before it and the error's last
    line (the traceback itself goes to the server log)."""
    message = _ESCAPES.sub("", message)
    if _TRACEBACK not in message:
        return message
    head, _, trace = message.partition(_TRACEBACK)
    last = next((line.strip() for line in reversed(trace.splitlines()) if line.strip()), "")
    return " ".join(part for part in (head.strip().rstrip(":"), last) if part)


def _bounded(message: str) -> str:
    if len(message) <= MAX_DETAILS_CHARS:
        return message
    cut = len(message) - MAX_DETAILS_CHARS
    return f"{message[:MAX_DETAILS_CHARS - 40]} ... [{cut} characters cut]"


def refusal(exc: BaseException, rpc: str = "", refusal_level: int = logging.DEBUG
            ) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """The status an exception ends its RPC with: ``(code, message, trailing metadata)``. Logs one
    line: a server fault (INTERNAL) as ``event=server_error`` at ERROR with its traceback; a
    refusal as ``event=rpc_refused`` at ``refusal_level`` (the servicer's; the shards log refused
    pushes themselves)."""
    inner = errors.unwrap(exc)
    code = status_code_for(inner)
    if code is grpc.StatusCode.INTERNAL:
        request_id = uuid.uuid4().hex[:12]
        log_event(log, logging.ERROR, "server_error", rpc=rpc, request_id=request_id, error=type(inner).__name__,
                  exc_info=exc)
        message = (f"internal error: {type(inner).__name__}: {clean_message(str(inner))} "
                   f"(the server log has the details under request_id={request_id})")
    else:
        message = clean_message(str(inner))
        log_event(log, refusal_level, "rpc_refused", rpc=rpc, code=code.name, message=message)
    trailing = ((contract.ANSWERED_KEY, "1"),)
    if isinstance(inner, (errors.Stale, errors.FutureBase)):
        late = ((contract.LATE_KEY, "1"),) if isinstance(inner, errors.Late) else ()
        trailing += ((contract.CURRENT_VERSION_KEY, str(inner.current_version)),) + late
    elif isinstance(inner, errors.PeerRefused):
        trailing += ((contract.PEER_REFUSED_KEY, "1"),)
    elif isinstance(inner, errors.Replaced):
        trailing += ((contract.REPLACED_KEY, "1"),)
    return code, _bounded(message), trailing


def _abort(context: grpc.ServicerContext, exc: BaseException, rpc: str = "", refusal_level: int = logging.DEBUG):
    """Ends the RPC with the exception's status (see :func:`refusal`)."""
    if not context.is_active():  # the client went away: nobody to tell, and no response to serialize
        log.debug("RPC ended by the client: %s", exc)
        context.abort(grpc.StatusCode.CANCELLED, "the client went away")
    code, message, trailing = refusal(exc, rpc, refusal_level)
    context.set_trailing_metadata(trailing)
    context.abort(code, message)


async def abort_call(context, exc: BaseException, rpc: str = "", refusal_level: int = logging.DEBUG):
    """:func:`_abort` for a call served on an event loop (``grpc.aio`` context); returns at once
    when the call ended already (the client went away: nobody to tell)."""
    if context.done():
        log.debug("RPC ended by the client: %s", exc)
        return
    code, message, trailing = refusal(exc, rpc, refusal_level)
    context.set_trailing_metadata(trailing)
    await context.abort(code, message)


def grpc_errors(method):
    """Decorates a servicer method (unary or streaming) so domain errors become statuses."""
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream_wrapper(self, request, context):
            try:
                yield from method(self, _checked(request, method.__name__), context)
            except Exception as exc:  # noqa: BLE001 - mapped to a status, never swallowed
                if isinstance(exc, grpc.RpcError) and context.code() is not None:
                    raise
                _abort(context, exc, _rpc_name(self, method), getattr(self, "refusal_log_level", logging.DEBUG))

        return stream_wrapper

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, _checked(request, method.__name__), context)
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, grpc.RpcError) and context.code() is not None:
                raise
            _abort(context, exc, _rpc_name(self, method), getattr(self, "refusal_log_level", logging.DEBUG))

    return wrapper


def _rpc_name(servicer, method) -> str:
    """``Service/Method`` for log lines (the servicer class without its ``Servicer`` suffix)."""
    return f"{type(servicer).__name__.removesuffix('Servicer')}/{method.__name__}"
