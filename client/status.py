"""A session's live status as typed records, decoded from ``GetStatusResponse`` in one place.

``Session.status()`` returns a :class:`SessionStatus`; its ``shards`` are :class:`ShardStatus`
records, and Shampoo and SOAP sessions add :class:`PreconditionerBlockStatus` and
:class:`RootOffloadStatus` per shard (see ``GetStatusResponse`` in control.proto for what each
count means).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from optserve.protos import contract
from optserve.protos.optserve.v1 import control_pb2
from optserve.protos.status_records import (DurabilityStatus, ElasticStatus, HyperparamChange,
                                           PreconditionerBlockStatus, RootOffloadStatus, RoundRecord)

# The per-shard records are the server's own, defined once in optserve.protos.status_records.
__all__ = ["AcceptedPush", "DevicePlacement", "DurabilityStatus", "ElasticStatus", "HyperparamChange",
           "PreconditionerBlockStatus", "RefusedPush", "RootOffloadStatus", "RoundRecord", "ServerShardStatus",
           "SessionSeries", "SessionStatus", "ShardStatus", "StepOutcome"]


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """What became of a session object's latest push (``Session.last_step``).

    ``version``: the version its gradient went into (None when dropped), as the shards answered
    it: for a retry of a push applied before (its first answer lost to a fault), that earlier
    version; ``push_pull`` returns the parameters of ``current_version`` (async: they may include
    later pushes); ``dropped``: None, or
    ``"late"`` (an elastic session's round had committed without it: ``late="drop"``);
    ``current_version``: the session's version when the push was answered."""

    version: Optional[int]
    dropped: Optional[str]
    current_version: int


@dataclasses.dataclass(frozen=True)
class ShardStatus:
    """One shard's view of a session: where it is, what it holds, how far it got.

    ``preconditioners`` is empty and ``root_offload`` ``None`` for optimizers without a root-offload seam (all but Shampoo: roots, and SOAP: eigenbases).
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
    hyperparams: dict = dataclasses.field(default_factory=dict, hash=False)  # group -> {option: value}

    @classmethod
    def from_proto(cls, s: control_pb2.ShardStatus) -> "ShardStatus":
        return cls(
            index=s.assignment.shard_index, address=s.assignment.address, tensors=tuple(s.assignment.tensor_names),
            param_bytes=s.assignment.param_bytes, version=s.version, initialized=s.initialized, node_id=s.node_id,
            device=s.device, preconditioners=tuple(PreconditionerBlockStatus.from_proto(b) for b in s.preconditioners),
            root_offload=RootOffloadStatus.from_proto(s.root_offload) if s.HasField("root_offload") else None,
            optimizer_state_bytes=s.optimizer_state_bytes,
            durability=DurabilityStatus.from_proto(s.durability) if s.HasField("durability") else None,
            hyperparams=_hyperparams(s.hyperparams),
        )


@dataclasses.dataclass(frozen=True)
class SessionStatus:
    """``version``: steps decided; ``steps_applied``: applied on every shard; ``pushes_accepted``;
    ``rejected``: refused pushes by reason ("invalid", "nonfinite", "stale", "aborted"; reasons
    never seen are absent); ``shards``: one :class:`ShardStatus` per shard; ``staleness_p50`` /
    ``staleness_max``: of the accepted pushes, in versions; ``last_activity_unix_s``: when the
    session last decided a push (0: never); ``rolled_back_from``: when the server's last restart
    brought every shard back to ``version``, below the version a shard had logged, that version
    (0: never; see docs/durability.md for when this can happen); ``workers``: worker
    id -> when it last pushed (unix s), the most recent first (at most 256; a worker is a client
    id's part before "/", see ``Session.worker_id``)."""

    name: str
    version: int
    steps_applied: int
    pushes_accepted: int
    rejected: dict[str, int] = dataclasses.field(hash=False)
    shards: tuple[ShardStatus, ...]
    staleness_p50: int = 0
    staleness_max: int = 0
    last_activity_unix_s: float = 0.0
    rolled_back_from: int = 0
    elastic: Optional[ElasticStatus] = None
    workers: dict[str, float] = dataclasses.field(default_factory=dict, hash=False)

    @property
    def hyperparams(self) -> dict:
        """``{group: {option: value}}``: the hyperparameters the session's next step runs with
        (values set or given as numbers; schedules evaluated at that step), as its first shard
        reports them."""
        return dict(self.shards[0].hyperparams) if self.shards else {}

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
            rolled_back_from=response.rolled_back_from,
            elastic=ElasticStatus.from_proto(response.elastic) if response.HasField("elastic") else None,
            workers={w.worker_id: w.last_push_unix_s for w in response.workers},
        )


@dataclasses.dataclass(frozen=True)
class DevicePlacement:
    """Where an actor's JAX runs: its backend ("gpu", "cpu"), the JAX devices it sees, the GPUs
    Ray assigned it, the share of each GPU's memory its JAX may take (0: no GPU asked), and
    whether the GPUs are only rehearsed (reserved in Ray, JAX on the CPU)."""

    backend: str
    devices: tuple[str, ...]
    gpu_ids: tuple[str, ...]
    memory_fraction: float
    rehearsal: bool

    @classmethod
    def from_proto(cls, d: control_pb2.DevicePlacement) -> "DevicePlacement":
        return cls(d.backend, tuple(d.devices), tuple(d.gpu_ids), d.memory_fraction, d.rehearsal)


@dataclasses.dataclass(frozen=True)
class ShardStandbyStatus:
    """A shard's hot standby (``--replicas 2``): its Ray node, whether it answered, and how many
    of the shard's sessions it holds in sync (every acknowledged step), of the ``replicated``
    ones kept with a standby (a session created with ``replicas=1`` is not)."""

    node_id: str
    healthy: bool
    in_sync: int
    replicated: int = 0

    @classmethod
    def from_proto(cls, s: control_pb2.ShardStandby) -> "ShardStandbyStatus":
        return cls(s.node_id, s.healthy, s.in_sync, s.replicated)


@dataclasses.dataclass(frozen=True)
class ServerShardStatus:
    """One shard actor of a server: where it runs, what it holds, whether it answered
    (``device``: None when it did not), its hot standby (None: it has none)."""

    index: int
    address: str
    node_id: str
    sessions: int
    param_bytes: int
    resident_bytes: int
    healthy: bool
    device: Optional[DevicePlacement] = None
    standby: Optional[ShardStandbyStatus] = None

    @classmethod
    def from_proto(cls, s: control_pb2.ServerShard) -> "ServerShardStatus":
        return cls(s.index, s.address, s.node_id, s.sessions, s.param_bytes, s.resident_bytes, s.healthy,
                   DevicePlacement.from_proto(s.device) if s.HasField("device") else None,
                   ShardStandbyStatus.from_proto(s.standby) if s.HasField("standby") else None)


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
    """A session's pushes, oldest first (``Client.session_series``); ``rounds``: an elastic
    session's :class:`RoundRecord` per committed version (as ``Session.history``)."""

    accepted: tuple[AcceptedPush, ...]
    rejected: tuple[RefusedPush, ...]
    rounds: tuple[RoundRecord, ...] = ()

    @classmethod
    def from_proto(cls, response: control_pb2.GetSeriesResponse) -> "SessionSeries":
        names = contract.REJECT_REASON_NAMES
        return cls(
            accepted=tuple(AcceptedPush(p.version, p.staleness, p.loss if p.HasField("loss") else None,
                                        dict(p.scalars), p.unix_s) for p in response.accepted),
            rejected=tuple(RefusedPush(r.unix_s, names.get(r.reason, "unknown")) for r in response.refused),
            rounds=tuple(RoundRecord.from_proto(r) for r in response.rounds),
        )


def _hyperparams(values) -> dict:
    """``{group: {option: value}}`` of a shard's ``HyperparamValue`` list (schedules at the next step)."""
    out: dict = {}
    for v in values:
        out.setdefault(v.group, {})[v.option] = v.value
    return out


def history_records(reply) -> list:
    """A ``HistoryResponse`` as :class:`RoundRecord` (one per version, every mode) and
    :class:`HyperparamChange` records, by version (a version's change before its record)."""
    records = [RoundRecord.from_proto(r) for r in reply.records]
    changes = [HyperparamChange(c.version, c.group, dict(c.values)) for c in reply.hyperparams]
    return sorted(records + changes, key=lambda r: (r.version, isinstance(r, RoundRecord)))
