"""What one request, session or tenant may ask of the server (:class:`Limits`, the server's
``--max-*`` flags), validated at the edge."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from optserve.server.domain.errors import InvalidArgument, ResourceExhausted


def machine_memory_bytes() -> int:
    """This machine's physical memory in bytes (8 GiB when the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 8 << 30


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request, session or tenant may ask of the server; each bound is checked before
    anything is allocated, and exceeding one is :class:`ResourceExhausted` naming the limit and
    its ``optserve serve`` flag.

    Attributes:
      max_session_bytes: parameter bytes of one session, as stored (default: half of this
        machine's memory, what every shard's default budget adds up to: a session is bounded by
        what its shards can hold, checked next).
      shard_memory_bytes: memory budget of each shard: the estimated bytes of the sessions it
        holds (:mod:`~optserve.server.domain.sessions.memory_estimate`: parameters, the optimizer's own
        state for their shapes, a gradient buffer) (None: half of this machine's memory, split
        evenly over the shards).
      max_tensors: tensors in one session.
      max_tensor_name_bytes: UTF-8 bytes of a tensor's name.
      max_tensor_rank: dimensions of a tensor's shape.
      max_metadata_bytes: request metadata (headers) per call; gRPC refuses larger ones.
      max_json_depth: nesting depth of a session's optimizer arguments (JSON).
      max_json_bytes: size of a session's optimizer arguments (JSON).
      max_sessions_per_tenant: open sessions one tenant (the one tenant "" without tokens) may hold.
      max_staged_bytes: gradient bytes one session may hold staged (received, or still arriving,
        and not yet applied) on a shard (default: 1/8 of this machine's memory); a push past it is
        refused before its buffers are allocated.
      max_open_streams: PushPull calls a shard holds open at once; past it, calls end after their
        step and idle ones end at once (the client reopens:
        :class:`~optserve.server.wire.open_streams.OpenStreams`). An open call waits for its next step
        without a thread, so this bounds memory and descriptors, not threads.
      max_streams_per_tenant: PushPull calls one tenant may hold open on a shard at once (one more
        is RESOURCE_EXHAUSTED).
    """

    max_session_bytes: int = dataclasses.field(default_factory=lambda: machine_memory_bytes() // 2)
    shard_memory_bytes: Optional[int] = None
    max_tensors: int = 100_000
    max_tensor_name_bytes: int = 1024
    max_tensor_rank: int = 32
    max_metadata_bytes: int = 16 << 10
    max_json_depth: int = 32
    max_json_bytes: int = 1 << 20
    max_sessions_per_tenant: int = 1024
    max_staged_bytes: int = dataclasses.field(default_factory=lambda: machine_memory_bytes() // 8)
    max_open_streams: int = 4096
    max_streams_per_tenant: int = 4096

    # the flag of each limit, for messages
    FLAGS = {"max_session_bytes": "--max-session-bytes", "shard_memory_bytes": "--shard-memory-bytes",
             "max_tensors": "--max-tensors", "max_tensor_name_bytes": "--max-tensor-name-bytes",
             "max_tensor_rank": "--max-tensor-rank", "max_metadata_bytes": "--max-metadata-bytes",
             "max_json_depth": "--max-json-depth", "max_json_bytes": "--max-json-bytes",
             "max_sessions_per_tenant": "--max-sessions-per-tenant", "max_staged_bytes": "--max-staged-bytes",
             "max_open_streams": "--max-open-streams", "max_streams_per_tenant": "--max-streams-per-tenant"}

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise InvalidArgument(f"{self.FLAGS[field.name]} must be a positive integer, got {value!r}")

    def shard_budget(self, shards: int) -> int:
        """The memory budget of each of ``shards`` shards in bytes."""
        if self.shard_memory_bytes is not None:
            return self.shard_memory_bytes
        return machine_memory_bytes() // 2 // max(1, shards)

    def exceeded(self, name: str, what: str, limit: Optional[int] = None) -> ResourceExhausted:
        """The error for ``what`` (e.g. "session 'm': 5 tensors") over limit ``name`` (its value:
        ``limit``, else the field's)."""
        limit = getattr(self, name) if limit is None else limit
        return ResourceExhausted(f"{what}: over the limit {name}={limit} (server flag {self.FLAGS[name]})")
