"""A session's live status as typed records, decoded from ``GetStatusResponse`` in one place.

``Session.status()`` returns a :class:`SessionStatus`; its ``shards`` are :class:`ShardStatus`
records, and Shampoo sessions add :class:`PreconditionerBlockStatus` and
:class:`RootOffloadStatus` per shard (see ``GetStatusResponse`` in control.proto for what each
count means).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from optserve.protos import contract
from optserve.protos.optserve.v1 import control_pb2


@dataclasses.dataclass(frozen=True)
class PreconditionerBlockStatus:
    """Shampoo: the preconditioner of one statistic (one dimension of one block of a tensor).

    ``age``: steps between the statistics its root came from and the latest update (-1: no root
    yet); ``error``: the latest root's residual (inf / NaN when it failed); ``failures``: roots
    refused; ``fallback_steps``: updates that ran without a root (the grafted direction).
    """

    tensor: str
    block: int
    dim: int
    size: int
    age: int
    error: float
    failures: int
    fallback_steps: int

    @classmethod
    def from_proto(cls, b: control_pb2.PreconditionerStatus) -> "PreconditionerBlockStatus":
        return cls(tensor=b.tensor, block=b.block, dim=b.dim, size=b.size, age=b.age, error=b.error,
                   failures=b.failures, fallback_steps=b.fallback_steps)


@dataclasses.dataclass(frozen=True)
class RootOffloadStatus:
    """Shampoo: how one shard gets its inverse roots.

    ``offloaded``: from preconditioner workers (else inside the update); ``max_age``: the
    session's age bound in steps (``None`` unless offloaded); ``roots_installed``, ``waits``
    (updates that waited for roots), ``resubmits`` (worker calls sent again): counts.
    """

    offloaded: bool
    max_age: Optional[int]
    roots_installed: int
    waits: int
    resubmits: int

    @classmethod
    def from_proto(cls, r: control_pb2.RootOffloadStatus) -> "RootOffloadStatus":
        return cls(offloaded=r.offloaded, max_age=None if r.max_age < 0 else r.max_age,
                   roots_installed=r.roots_installed, waits=r.waits, resubmits=r.resubmits)


@dataclasses.dataclass(frozen=True)
class DurabilityStatus:
    """A durable session on one shard (servers run with ``--checkpoint-dir``).

    ``durable_version``: its latest committed checkpoint (-1: none yet); ``log_records`` /
    ``log_bytes``: steps logged since; ``recoveries``: times this part was restored after its
    process died or the server restarted; ``checkpoint_seconds``: the latest checkpoint's write time;
    ``checkpoints_written``: checkpoints committed by the shard's current process;
    ``checkpoint_writing``: one is being written (or waits to be) now; ``log_direct``: the step
    log writes gradients with direct I/O (``--log-io direct``, where the shard's disk allows it).
    """

    durable_version: int
    log_records: int
    log_bytes: int
    recoveries: int
    checkpoint_seconds: float
    checkpoints_written: int = 0
    checkpoint_writing: bool = False
    log_direct: bool = False

    @classmethod
    def from_proto(cls, d: control_pb2.DurabilityStatus) -> "DurabilityStatus":
        return cls(d.durable_version, d.log_records, d.log_bytes, d.recoveries, d.checkpoint_seconds,
                   d.checkpoints_written, d.checkpoint_writing, d.log_direct)


@dataclasses.dataclass(frozen=True)
class ShardStatus:
    """One shard's view of a session: where it is, what it holds, how far it got.

    ``preconditioners`` is empty and ``root_offload`` ``None`` for optimizers other than Shampoo.
    ``data_path`` (``Session.status()`` only): how that session object's tensor bytes reach the
    shard, "shared_memory" (same host, proven) or "grpc".
    """

    index: int
    address: str
    tensors: tuple[str, ...]
    param_bytes: int
    version: int
    initialized: bool
    node_id: str
    device: str
    preconditioners: tuple[PreconditionerBlockStatus, ...] = ()
    root_offload: Optional[RootOffloadStatus] = None
    optimizer_state_bytes: int = 0
    durability: Optional[DurabilityStatus] = None  # durable servers only
    data_path: str = ""

    @classmethod
    def from_proto(cls, s: control_pb2.ShardStatus) -> "ShardStatus":
        return cls(
            index=s.assignment.shard_index, address=s.assignment.address, tensors=tuple(s.assignment.tensor_names),
            param_bytes=s.assignment.param_bytes, version=s.version, initialized=s.initialized, node_id=s.node_id,
            device=s.device, preconditioners=tuple(PreconditionerBlockStatus.from_proto(b) for b in s.preconditioners),
            root_offload=RootOffloadStatus.from_proto(s.root_offload) if s.HasField("root_offload") else None,
            optimizer_state_bytes=s.optimizer_state_bytes,
            durability=DurabilityStatus.from_proto(s.durability) if s.HasField("durability") else None,
        )


@dataclasses.dataclass(frozen=True)
class SessionStatus:
    """``version``: steps decided; ``steps_applied``: applied on every shard; ``pushes_accepted``;
    ``rejected``: refused pushes by reason ("invalid", "nonfinite", "stale", "aborted"; reasons
    never seen are absent); ``shards``: one :class:`ShardStatus` per shard; ``staleness_p50`` /
    ``staleness_max``: of the accepted pushes, in versions; ``last_activity_unix_s``: when the
    session last decided a push (0: never)."""

    name: str
    version: int
    steps_applied: int
    pushes_accepted: int
    rejected: dict[str, int] = dataclasses.field(hash=False)
    shards: tuple[ShardStatus, ...]
    staleness_p50: int = 0
    staleness_max: int = 0
    last_activity_unix_s: float = 0.0

    @classmethod
    def from_proto(cls, response: control_pb2.GetStatusResponse) -> "SessionStatus":
        names = contract.REJECT_REASON_NAMES
        return cls(
            name=response.name,
            version=response.version,
            steps_applied=response.steps_applied,
            pushes_accepted=response.pushes_accepted,
            rejected={names[r.reason]: r.count for r in response.rejected if r.reason in names},
            shards=tuple(ShardStatus.from_proto(s) for s in response.shards),
            staleness_p50=response.staleness_p50,
            staleness_max=response.staleness_max,
            last_activity_unix_s=response.last_activity_unix_s,
        )


@dataclasses.dataclass(frozen=True)
class ServerShardStatus:
    """One shard actor of a server: where it runs, what it holds, whether it answered."""

    index: int
    address: str
    node_id: str
    sessions: int
    param_bytes: int
    resident_bytes: int
    healthy: bool

    @classmethod
    def from_proto(cls, s: control_pb2.ServerShard) -> "ServerShardStatus":
        return cls(s.index, s.address, s.node_id, s.sessions, s.param_bytes, s.resident_bytes, s.healthy)


@dataclasses.dataclass(frozen=True)
class AcceptedPush:
    """One accepted push: the version of its step, its staleness, the telemetry its client attached,
    and when it was applied (seconds since the Unix epoch)."""

    version: int
    staleness: int
    loss: Optional[float]
    scalars: dict[str, float] = dataclasses.field(hash=False)
    unix_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class RefusedPush:
    """One refused push: when, and why ("invalid", "nonfinite", "stale", "aborted")."""

    unix_s: float
    reason: str


@dataclasses.dataclass(frozen=True)
class SessionSeries:
    """A session's pushes, oldest first (``Client.session_series``)."""

    accepted: tuple[AcceptedPush, ...]
    rejected: tuple[RefusedPush, ...]

    @classmethod
    def from_proto(cls, response: control_pb2.GetSeriesResponse) -> "SessionSeries":
        names = contract.REJECT_REASON_NAMES
        return cls(
            accepted=tuple(AcceptedPush(p.version, p.staleness, p.loss if p.HasField("loss") else None,
                                        dict(p.scalars), p.unix_s) for p in response.accepted),
            rejected=tuple(RefusedPush(r.unix_s, names.get(r.reason, "unknown")) for r in response.refused),
        )