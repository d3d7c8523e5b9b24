"""Domain errors: what went wrong, in words that name the session, tensor, shape or option.

These carry no transport detail. The wire layer's one table
(:data:`optserve.server.wire.errors.STATUS_CODES`) maps each class to a gRPC status code.
Errors crossing a Ray call arrive wrapped (``RayTaskError``); :func:`unwrap` recovers them.
"""

from __future__ import annotations

import enum


class RejectReason(enum.Enum):
    """Why a shard refused a push (values are the wire enum ``optserve.v1.RejectReason``)."""

    INVALID = 1
    NONFINITE = 2
    STALE = 3
    ABORTED = 4


class OptservError(Exception):
    """Base class of domain errors (an unexpected one maps to INTERNAL)."""


class NotFound(OptservError):
    """Unknown session, or nothing staged under a push identity."""


class AlreadyExists(OptservError):
    """Duplicate session name."""


class InvalidArgument(OptservError):
    """Bad option, tensor, shape, dtype, chunk or value."""


class NonFinite(InvalidArgument):
    """NaN or Inf in a gradient of a session that does not allow them."""


class _WithCurrentVersion:
    """A refusal that carries the session's version (``current_version``), so a client can
    correct its view; it crosses Ray calls intact."""

    def __init__(self, message: str, current_version: int):
        super().__init__(message)
        self.current_version = current_version

    def __reduce__(self):
        return (type(self), (str(self), self.current_version))


class FutureBase(_WithCurrentVersion, InvalidArgument):
    """A push computed from a version the session has not reached (INVALID_ARGUMENT): a rogue
    base, or a client that saw a version a restore rolled back (one never acknowledged, only
    pulled)."""


class Stale(_WithCurrentVersion, OptservError):
    """A push too old for the session (async reject policy, or sync against another version)."""


class Late(Stale):
    """Elastic sync (late = drop): the push's round already closed; it was counted and dropped.
    Not a failure of the worker: it pulls the current version and goes on."""


class PeerRefused(OptservError):
    """Another shard refused its part of a push (or never staged it): applied nowhere."""


class FailedPrecondition(OptservError):
    """The session is not in a state that allows the call (e.g. not initialized), or it is not
    the session the caller expects (another optimizer or mode)."""


class Replaced(FailedPrecondition):
    """A push for a former session of this name: it was closed and created again (restored from
    a user's checkpoint, say) after the pushing client attached. Applied nowhere."""


class PermissionDenied(OptservError):
    """The caller may not touch this session (another tenant's, or not its creator's to initialize)."""


class Cancelled(OptservError):
    """The caller went away mid-push (its stream broke or ended early): nothing was applied."""


class SessionLost(OptservError):
    """A session's state is gone: a shard holding part of it died and the server cannot restore it,
    or its optimizer failed while running a step already decided (the shard's state can no longer
    follow the session's version). Retrying cannot help; the session must be closed (and created again)."""


class Unavailable(OptservError):
    """A shard of the session is restarting (durable sessions): nothing was applied; retry the same
    push (same sequence) once the session's shard map says where the shard serves again."""


class ResourceExhausted(OptservError):
    """A limit of the server would be exceeded (the message names the limit and its flag):
    session or tensor size, memory budget, tensor count, names, sessions per tenant."""


class Timeout(OptservError):
    """A wait (sync barrier, cross-shard reduction) ran past its deadline."""


def unwrap(exc: BaseException) -> BaseException:
    """Returns the domain error inside a Ray task error (its ``cause`` chain), or ``exc`` itself."""
    seen = 0
    while not isinstance(exc, OptservError) and getattr(exc, "cause", None) is not None and seen < 5:
        exc = exc.cause
        seen += 1
    return exc
