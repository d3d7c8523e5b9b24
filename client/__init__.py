"""optserve's client SDK (NumPy core; imports neither jax nor ray).

``Client(address)`` -> ``client.create_session(...)`` / ``client.session(name)`` -> ``Session``
with ``pull()``, ``push(grads)``, ``push_pull(grads)``, ``push_pull_async(grads)``, ``version``,
``status()`` (a :class:`SessionStatus`) and ``close()``. A session's options are one typed
record, :class:`SessionOptions` (``client.create_session_with(name, params, options)``).
Errors are :mod:`optserve.client.errors` classes.
"""

from optserve.client._retry import RetryPolicy
from optserve.client._session import Session
from optserve.client.core import Client
from optserve.client.errors import (
    AbortedError,
    AlreadyExistsError,
    DeadlineExceededError,
    FailedPreconditionError,
    FutureBaseError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    OptservError,
    PeerRefusedError,
    PermissionDeniedError,
    ResourceExhaustedError,
    SessionLostError,
    SessionReplacedError,
    StaleError,
    UnauthenticatedError,
    UnavailableError,
)
from optserve.client.options import PreconditionerOptions, SessionOptions
from optserve.client.status import PreconditionerBlockStatus, RootOffloadStatus, SessionStatus, ShardStatus

__all__ = [
    "AbortedError",
    "AlreadyExistsError",
    "Client",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "FutureBaseError",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "OptservError",
    "PeerRefusedError",
    "PermissionDeniedError",
    "PreconditionerBlockStatus",
    "PreconditionerOptions",
    "ResourceExhaustedError",
    "RetryPolicy",
    "RootOffloadStatus",
    "Session",
    "SessionLostError",
    "SessionReplacedError",
    "SessionOptions",
    "SessionStatus",
    "ShardStatus",
    "StaleError",
    "UnauthenticatedError",
    "UnavailableError",
]
