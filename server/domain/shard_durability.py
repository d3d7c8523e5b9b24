"""Durability bookkeeping of one session on one shard: the step log around each update,
checkpoints, recovery, status.

:class:`ShardDurability` wraps the session's optional store (:class:`SessionStore`; None: the
session is not durable, and every call here is then a no-op or answers "nothing"). The shard
session calls it with its condition held, in step order, as the store requires; see
:mod:`optserve.server.domain.durability` for what is logged and when a checkpoint is due.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Optional

import numpy as np

from optserve.server.compute.buffers import aligned_empty
from optserve.server.compute.updater import Updater
from optserve.server.domain.clock import Ticket
from optserve.server.domain.config import TensorSpec
from optserve.server.domain.durability import DurabilityStatus, SessionStore, ShardProgress, StepRecord
from optserve.server.domain.errors import Unavailable


class LogWriteFailed(Unavailable):
    """Write-ahead order: a step's record could not be written, so the step was not applied."""


class ShardDurability:
    """A session's store on one shard, if it is durable.

    Args:
      store: where steps are logged and checkpoints written (None: not durable yet; see
        :meth:`attach`).

    Attributes:
      store: as given, or as attached since (read afresh by every call).
    """

    def __init__(self, store: Optional[SessionStore] = None):
        self.store = store

    @property
    def enabled(self) -> bool:
        """The session is durable on this shard."""
        return self.store is not None

    def attach(self, store: SessionStore) -> None:
        """Makes the session durable: later steps are logged to ``store``."""
        self.store = store

    def close(self) -> None:
        """Finishes a checkpoint being written and closes the log (the session is closing)."""
        if self.store is not None:
            self.store.close()

    # ----------------------------------------------------------------- around one update
    def reserve(self, what: str, payload_bytes: int, tensors: int, steps: int = 1) -> None:
        """Before a push is staged or its step applied: makes sure the log has room on the disk for
        ``steps`` step records (``payload_bytes`` of gradient in ``tensors`` tensors each).

        Raises:
          Unavailable: no room (or a failing disk): nothing is applied; the store reports itself
            degraded until a later reservation succeeds (the client's retry tries again).
        """
        if self.store is None:
            return
        try:
            self.store.reserve_step(payload_bytes, tensors, steps)
        except OSError as exc:
            raise Unavailable(f"{what}: {exc}; nothing was applied, retry once the disk takes writes "
                              f"again") from None

    @property
    def syncs_each_record(self) -> bool:
        """Every step record is flushed before its step is acknowledged (``--fsync step``)."""
        return self.store is not None and self.store.syncs_each_record

    @property
    def write_ahead(self) -> bool:
        """Steps are logged before they are applied (see ``DurabilityConfig.write_ahead``)."""
        return self.store is not None and self.store.write_ahead

    def log_ahead(self, grads: Mapping[str, np.ndarray], order: Iterable[str], record: StepRecord,
                  what: str) -> None:
        """Write-ahead order: writes the step's whole record (``grads`` in ``order``, the shard's
        tensor order) and returns once it is written, before the step is applied.

        Raises:
          LogWriteFailed: it could not be (naming ``what``, the folder and the cause): the step
            must not be applied.
        """
        try:
            self.store.append_ahead([grads[name] for name in order], record)
        except OSError as exc:
            raise LogWriteFailed(f"{what}: {exc}; retry this push: it is applied once the disk takes "
                                 f"writes again") from None

    def begin_step(self, grads: Mapping[str, np.ndarray], order: Iterable[str]) -> None:
        """The update is about to run with ``grads``: they go to the log meanwhile (in ``order``,
        the shard's tensor order)."""
        if self.store is not None:
            self.store.begin_step([grads[name] for name in order])

    def abort_step(self) -> None:
        """The update begun last failed: its log record is marked skipped."""
        if self.store is not None:
            self.store.abort_step()

    def end_step(self, record: StepRecord, release: Optional[Callable[[], None]]) -> None:
        """The update ran: completes its log record, then ``release()`` (at once when not durable)."""
        if self.store is not None:
            self.store.end_step(record, release)
        elif release is not None:
            release()

    def waiter(self, version: int, recover: Callable[[], bool], what: str) -> Callable[[], None]:
        """What waits for step ``version`` to be logged (nothing when not durable).

        When the log failed, it calls ``recover()`` (the session's :meth:`recover`: True once a
        checkpoint holds every applied step) and waits again.

        Raises (when called):
          Unavailable: the log failed and cannot recover yet (naming ``what``, the folder and the
            cause): the step is applied on this shard but not acknowledged; a retry of the same
            push is not applied again, and is answered once the log recovers.
        """
        store = self.store
        if store is None:
            return lambda: None

        def wait() -> None:
            try:
                store.wait_logged(version)
                return
            except OSError as exc:
                failure = exc
            if recover():
                store.wait_logged(version)
                return
            raise Unavailable(f"{what}: {failure}; retry this push (it is not applied twice): it is "
                              f"answered once the disk takes writes again") from None

        return wait

    @property
    def degraded(self) -> str:
        """Why the log cannot take a step now (``"disk: <cause> (<folder>)"``; "": it can)."""
        return self.store.degraded if self.store is not None else ""

    @property
    def log_failed(self) -> bool:
        """A write of the step log failed and no checkpoint has recovered it yet."""
        return self.store is not None and self.store.log_failed

    def recover(self, version: int, checkpoint: Callable[[], Any]) -> bool:
        """After a failed log write: ``checkpoint()`` writes the state at ``version`` (everything
        applied) and waits for it; once committed, the log goes on from it. (In write-ahead order
        the failed record is cut off instead, once the disk takes writes.) Call with the
        session's condition held, between steps. Returns whether the log works again (False:
        the disk still fails; the log stays failed and reservations keep refusing)."""
        store = self.store
        if store is None or not store.log_failed:
            return True
        if store.write_ahead:  # the failed record's step was not applied: cut it off (the session re-applies it)
            try:
                store.log_restart()
            except OSError:
                return False
            return True
        if store.durable_version >= version:  # a checkpoint committed since holds every step applied
            store.log_recovered(version)  # (its rotation drained the failed writes: the log is fresh)
            return True
        try:
            store.log_probe()  # cheap: a disk that still fails is not asked for a whole checkpoint
            checkpoint()
        except OSError:
            return False
        if store.durable_version < version:
            return False
        store.log_recovered(version)
        return True

    # ----------------------------------------------------------------- checkpoints
    def has_checkpoint_of(self, version: int) -> bool:
        """The latest committed checkpoint is at ``version`` or later (call only when enabled)."""
        return version <= self.store.durable_version

    def checkpoint(self, progress: ShardProgress, params: dict, opt_state: Any, clock_state_fn=None,
                   wait: bool = False) -> bool:
        """Snapshots the state at ``progress.version`` into the store (call only when enabled,
        between steps); see :meth:`SessionStore.checkpoint`."""
        return self.store.checkpoint(progress, params, opt_state, clock_state_fn, wait=wait)

    def status(self) -> Optional[DurabilityStatus]:
        """The store's checkpoint and log status (None: not durable)."""
        store = self.store
        if store is None:
            return None
        return DurabilityStatus(store.durable_version, store.log_records, store.log_bytes, store.recoveries,
                                store.checkpoint_seconds, store.checkpoints_written, store.checkpoint_writing,
                                store.log_writes_direct, store.degraded)


