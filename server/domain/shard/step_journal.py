"""The durable step of one session on one shard: its log record, its checkpoints, its recovery.

:class:`StepJournal` is the one owner of everything that makes a shard's steps durable. The
shard session asks it to run each update as a step (:meth:`StepJournal.run`) and no longer knows
which log order is in force:

- **overlapped** (the default): the gradient goes to the log while the update runs and the
  record is completed after it; the answer that acknowledges the step waits for the record
  (:meth:`StepJournal.waiter`). A failed write leaves the step applied but unacknowledged; once
  the disk takes writes, a checkpoint of everything applied recovers the log.
- **write-ahead** (``DurabilityConfig.write_ahead``): the whole record is written before the
  update changes anything. A step whose record fails is applied nowhere: the journal keeps it
  (:class:`UnloggedStep`) and, once the disk takes writes, cuts the failed record off and has the
  session apply it, logged, before any later step.

It also reserves log space before a push is staged (:meth:`StepJournal.reserve`), decides when a
checkpoint is written (:meth:`StepJournal.after_step`, :meth:`StepJournal.checkpoint_now`) and
restores a shard's part from its checkpoint and log (:meth:`StepJournal.replay`). Bringing a
failed log back (:meth:`StepJournal.recover`, :meth:`StepJournal.require_logged`) is delegated to
its :class:`~optserve.server.domain.shard.log_recovery.LogRecovery`. A session that is not durable has a
journal with no store: every step then just runs.

The journal is called with the session's lock held (a re-entrant lock: the journal calls back
into the session, see :class:`JournalOwner`), in step order, as the store requires.
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping, Optional

import numpy as np

from optserve.server.domain.config import TensorSpec
from optserve.server.domain.durability import CheckpointPort, DurabilityStatus, ShardProgress, StepLogPort, StepRecord
from optserve.server.domain.errors import SessionLost, Unavailable
from optserve.server.domain.shard.journal_records import JournaledStep, JournalOwner, UnloggedStep
from optserve.server.domain.shard.log_recovery import LogRecovery
from optserve.server.domain.shard.refusals import log_value
from optserve.server.domain.shard.replay import replay
from optserve.server.domain.shard.replica import ReplicaPort, ship_step
from optserve.server.domain.waits import Steps, Wait, returns

_log = logging.getLogger(__name__)


class LogWriteFailed(Unavailable):
    """Write-ahead order: a step's record could not be written, so the step was not applied."""


class HeldReleases:
    """The ``release`` callbacks of a step's gradients while something may read them. In the
    overlapped order the log reads them until the step's record is written: they are given back
    on the log's thread after it (:meth:`joined`). An update that failed leaves its record marked
    aborted, its gradient maybe still being written: its release waits for the log's next record
    (the log writes in call order) or for the journal's close. Used with the session's lock held."""

    def __init__(self):
        self._held: list[Callable[[], None]] = []

    def hold(self, release: Optional[Callable[[], None]]) -> None:
        if release is not None:
            self._held.append(release)

    def joined(self) -> Optional[Callable[[], None]]:
        """What the log calls after the record being ended: every release held (None: none)."""
        if not self._held:
            return None
        held, self._held = self._held, []
        return lambda: _call_each(held)

    def release_all(self) -> None:
        held, self._held = self._held, []
        _call_each(held)


def _call_each(releases: list) -> None:
    for release in releases:
        release()


