"""Retries with exponential backoff on UNAVAILABLE (the one retry policy of the client).

Only UNAVAILABLE is retried (:class:`~optserve.client.errors.UnavailableError`): the server did
not get (or could not answer) the call; a push a peer shard did not stage
(:class:`~optserve.client.errors.PeerRefusedError`, ABORTED, applied nowhere) is one too. Pushes
are retried with the same (client_id, sequence), which the server applies at most once.
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Callable, Optional, TypeVar

import grpc

from optserve.client.errors import OptservError, UnavailableError, from_rpc_error

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` tries in all; sleeps ``initial_backoff_s * 2**i`` (capped, +-20% jitter)."""

    attempts: int = 5
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 1.0  # a restarted server or shard is tried again within a second

    def __post_init__(self):
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts}")


def call(fn: Callable[[], T], policy: RetryPolicy, before_retry: Optional[Callable[[], None]] = None) -> T:
    """Calls ``fn``; converts gRPC errors to client errors; retries UNAVAILABLE per ``policy``.

    ``before_retry()`` runs before each retry; an error it raises ends the retries (the session
    was found lost, say: waiting cannot help).
    """
    for attempt in range(policy.attempts):
        try:
            return fn()
        except grpc.RpcError as rpc_error:
            error: OptservError = from_rpc_error(rpc_error)
        except UnavailableError as unavailable:
            error = unavailable
        if not isinstance(error, UnavailableError) or attempt + 1 == policy.attempts:
            raise error
        if before_retry is not None:
            before_retry()
        backoff = min(policy.max_backoff_s, policy.initial_backoff_s * 2**attempt)
        time.sleep(backoff * random.uniform(0.8, 1.2))
    raise AssertionError("unreachable")
