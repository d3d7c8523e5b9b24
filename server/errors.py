"""Domain exceptions and the one place that maps them to gRPC status codes.

Domain code raises these with a message naming the session, tensor, shape or option; the
servicers never choose status codes themselves: they wrap their methods with
:func:`grpc_errors`, which aborts the RPC with :func:`status_code_for` the exception.
Exceptions crossing a Ray call arrive wrapped (``RayTaskError``); :func:`unwrap` recovers them.
"""

from __future__ import annotations

import functools
import inspect
import logging

import grpc

log = logging.getLogger(__name__)

# Trailing-metadata key carrying the session's version with an ABORTED (stale) status.
CURRENT_VERSION_KEY = "optserve-current-version"
# Trailing-metadata key marking an ABORTED status caused by another shard's refusal.
PEER_REFUSED_KEY = "optserve-peer-refused"


class OptservError(Exception):
    """Base class of domain errors; ``code`` is the gRPC status they map to."""

    code = grpc.StatusCode.INTERNAL


class NotFound(OptservError):
    """Unknown session, or nothing staged under a push identity."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(OptservError):
    """Duplicate session name."""

    code = grpc.StatusCode.ALREADY_EXISTS


class InvalidArgument(OptservError):
    """Bad option, tensor, shape, dtype, chunk or value."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NonFinite(InvalidArgument):
    """NaN or Inf in a gradient of a session that does not allow them."""


class Stale(OptservError):
    """A push too old for the session (async reject policy, or sync against another version).

    Attributes:
      current_version: the session's version when the push was refused.
    """

    code = grpc.StatusCode.ABORTED

    def __init__(self, message: str, current_version: int):
        super().__init__(message)
        self.current_version = current_version

    def __reduce__(self):  # crosses Ray calls intact
        return (Stale, (str(self), self.current_version))


class PeerRefused(OptservError):
    """Another shard refused its part of a push (or never staged it): applied nowhere."""

    code = grpc.StatusCode.ABORTED


class FailedPrecondition(OptservError):
    """The session is not in a state that allows the call (e.g. not initialized)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Timeout(OptservError):
    """A wait (sync barrier, cross-shard reduction) ran past its deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


def unwrap(exc: BaseException) -> BaseException:
    """Returns the domain error inside a Ray task error, or ``exc`` itself."""
    seen = 0
    while not isinstance(exc, OptservError) and getattr(exc, "cause", None) is not None and seen < 5:
        exc = exc.cause
        seen += 1
    return exc


def status_code_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status for an exception: its domain code, else INTERNAL."""
    exc = unwrap(exc)
    return exc.code if isinstance(exc, OptservError) else grpc.StatusCode.INTERNAL


def _abort(context: grpc.ServicerContext, exc: BaseException):
    if not context.is_active():  # the client went away: nobody to tell
        log.debug("RPC ended by the client: %s", exc)
        return
    inner = unwrap(exc)
    code = status_code_for(inner)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("internal error in RPC", exc_info=exc)
        message = f"internal error: {type(inner).__name__}: {inner}"
    else:
        message = str(inner)
    if isinstance(inner, Stale):
        context.set_trailing_metadata(((CURRENT_VERSION_KEY, str(inner.current_version)),))
    elif isinstance(inner, PeerRefused):
        context.set_trailing_metadata(((PEER_REFUSED_KEY, "1"),))
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
                _abort(context, exc)

        return stream_wrapper

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, grpc.RpcError) and context.code() is not None:
                raise
            _abort(context, exc)

    return wrapper
