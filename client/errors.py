"""Errors the client raises: one class per gRPC status the service uses.

Every error carries the server's message (``str(err)``) and its status code name (``err.code``,
e.g. ``"INVALID_ARGUMENT"``). Errors found by the SDK before sending (a wrong tensor name or
shape) are raised as the same classes, with the same kind of message.
"""

from __future__ import annotations

from typing import Optional

import grpc

from optserve.protos import contract


class OptservError(Exception):
    """Base class. ``code``: gRPC status name; ``details``: the server's message."""

    code = "UNKNOWN"

    def __init__(self, details: str, code: Optional[str] = None):
        super().__init__(details)
        self.details = details
        if code is not None:
            self.code = code


class NotFoundError(OptservError):
    code = "NOT_FOUND"


class AlreadyExistsError(OptservError):
    code = "ALREADY_EXISTS"


class InvalidArgumentError(OptservError, ValueError):
    code = "INVALID_ARGUMENT"


class FutureBaseError(InvalidArgumentError):
    """A push refused because its base version is one the session has not reached (a restore
    rolled back a version this client had pulled, never one acknowledged); ``current_version``
    is the session's version then. A push whose base was this object's own view is retried at
    once from that version; one given an explicit ``base_version`` raises this."""

    def __init__(self, details: str, code: Optional[str] = None, current_version: Optional[int] = None):
        super().__init__(details, code)
        self.current_version = current_version


class StaleError(OptservError):
    """A push refused as stale (ABORTED); ``current_version`` is the session's version then."""

    code = "ABORTED"

    def __init__(self, details: str, code: Optional[str] = None, current_version: Optional[int] = None):
        super().__init__(details, code)
        self.current_version = current_version


class LateError(StaleError):
    """Elastic sync: the push's round had already committed; the server dropped the gradient
    (``late="drop"``). ``Session.push_pull`` / ``push`` do not raise it: they pull the current
    version and report the drop in ``Session.last_step``."""


class AbortedError(OptservError):
    """An operation the client gave up on because the session kept changing under it (reading a
    session's state while steps kept landing); nothing changed on the server."""

    code = "ABORTED"


class FailedPreconditionError(OptservError):
    code = "FAILED_PRECONDITION"


class SessionReplacedError(FailedPreconditionError):
    """A push refused because the session was replaced (closed and created again under its name,
    e.g. restored from a checkpoint) after this object attached: applied nowhere. Attach again
    (``Client.session``) and pull; ``RemoteOptimizer`` does so itself."""


class UnavailableError(OptservError):
    code = "UNAVAILABLE"


class PeerRefusedError(UnavailableError):
    """ABORTED on a shard because ANOTHER shard refused its part of the push, or did not stage it
    in time (it was restarting, or its part never reached it): applied nowhere.

    Whenever the refusing shard's own error came back with the attempt, the SDK raises that
    instead. Without it the push is retried as UNAVAILABLE is (an :class:`UnavailableError`: the
    same sequence, applied at most once, with backoff for up to the client's ``timeout``); one
    raised by a single try has the ``code`` the shard answered (ABORTED), and once the retries run
    out the caller gets an :class:`UnavailableError` (UNAVAILABLE) naming the last refusal.
    """

    code = "ABORTED"


class DeadlineExceededError(OptservError, TimeoutError):
    code = "DEADLINE_EXCEEDED"


class InternalError(OptservError):
    code = "INTERNAL"


class UnauthenticatedError(OptservError):
    """The server runs with tenant tokens and the call carried none, or one it does not know."""

    code = "UNAUTHENTICATED"


class PermissionDeniedError(OptservError):
    """The token is valid but the session belongs to another tenant (or, for a session's initial
    values, to another client)."""

    code = "PERMISSION_DENIED"


class SessionLostError(OptservError):
    """DATA_LOSS: a shard holding part of the session died and the server could not restore it
    (the message names the session and the shard). Retrying cannot help: close the session and
    create it again."""

    code = "DATA_LOSS"


class ResourceExhaustedError(OptservError):
    """A server limit would be exceeded (the message names the limit and the server flag that sets
    it): session or tensor size, a shard's memory budget, tensor count, sessions per tenant."""

    code = "RESOURCE_EXHAUSTED"


_BY_CODE = {
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.ABORTED: StaleError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.DATA_LOSS: SessionLostError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
}


def from_rpc_error(error: grpc.RpcError) -> OptservError:
    """The client exception for a failed RPC."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else None) or str(error)
    cls = _BY_CODE.get(code, InternalError)
    if code == grpc.StatusCode.UNIMPLEMENTED:  # e.g. the health or metrics port, or another gRPC server
        details = (f"{details} (UNIMPLEMENTED: the server at this address does not serve optserve's method: is it "
                   f"the address `optserve serve` printed, and is the server of this client's version?)")
    metadata = dict((error.trailing_metadata() or ()) if hasattr(error, "trailing_metadata") else ())
    if cls is StaleError and contract.PEER_REFUSED_KEY in metadata:
        return PeerRefusedError(details, code.name)
    if cls is FailedPreconditionError and contract.REPLACED_KEY in metadata:
        return SessionReplacedError(details, code.name)
    if cls is InvalidArgumentError and contract.CURRENT_VERSION_KEY in metadata:
        return FutureBaseError(details, code.name, current_version=int(metadata[contract.CURRENT_VERSION_KEY]))
    if cls is StaleError:
        version = metadata.get(contract.CURRENT_VERSION_KEY)
        stale = LateError if contract.LATE_KEY in metadata else StaleError
        return stale(details, code.name, current_version=None if version is None else int(version))
    return cls(details, code.name)
