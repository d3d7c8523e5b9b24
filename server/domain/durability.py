"""Durable sessions: when a checkpoint is due, what the step log holds, and what a shard restores.

A durable session survives the death of any of its processes with no acknowledged update lost:

- **Step log.** Before a shard acknowledges a step, it appends what replaying the step needs (a
  :class:`StepRecord`: the tickets the step applied, the scale, the cross-shard statistic, and the
  applied gradient, i.e. the sync mean or the async push) to the session's log on this shard.
- **Ticket journal.** The home shard's clock appends every ticket it hands out before handing it
  out, so a restarted clock gives every retried push the ticket it had (same order on every shard).
- **Checkpoints.** The clock marks a step *checkpoint-due* (:class:`CheckpointPolicy`) on the
  ticket that closes it; every shard of the session snapshots its part right after applying that
  step, so a session's checkpoints are consistent at one version across its shards. Each
  checkpoint is written in the background, committed atomically, and truncates the log.
- **Recovery.** A restarted shard loads its latest checkpoint and replays its log
  (:class:`ShardRestore`): it reaches exactly the version it had acknowledged.

The I/O lives in :mod:`optserve.server.storage`; this module holds the policy and the
records (no files, no grpc, no ray).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Optional, Protocol

from optserve.protos.status_records import DurabilityStatus  # noqa: F401 - the shard's durability record
from optserve.server.domain.errors import InvalidArgument


class FsyncPolicy(enum.Enum):
    """When the step log is flushed to the disk (``fsync``), which bounds what a machine loss loses.

    A process crash never loses a written record (it is in the page cache); a machine that loses
    power loses the records written since the last fsync:

    - STEP: every record (nothing acknowledged is lost; each step waits for the disk);
    - EVERY_N: every ``fsync_every_steps`` records (at most N - 1 acknowledged steps lost);
    - CHECKPOINT: only at checkpoints (the steps since the last checkpoint can be lost).
    """

    STEP = "step"
    EVERY_N = "every-n"
    CHECKPOINT = "checkpoint"


class LogIO(enum.Enum):
    """How the step log writes a step's gradient (the other parts of a record always go through
    the page cache).

    - BUFFERED: through the page cache: a copy per byte on the shard's CPU; the kernel writes it
      back later, and a log truncated by a checkpoint before that never reaches the disk.
    - DIRECT: with direct I/O (``O_DIRECT``) from the gradient's own memory (a page-aligned
      shared-memory slot or pooled buffer), no copy: the disk's DMA moves the bytes while the
      update runs, and the write has reached the device when the step is acknowledged (a process
      or kernel crash cannot lose it). Every logged byte crosses the disk: for disks that write
      a step's gradient faster than the update runs (local NVMe). A filesystem without direct
      I/O, or memory that is not page aligned, falls back to BUFFERED writes for those bytes.
    """

    AUTO = "auto"
    BUFFERED = "buffered"
    DIRECT = "direct"

    @property
    def tries_direct(self) -> bool:
        """AUTO (the default) is DIRECT wherever the log's filesystem takes direct I/O (local
        disks: the cheapest way to log, see ``bench.durability``), BUFFERED elsewhere (tmpfs,
        some network filesystems), decided per segment when it is opened."""
        return self is not LogIO.BUFFERED


@dataclasses.dataclass(frozen=True)
class DurabilityConfig:
    """``optserve serve --checkpoint-dir DIR`` and its companions.

    Attributes:
      checkpoint_dir: where sessions' checkpoints, logs and manifests live (one folder per session).
      every_steps: a checkpoint is due every this many steps (>= 1).
      every_s: ... or when this many seconds passed since the last one (> 0).
      max_log_bytes: ... or when the step log since the last checkpoint would exceed this many
        bytes; None: about the session's parameter + optimizer state bytes (``LOG_BYTES_FACTOR`` x
        its parameter bytes, at least ``MIN_DEFAULT_LOG_BYTES``), so the log never outgrows a
        checkpoint by much and a small, fast session is not checkpointed every few steps.
      fsync: the step log's flush policy (:class:`FsyncPolicy`).
      fsync_every_steps: EVERY_N's N (>= 1).
      log_io: how the step log writes gradients (:class:`LogIO`).
      write_ahead: a step's log record is written before its update runs, so a step whose write
        fails (EIO, ...) is applied nowhere on its shard (False, the default: the record is
        written while the update runs, which hides the write's time; such a step is then applied
        but not acknowledged, and its retry is answered without applying it again). A full disk
        refuses a push before it is applied either way: its room is reserved when it is staged.
      checkpoint_copy_max_bytes: a shard's part of a session (its parameters and optimizer state)
        up to this many bytes is copied for a checkpoint, so its steps go on while the copy is
        written (the copy's memory is kept for the next checkpoint); a larger part is written
        from where it lies while its steps wait (no copy: a shard's memory stays the size of its
        state). 0: never copy.
    """

    checkpoint_dir: str
    every_steps: int = 1000
    every_s: float = 300.0
    max_log_bytes: Optional[int] = None
    fsync: FsyncPolicy = FsyncPolicy.CHECKPOINT
    fsync_every_steps: int = 100
    log_io: LogIO = LogIO.AUTO
    write_ahead: bool = False
    checkpoint_copy_max_bytes: int = 1 << 30

    def __post_init__(self):
        if not self.checkpoint_dir:
            raise InvalidArgument("--checkpoint-dir must name a folder")
        if self.every_steps < 1:
            raise InvalidArgument(f"--checkpoint-every-steps must be >= 1, got {self.every_steps}")
        if not self.every_s > 0:
            raise InvalidArgument(f"--checkpoint-every-s must be > 0, got {self.every_s}")
        if self.max_log_bytes is not None and self.max_log_bytes < 1:
            raise InvalidArgument(f"--max-log-bytes must be >= 1, got {self.max_log_bytes}")
        if self.fsync_every_steps < 1:
            raise InvalidArgument(f"--fsync-every-steps must be >= 1, got {self.fsync_every_steps}")
        if self.checkpoint_copy_max_bytes < 0:
            raise InvalidArgument(f"--checkpoint-copy-max-bytes must be >= 0, got {self.checkpoint_copy_max_bytes}")

    def policy(self, session_param_bytes: int) -> "CheckpointPolicy":
        """The checkpoint policy of a session holding ``session_param_bytes`` parameter bytes."""
        max_log = self.max_log_bytes if self.max_log_bytes is not None else max(
            LOG_BYTES_FACTOR * session_param_bytes, MIN_DEFAULT_LOG_BYTES)
        return CheckpointPolicy(self.every_steps, self.every_s, max(1, max_log), max(1, session_param_bytes))

    def fsync_due(self, records_since_sync: int) -> bool:
        """Whether the log must be flushed after a record (``records_since_sync`` counts it)."""
        if self.fsync is FsyncPolicy.STEP:
            return True
        return self.fsync is FsyncPolicy.EVERY_N and records_since_sync >= self.fsync_every_steps


LOG_BYTES_FACTOR = 2  # the default log bound: about a session's parameters + a parameter-sized state
MIN_DEFAULT_LOG_BYTES = 256 << 20  # ... but never below this (a checkpoint costs more than a small log)


@dataclasses.dataclass(frozen=True)
class CheckpointPolicy:
    """When a session's next checkpoint is due (decided by its clock, for every shard at once).

    Attributes:
      every_steps / every_s / max_log_bytes: as :class:`DurabilityConfig` (resolved).
      step_bytes: bytes one step adds to the session's logs (its gradients: its parameter bytes).
    """

    every_steps: int
    every_s: float
    max_log_bytes: int
    step_bytes: int

    def due(self, steps_since: int, seconds_since: float) -> bool:
        """Whether a step closing now, ``steps_since`` steps and ``seconds_since`` seconds after
        the last checkpoint (this step counted), makes a checkpoint due."""
        if steps_since <= 0:
            return False
        return (steps_since >= self.every_steps or seconds_since >= self.every_s
                or steps_since * self.step_bytes >= self.max_log_bytes)


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One applied step in a shard's log (the gradient travels beside it, in tensor order).

    Attributes:
      version: the session version after the step.
      tickets: ``(ordinal, client_id, sequence)`` of every push the step applied, in order.
      scale: the step's scale (async staleness policy).
      global_stat: the cross-shard statistic the update used (0 when the optimizer has none).
      hyper: the hyperparameters the update ran with, ``{group: {option: value}}`` (empty in
        records of sessions whose optimizer has none, and in records written before they existed).
      absent: the tensors the step had no gradient for (left alone).
    """

    version: int
    tickets: tuple[tuple[int, str, int], ...]
    scale: float
    global_stat: float
    hyper: dict = dataclasses.field(default_factory=dict, compare=False)
    absent: tuple = ()

    def to_json(self) -> dict:
        data = {"version": self.version, "tickets": [list(t) for t in self.tickets], "scale": self.scale,
                "global_stat": self.global_stat}
        if self.hyper:
            data["hyper"] = self.hyper
        if self.absent:
            data["absent"] = list(self.absent)
        return data

    @classmethod
    def from_json(cls, data: dict) -> "StepRecord":
        return cls(int(data["version"]), tuple((int(o), str(c), int(s)) for o, c, s in data["tickets"]),
                   float(data["scale"]), float(data["global_stat"]), _hyper_from_json(data.get("hyper")),
                   tuple(str(n) for n in data.get("absent", ())))


@dataclasses.dataclass(frozen=True)
class ShardProgress:
    """The bookkeeping a shard session restores beside its tensors.

    Attributes:
      version: steps applied.
      next_ordinal: the next ticket ordinal to apply.
      applied_sequence: client id -> last applied push sequence (the idempotency table).
      hyper: the hyperparameters of the next step, ``{group: {option: value}}`` (empty: as the
        optimizer was built).
      state_chunks: how the optimizer state is laid out: 0, one state over the shard's tensors;
        N, a tuple of states over chunks of at most N tensors (see
        :mod:`~optserve.server.compute.chunked_update`). Checkpoints written before chunks
        existed have 0.
    """

    version: int
    next_ordinal: int
    applied_sequence: dict[str, int]
    hyper: dict = dataclasses.field(default_factory=dict)
    state_chunks: int = 0

    def to_json(self) -> dict:
        data = {"version": self.version, "next_ordinal": self.next_ordinal,
                "applied_sequence": dict(self.applied_sequence)}
        if self.hyper:
            data["hyper"] = self.hyper
        if self.state_chunks:
            data["state_chunks"] = self.state_chunks
        return data

    @classmethod
    def from_json(cls, data: dict) -> "ShardProgress":
        return cls(int(data["version"]), int(data["next_ordinal"]),
                   {str(k): int(v) for k, v in data["applied_sequence"].items()}, _hyper_from_json(data.get("hyper")),
                   int(data.get("state_chunks", 0)))

    def after(self, record: StepRecord) -> "ShardProgress":
        """The progress once ``record``'s step is applied."""
        applied = dict(self.applied_sequence)
        for _, client_id, sequence in record.tickets:
            applied[client_id] = sequence
        next_ordinal = record.tickets[-1][0] + 1 if record.tickets else self.next_ordinal
        return ShardProgress(record.version, next_ordinal, applied, record.hyper or self.hyper, self.state_chunks)


def _hyper_from_json(data: Optional[dict]) -> dict:
    """``{group: {option: float}}`` from its JSON (None: empty)."""
    return {str(g): {str(o): float(v) for o, v in values.items()} for g, values in (data or {}).items()}


class StepLogPort(Protocol):
    """A durable session's step log on one shard (and, on its home shard, the clock's ticket
    journal); the storage layer implements it over files. Called under the shard session's lock,
    in step order."""

    write_ahead: bool  # records are written before their steps are applied (DurabilityConfig.write_ahead)
    syncs_each_record: bool  # every record is flushed before its step is acknowledged (fsync policy)
    failed: bool  # a write failed: nothing is logged until recovered (or, write-ahead, restart)
    degraded: str  # why the log cannot take a step now ("disk: <cause> (<folder>)"; "": it can)
    records: int  # step records logged since the latest checkpoint began ...
    bytes: int  # ... and their gradient bytes
    writes_direct: bool  # gradients are written with direct I/O now

    def reserve(self, payload_bytes: int, tensors: int, steps: int = 1) -> None:
        """Before a push is staged or its step applied: reserves room on the disk for ``steps``
        step records (raises OSError if there is none: nothing is then applied)."""

    def begin_step(self, grads: list) -> None:
        """Starts appending the next step's ``grads`` (the shard's tensors' gradients, in tensor
        order; only read) in the background, while the step's update runs."""

    def end_step(self, record: StepRecord, release=None) -> None:
        """Completes the step begun last with ``record`` in the background, in call order (flushed
        per the fsync policy), then calls ``release()``."""

    def abort_step(self) -> None:
        """The step begun last was not applied: its record is marked skipped."""

    def append_ahead(self, grads: list, record: StepRecord) -> None:
        """Write-ahead order: writes the step's whole record and returns once it is written (raises
        OSError if it could not be: the step must not be applied)."""

    def wait_logged(self, version: int) -> None:
        """Returns once the step of ``version`` is logged (acknowledging it waits for this)."""

    def logged_future(self, version: int):
        """A ``concurrent.futures.Future`` done once the step of ``version`` is logged, or failed
        with the OSError :meth:`wait_logged` raises."""

    def probe(self) -> None:
        """Raises OSError while the disk does not take a small write (after a failed log write)."""

    def recovered(self, version: int) -> None:
        """A checkpoint at ``version`` taken after the failure was committed: the log goes on."""

    def restart(self) -> None:
        """Write-ahead order, after a failed write: cuts the failed record off and takes records
        again (raises OSError while the disk still fails)."""

    def segments(self, manifest: Optional[dict]) -> list[str]:
        """The log's segment files after ``manifest``'s checkpoint (all: None), in order."""

    def cut(self, segment: str, at: int, drop_later: bool) -> None:
        """Drops the log from byte ``at`` of ``segment`` on (``drop_later``: every later segment too)."""

    def journal(self, manifest: Optional[dict]) -> list:
        """The clock journal's entries after ``manifest``'s checkpoint (home shard)."""


class CheckpointPort(Protocol):
    """A durable session's checkpoints on one shard; the storage layer implements it over files.

    Attributes:
      log: the session's step log on this shard (:class:`StepLogPort`).
    """

    log: StepLogPort
    durable_version: int  # the latest committed checkpoint's version (-1: none)
    recoveries: int  # times this part was restored
    checkpoint_seconds: float  # wall time of the latest checkpoint write
    checkpoints_written: int  # checkpoints committed by this process
    checkpoint_writing: bool  # one is being written (or waits to be) now

    def latest(self) -> Optional[dict]:
        """The latest committed checkpoint's manifest (None: none)."""

    def restore_arrays(self, manifest: dict, abstract: dict) -> dict:
        """The checkpoint's ``{"params", "opt_state"}`` (checked against its manifest)."""

    def roll_back_to(self, version: int) -> Optional[dict]:
        """The newest kept checkpoint at or before ``version`` (None: none), the later ones deleted."""

    def logged_through(self, manifest: dict, arrays) -> int:
        """The last version the log reaches after ``manifest``'s checkpoint, none missing, each
        record read into ``arrays()``'s buffers and checked (raises CorruptCheckpoint: damaged)."""

    def journaled_through(self, manifest: dict) -> int:
        """The last ticket ordinal the clock's journal holds after ``manifest``'s checkpoint."""

    def start_logs(self, manifest: Optional[dict], version: int = 0) -> None:
        """Opens the step log after everything on disk (it reached ``version``)."""

    def checkpoint(self, progress: ShardProgress, params: dict, opt_state: Any, clock_state_fn=None,
                   wait: bool = False) -> bool:
        """Snapshots the state at ``progress.version`` and writes it in the background (waits with
        ``wait``); later log records go to a fresh segment. A checkpoint due while another one is
        being written is written after it (a newer one supersedes it)."""

    def close(self) -> None:
        """Writes what the log has queued and the checkpoint pending, then closes the files."""