def step_tickets(record: StepRecord) -> list[Ticket]:
    """The tickets of a logged step, as its clock decided them (their staleness is not logged:
    0); the last one closes the step."""
    last = len(record.tickets) - 1
    return [Ticket(ordinal, client, sequence, 0, record.scale, i == last, record.version, False)
            for i, (ordinal, client, sequence) in enumerate(record.tickets)]


def replay(store, manifest: dict, updater: Updater, specs: Mapping[str, TensorSpec], read_log,
           upto: Optional[int] = None) -> tuple[ShardProgress, list[StepRecord]]:
    """Recovery: loads checkpoint ``manifest`` of ``store`` into ``updater``, then applies the
    steps its log holds past the checkpoint (up to version ``upto``; None: all); returns the
    progress reached and the records applied.

    ``read_log``: ``(segment_path, fresh_buffers) -> reader``, iterating ``(record_json, grads)``
    with each step's gradient read into buffers from ``fresh_buffers()``; the reader tells the
    byte offset of the record it gave last (``last_at``) and of a torn tail (``torn_at``). Each
    step reuses the cross-shard statistic logged with it (no peer is asked). A torn tail is cut
    off its segment; with ``upto``, the log is cut before the first step after it (those steps
    are rolled back, on every shard alike).
    """
    def fresh_buffers() -> dict[str, np.ndarray]:
        return {name: aligned_empty(spec.shape, np.float32) for name, spec in specs.items()}

    restored = store.restore_arrays(manifest, updater.abstract_state())
    updater.restore(restored["params"], restored["opt_state"])
    progress = ShardProgress.from_json(manifest["progress"])
    applied: list[StepRecord] = []
    for segment in store.log_segments(manifest):
        reader = read_log(segment, fresh_buffers)
        for header, grads in reader:
            record = StepRecord.from_json(header)
            if record.version <= progress.version:
                continue
            if upto is not None and record.version > upto:
                store.cut_log(segment, reader.last_at, drop_later=True)
                return progress, applied
            updater.apply(grads, record.scale, lambda _partial, s=record.global_stat: s)
            progress = progress.after(record)
            applied.append(record)
        if reader.torn_at is not None:
            store.cut_log(segment, reader.torn_at, drop_later=False)
    return progress, applied
