"""optserve's client SDK (NumPy core; imports neither jax nor ray).

``Client(address)`` -> ``client.create_session(...)`` / ``client.session(name)`` -> ``Session``
with ``pull()``, ``push(grads)``, ``push_pull(grads)``, ``push_pull_async(grads)``, ``version``,
``status()`` and ``close()``. Errors are :mod:`optserve.client.errors` classes.
"""

from optserve.client._retry import RetryPolicy
from optserve.client._session import Session, SessionStatus
from optserve.client.core import Client
from optserve.client.errors import (
    AlreadyExistsError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    OptservError,
    PeerRefusedError,
    StaleError,
    UnavailableError,
)

__all__ = [
    "AlreadyExistsError",
    "Client",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "OptservError",
    "PeerRefusedError",
    "RetryPolicy",
    "Session",
    "SessionStatus",
    "StaleError",
    "UnavailableError",
]
