"""Status records that both sides use, each defined once with its conversion to and from the wire.

The server's shards build these records (``compute`` for roots, ``domain`` for durability); the
server's wire edge turns them into ``control.proto`` messages with ``to_proto`` and the client
turns the messages back into the same records with ``from_proto``. Each field's meaning is the
comment on the same field in ``control.proto``.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Optional

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

    def to_proto(self) -> control_pb2.PreconditionerStatus:
        return control_pb2.PreconditionerStatus(**dataclasses.asdict(self))

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

    def to_proto(self) -> control_pb2.RootOffloadStatus:
        return control_pb2.RootOffloadStatus(
            offloaded=self.offloaded, max_age=-1 if self.max_age is None else self.max_age,
            roots_installed=self.roots_installed, waits=self.waits, resubmits=self.resubmits)

    @classmethod
    def from_proto(cls, r: control_pb2.RootOffloadStatus) -> "RootOffloadStatus":
        return cls(offloaded=r.offloaded, max_age=None if r.max_age < 0 else r.max_age,
                   roots_installed=r.roots_installed, waits=r.waits, resubmits=r.resubmits)


@dataclasses.dataclass(frozen=True)
class RootStatus:
    """Shampoo on one shard: where its roots come from, and one entry per statistic (export order)."""

    offload: RootOffloadStatus
    blocks: tuple[PreconditionerBlockStatus, ...]

    def __getattr__(self, name: str):
        """The offload record's fields read through (``status.max_age``, ``status.waits``, ...)."""
        if name in RootOffloadStatus.__dataclass_fields__:
            return getattr(self.offload, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


@dataclasses.dataclass(frozen=True)
class DurabilityStatus:
    """A durable session on one shard (servers run with ``--checkpoint-dir``).

    ``durable_version``: its latest committed checkpoint (-1: none yet); ``log_records`` /
    ``log_bytes``: steps logged since; ``recoveries``: times this part was restored after its
    process died or the server restarted; ``checkpoint_seconds``: the latest checkpoint's write time;
    ``checkpoints_written``: checkpoints committed by the shard's current process;
    ``checkpoint_writing``: one is being written (or waits to be) now; ``log_direct``: the step
    log writes gradients with direct I/O (``--log-io direct``, where the shard's disk allows it);
    ``degraded``: empty while the step log can be written, else why not ("disk: ..."): the shard
    refuses steps with UNAVAILABLE, applying nothing, until a write succeeds again.
    """

    durable_version: int = -1
    log_records: int = 0
    log_bytes: int = 0
    recoveries: int = 0
    checkpoint_seconds: float = 0.0
    checkpoints_written: int = 0
    checkpoint_writing: bool = False
    log_direct: bool = False
    degraded: str = ""

    def to_proto(self) -> control_pb2.DurabilityStatus:
        return control_pb2.DurabilityStatus(**dataclasses.asdict(self))

    @classmethod
    def from_proto(cls, d: control_pb2.DurabilityStatus) -> "DurabilityStatus":
        return cls(d.durable_version, d.log_records, d.log_bytes, d.recoveries, d.checkpoint_seconds,
                   d.checkpoints_written, d.checkpoint_writing, d.log_direct, d.degraded)


@dataclasses.dataclass(frozen=True)
class ElasticStatus:
    """An elastic sync session's membership and rounds (its clock's view).

    Attributes:
      members / stragglers: worker ids, sorted (stragglers: missed the last round they were waited for).
      lease_expiries / disconnects: members that left by a lapsed lease / a dropped connection.
      rounds_short: rounds committed with fewer than ``num_workers`` pushes.
      late_dropped: late gradients dropped (``late="drop"``).
      round_p50_s: median round duration (first push to commit) over the recent rounds.
      straggler_s: the straggler deadline in force (seconds after a round's first push; 0: none yet).
    """

    members: tuple[str, ...] = ()
    stragglers: tuple[str, ...] = ()
    lease_expiries: int = 0
    disconnects: int = 0
    rounds_short: int = 0
    late_dropped: int = 0
    round_p50_s: float = 0.0
    straggler_s: float = 0.0

    def to_proto(self) -> control_pb2.ElasticStatus:
        return control_pb2.ElasticStatus(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    @classmethod
    def from_proto(cls, e: control_pb2.ElasticStatus) -> "ElasticStatus":
        return cls(tuple(e.members), tuple(e.stragglers), e.lease_expiries, e.disconnects, e.rounds_short,
                   e.late_dropped, e.round_p50_s, e.straggler_s)


@dataclasses.dataclass(frozen=True)
class HyperparamChange:
    """Hyperparameters of one parameter group set by ``Session.set_hyperparams``.

    Attributes:
      version: the first version whose step ran with them.
      group: the parameter group ("default", or its index "0", "1", ...).
      values: option -> value (only the options that changed).
    """

    version: int
    group: str
    values: dict


@dataclasses.dataclass(frozen=True, slots=True)
class RoundRecord:
    """One version of a session: the pushes its update applied (``Session.history``), in every mode.

    Push ``i`` of the record is ``clients[i]`` (its worker ``participants[i]``), its
    ``sequences[i]``, computed from version ``base_versions[i] = version - 1 - staleness[i]``,
    weighted ``scales[i]``. Sync sessions (plain and elastic): one record per round, whose update
    ran on the mean ``sum(scales[i] * g_i) / len(participants)`` (``scales[i]``: 1 unless a late
    gradient was folded in under SCALE). Async sessions: one record per applied push (one push),
    whose update ran on its gradient with the step scaled by ``scales[0]`` (``1 / (1 + staleness)``
    under SCALE, else 1).

    Attributes:
      version: the version the step produced.
      participants: worker ids of the pushes (the part of a client id before its first '/'), in ticket order.
      scales: each push's scale as applied (see above).
      late: elastic sync: workers whose late gradients were dropped while the round was open.
      duration_s: sync: first push to commit (0 for async records).
      closed_by: sync: "num_workers", "members", "deadline" or "left" ("replayed": rebuilt from a step
        log without its journal); async: "push".
      clients: each push's client id (records written before these existed: empty).
      sequences: each push's sequence number (``(clients[i], sequences[i])`` names the push).
      staleness: each push's staleness (versions between its base version and the version it was
        decided at; 0 in sync mode unless folded in late).
    """

    version: int
    participants: tuple[str, ...]
    scales: tuple[float, ...]
    late: tuple[str, ...]
    duration_s: float
    closed_by: str
    clients: tuple[str, ...] = ()
    sequences: tuple[int, ...] = ()
    staleness: tuple[int, ...] = ()

    @property
    def base_versions(self) -> tuple[int, ...]:
        """The version each push's gradient was computed from."""
        return tuple(self.version - 1 - s for s in self.staleness)

    def to_json(self) -> dict:
        return {"version": self.version, "participants": list(self.participants), "scales": list(self.scales),
                "late": list(self.late), "duration_s": self.duration_s, "closed_by": self.closed_by,
                "clients": list(self.clients), "sequences": list(self.sequences), "staleness": list(self.staleness)}

    @classmethod
    def from_json(cls, data: dict) -> "RoundRecord":
        return cls(int(data["version"]), tuple(sys.intern(str(p)) for p in data["participants"]),
                   tuple(float(s) for s in data["scales"]), tuple(data["late"]), float(data["duration_s"]),
                   str(data["closed_by"]), tuple(sys.intern(str(c)) for c in data.get("clients", ())),
                   tuple(int(s) for s in data.get("sequences", ())),
                   tuple(int(s) for s in data.get("staleness", ())))

    def to_proto(self) -> control_pb2.RoundRecord:
        return control_pb2.RoundRecord(version=self.version, participants=self.participants, scales=self.scales,
                                       late=self.late, duration_s=self.duration_s, closed_by=self.closed_by,
                                       clients=self.clients, sequences=self.sequences, staleness=self.staleness)

    @classmethod
    def from_proto(cls, r: control_pb2.RoundRecord) -> "RoundRecord":
        return cls(r.version, tuple(r.participants), tuple(r.scales), tuple(r.late), r.duration_s, r.closed_by,
                   tuple(r.clients), tuple(r.sequences), tuple(r.staleness))