class StepJournal:
    """The durable step of one session on one shard (see the module's docstring).

    Args:
      owner: the shard session.
      specs: the shard's tensors, in the order their gradients are logged.
      push_bytes: the gradient bytes of one push to this shard (one step record's payload).
      session / shard_index: the session's name and this shard's index (for log lines).
    """

    def __init__(self, owner: JournalOwner, specs: Mapping[str, TensorSpec], push_bytes: int, session: str,
                 shard_index: int):
        self._owner = owner
        self._log_where = f"session={log_value(session)} shard={shard_index}"
        self._specs = specs
        self._push_bytes = push_bytes
        self._store: Optional[CheckpointPort] = None
        self._log: Optional[StepLogPort] = None
        self._recovery = LogRecovery(owner, self._log_where, lambda: self.checkpoint(wait=True), self._reserve_room)
        self._held = HeldReleases()  # overlapped order: failed updates' gradients the log may still write
        self._replica: Optional[ReplicaPort] = None  # a standby that mirrors the steps (see replica.py)
        self.replicated = False  # it has (or, on a promoted standby, had) a standby
        self._ship_failed: Optional[Unavailable] = None  # the port raised: no later step is acknowledged

    @property
    def enabled(self) -> bool:
        """The session is durable on this shard."""
        return self._store is not None

    def attach(self, store: CheckpointPort) -> None:
        """Makes the session durable: its steps are logged to ``store.log`` from now on."""
        self._store, self._log = store, store.log
        self._recovery.attach(store)

    @property
    def step_waits(self) -> bool:
        """A write-ahead step whose record failed waits to be applied: its tickets count as
        applied, so the state is not at a step boundary."""
        return self._recovery.step_waits

    def attach_replica(self, replica: Optional[ReplicaPort]) -> None:
        """Ships every step applied from now on to ``replica`` (None: to no standby); a step is
        acknowledged once the standby holds it."""
        self._replica = replica
        self._ship_failed = None
        self.replicated = self.replicated or replica is not None

    @property
    def replica(self) -> Optional[ReplicaPort]:
        """Where applied steps are shipped (None: nowhere)."""
        return self._replica

    def close(self) -> None:
        """Finishes a checkpoint being written, closes the log, gives back held gradients (closing)."""
        if self._store is not None:
            self._store.close()
        self._held.release_all()

    # ----------------------------------------------------------------- one step
    def run(self, grads: Mapping[str, np.ndarray], step: JournaledStep,
            update: Callable[[Optional[Callable[[float], None]]], float],
            release: Optional[Callable[[], None]] = None) -> None:
        """Runs ``update(before)`` as one logged step, then ``release()`` (the gradient buffers may
        be reused from then on), whether the update succeeded or failed.

        ``update`` applies the step and returns its cross-shard statistic; in write-ahead order it
        calls ``before(statistic)`` once the statistic is known and before anything changes, and
        the record is written then. Without a store the step just runs. In the overlapped order
        ``release()`` waits until the log wrote the gradient (see :class:`HeldReleases`).

        Raises:
          LogWriteFailed: write-ahead order, the record could not be written: the step was applied
            nowhere; the journal keeps it and applies it once the disk takes writes (see
            :meth:`require_logged`).
          whatever ``update`` raises (its record, begun in the overlapped order, is marked skipped).
        """
        if self._log is not None and self._log.write_ahead:
            self._run_ahead(grads, step, update, release)
            return
        self._held.hold(release)
        if self._log is not None:  # the gradient goes to the log while the update runs
            self._log.begin_step(self._in_order(grads))
        try:
            global_stat = update(None)
        except BaseException:
            if self._log is not None:  # the log may still be writing the gradient (the aborted record)
                self._log.abort_step()
            else:
                self._held.release_all()
            raise
        record = step.record(global_stat)
        self._ship(record, grads)  # before the gradient's buffers go back
        if self._log is not None:
            self._log.end_step(record, self._held.joined())
        else:
            self._held.release_all()

    def _run_ahead(self, grads: Mapping[str, np.ndarray], step: JournaledStep,
                   update: Callable[[Optional[Callable[[float], None]]], float],
                   release: Optional[Callable[[], None]]) -> None:
        """:meth:`run` in write-ahead order."""
        stats: list[float] = []

        def write_record(global_stat: float) -> None:
            stats.append(global_stat)
            try:
                self._log.append_ahead(self._in_order(grads), step.record(global_stat))
            except OSError as exc:
                raise LogWriteFailed(f"{self._owner.where}: {exc}; retry this push: it is applied once the disk "
                                     f"takes writes again") from None

        try:
            update(write_record)
            self._ship(step.record(stats[0]), grads)  # never raises
        except LogWriteFailed:
            # a copy of its own: the push's buffers (the staging pool, or the client's shared-memory
            # region, which the client writes its next gradient into) go back once it is answered
            owned = {name: np.array(grad, copy=True) for name, grad in grads.items()}
            self._recovery.keep(UnloggedStep(owned, step, stats[0]))
            raise
        finally:  # the record, if any, was written before append_ahead returned: nothing reads them
            if release is not None:
                release()

    def _ship(self, record: StepRecord, grads: Mapping[str, np.ndarray]) -> None:
        """An applied step to the standby, if any. Never raises: the step is applied here, whatever
        becomes of its copy (a port that fails says so through its held futures)."""
        if self._replica is None:
            return
        try:
            ship_step(self._replica, record, self._in_order(grads), self._owner)
        except Exception as exc:  # noqa: BLE001 - a faulty port: its standby no longer holds what is applied here
            _log.exception("event=replica_ship_failed %s version=%d", self._log_where, record.version)
            self._ship_failed = Unavailable(f"{self._owner.where}: step {record.version} could not be shipped to "
                                            f"the standby ({exc!r}); it is not acknowledged")

    def _in_order(self, grads: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        return [grads[name] for name in self._specs]

    def after_step(self, checkpoint_due: bool) -> None:
        """A step was applied (a step boundary): recovers a failed log (its waiters find it
        recovered, or not), else writes the checkpoint its ticket made due."""
        if self._log is None:
            return
        if self._log.failed:
            self._owner.recover_log()
        elif checkpoint_due:
            try:
                self.checkpoint()
            except OSError as exc:  # the step is applied and logged: a checkpoint is only due again later
                _log.warning("event=checkpoint_skipped %s error=%s (the log keeps every step; the next checkpoint "
                             "due tries again)", self._log_where, log_value(str(exc)))

    def waiter(self, version: int) -> Callable[[], Steps[None]]:
        """What acknowledging step ``version`` waits for: its log record (nothing when not durable),
        then, with a standby (:meth:`attach_replica`), the standby holding it; as a function
        returning a generator of waits (:mod:`~optserve.server.domain.waits`).

        When the log failed, the waiter has the session recover it (True once a checkpoint
        holds every applied step) and waits again.

        Raises (from the generator):
          Unavailable: the log failed and cannot recover yet (naming the session, shard, folder
            and cause): the step is applied on this shard but not acknowledged; a retry of the
            same push is not applied again, and is answered once the log recovers. Also the
            standby's error when it will never hold the step (it fell out of sync or is gone).
        """
        log, owner, replica = self._log, self._owner, self._replica
        if replica is not None and self._ship_failed is not None:
            failed = self._ship_failed

            def never_held() -> Steps[None]:
                raise failed
                yield  # noqa: unreachable - a generator

            return never_held
        if replica is not None:
            held = replica.held_future(version)
            logged_steps = self._logged_waiter(log, owner, version) if log is not None else _nothing_to_wait_for

            def logged_and_held() -> Steps[None]:
                yield from logged_steps()
                yield Wait(held, None)
                held.result()  # raises when the standby will never hold it

            return logged_and_held
        if log is None:
            return _nothing_to_wait_for
        return self._logged_waiter(log, owner, version)

    @staticmethod
    def _logged_waiter(log, owner, version: int) -> Callable[[], Steps[None]]:
        """:meth:`waiter`'s wait for the log record of step ``version``."""
        def steps() -> Steps[None]:
            logged = log.logged_future(version)
            yield Wait(logged, None)
            failure = logged.exception()
            if failure is None:
                return
            if owner.recover_log():
                logged = log.logged_future(version)
                yield Wait(logged, None)
                logged.result()  # raises the log's OSError if it failed again
                return
            raise Unavailable(f"{owner.where}: {failure}; retry this push (it is not applied twice): it is "
                              f"answered once the disk takes writes again") from None

        return steps

    # ----------------------------------------------------------------- room and failures
    def reserve(self, steps: int) -> None:
        """Room on the disk for ``steps`` step records of this shard, before a push is staged or
        its step applied. After a failed log write nothing is applied until the log recovered.

        Raises:
          Unavailable: no room, or a failed log that cannot recover yet (naming the session,
            shard and directory): nothing is applied; the client's retry tries again.
        """
        if self._log is None:
            return
        self._reserve_room(steps)
        if not self._log.failed:
            return
        if self._owner.recover_log():  # the checkpoint started a fresh log segment: reserve there
            self._reserve_room(steps)
        elif not self._owner.half_gathered:
            raise Unavailable(f"{self._owner.where}: the step log failed ({self._log.degraded}) and cannot recover "
                              f"yet; nothing was applied, retry once the disk takes writes again")
        # else: the disk takes writes (the reservation probed it) but a sync step is half gathered
        # here: its pushes go on, and the update that closes it recovers the log (see after_step)

    def _reserve_room(self, steps: int) -> None:
        try:
            self._log.reserve(self._push_bytes, len(self._specs), steps)
        except OSError as exc:
            raise Unavailable(f"{self._owner.where}: {exc}; nothing was applied, retry once the disk takes writes "
                              f"again") from None

    def require_logged(self) -> None:
        """See :meth:`LogRecovery.require_logged`."""
        self._recovery.require_logged()

    def recover(self) -> bool:
        """See :meth:`LogRecovery.recover` (call through the session's ``recover_log``)."""
        return self._recovery.recover()

    # ----------------------------------------------------------------- checkpoints
    def checkpoint(self, wait: bool = False) -> bool:
        """Snapshots the state at the current version into the store (between steps); the home
        shard adds its clock's state."""
        progress, params, opt_state, clock_state_fn, copied = self._owner.checkpoint_state()
        return self._store.checkpoint(progress, params, opt_state, clock_state_fn, wait=wait, copied=copied)

    def checkpoint_now(self) -> bool:
        """A checkpoint of the current state, written before this returns (server shutdown);
        False when there is nothing new since the last one, nothing to save, or the state is not
        at a step boundary (a sync step half gathered, a step waiting for its record)."""
        owner = self._owner
        if self._store is None or not owner.initialized or owner.version <= self._store.durable_version:
            return False
        if owner.half_gathered:  # mid sync step: its log position is not a step boundary
            return False
        if self._recovery.step_waits:  # its tickets count as applied: the state is one step behind
            return False
        return self.checkpoint(wait=True)

    # ----------------------------------------------------------------- restore
    def replay(self, store: CheckpointPort, updater, read_log,
               upto: Optional[int]) -> Optional[tuple[dict, ShardProgress, list[StepRecord]]]:
        """Loads ``store``'s latest checkpoint into ``updater`` and replays its log (up to version
        ``upto``; None: all of it); returns ``(manifest, progress, records replayed)``, or None
        when the store has no checkpoint. A latest checkpoint past ``upto`` is rolled back: the
        restore starts from the one kept before it, and the later one is deleted. See
        :func:`~optserve.server.domain.shard.replay.replay`."""
        manifest = store.latest()
        if manifest is not None and upto is not None and int(manifest["progress"]["version"]) > upto:
            manifest = store.roll_back_to(upto)  # the one kept before it (the session's restore found it reaches upto)
            if manifest is None:
                raise SessionLost(f"{self._owner.where}: no checkpoint at or before version {upto} is kept to "
                                  f"restore from")
        if manifest is None:
            return None
        progress, records = replay(store, manifest, updater, self._specs, read_log, upto)
        return manifest, progress, records

    def resume(self, store: CheckpointPort, manifest: Optional[dict], version: int) -> None:
        """After a restore reached ``version``: the log goes on after everything on disk, and the
        session is durable on ``store`` from now on."""
        store.start_logs(manifest, version)
        store.recoveries += 1
        self.attach(store)

    def status(self) -> Optional[DurabilityStatus]:
        """The store's checkpoint and log status (None: not durable)."""
        store, log = self._store, self._log
        if store is None:
            return None
        return DurabilityStatus(store.durable_version, log.records, log.bytes, store.recoveries,
                                store.checkpoint_seconds, store.checkpoints_written, store.checkpoint_writing,
                                log.writes_direct, log.degraded)


def _nothing_to_wait_for() -> Steps[None]:
    """A session without a step log: its steps are acknowledged at once."""
    return (yield from returns(None))
