"""Recovering a shard's step log after a failed write, once the disk takes writes again.

:class:`LogRecovery` is the part of :class:`~optserve.server.domain.shard.step_journal.StepJournal`
that brings a failed log back; the journal creates it and delegates to it. How depends on the
log order in force:

- **overlapped**: the step is applied but its record may be lost, so a checkpoint of the state
  now (every step applied) is committed and the log goes on after it.
- **write-ahead**: the step whose record failed was applied nowhere (:class:`UnloggedStep`, kept
  here until it is applied); the failed record is cut off the log and the session applies that
  step, logged, before any later one.

Recovery reports whether the log works again; it never raises for a disk that still fails,
except :meth:`LogRecovery.require_logged`, which refuses to go on while a step waits for its
record. Like the journal, it is called with the session's lock held.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from optserve.server.domain.durability import CheckpointPort, StepLogPort
from optserve.server.domain.errors import Unavailable
from optserve.server.domain.shard.journal_records import JournalOwner, UnloggedStep
from optserve.server.domain.shard.refusals import log_value

_log = logging.getLogger(__name__)


class LogRecovery:
    """Recovers one shard's step log (see the module's docstring).

    Args:
      owner: the shard session.
      log_where: ``session=... shard=...``, for log lines.
      checkpoint: writes a checkpoint of the current state and waits for it (the journal's).
      reserve_room: reserves room for that many step records, raising
        :class:`~optserve.server.domain.errors.Unavailable` when there is none (the journal's).
    """

    def __init__(self, owner: JournalOwner, log_where: str, checkpoint: Callable[[], bool],
                 reserve_room: Callable[[int], None]):
        self._owner = owner
        self._log_where = log_where
        self._checkpoint = checkpoint
        self._reserve_room = reserve_room
        self._store: Optional[CheckpointPort] = None
        self._log: Optional[StepLogPort] = None
        self._unlogged: Optional[UnloggedStep] = None  # write-ahead: the step whose record failed

    def attach(self, store: CheckpointPort) -> None:
        """The session is durable on ``store``: its log is the one recovered from now on."""
        self._store, self._log = store, store.log

    def keep(self, unlogged: UnloggedStep) -> None:
        """Write-ahead order: ``unlogged``'s record failed; it is applied once the log recovers."""
        self._unlogged = unlogged

    @property
    def step_waits(self) -> bool:
        """Write-ahead order: a step waits for its record (its tickets count as applied)."""
        return self._unlogged is not None

    def require_logged(self) -> None:
        """Write-ahead order: a step whose record failed is applied before any later one (its turn
        has come: its tickets were taken), or nothing goes on.

        Raises:
          Unavailable: the disk still fails (naming the session, shard, folder and cause).
        """
        unlogged = self._unlogged
        if unlogged is not None and not self._owner.recover_log():
            raise Unavailable(f"{self._owner.where}: step {unlogged.step.ticket.target_version} waits for its log "
                              f"record ({self._log.degraded}) and was applied nowhere here; retry once the disk "
                              f"takes writes again")

    def recover(self) -> bool:
        """After a failed log write, once the disk takes writes again: overlapped order, writes a
        checkpoint of the state now (every step applied, those whose records were lost included)
        and goes on logging after it; write-ahead order, cuts the failed record off and has the
        session apply the step whose record failed. Returns whether the log works (False: the
        disk still fails, or a sync step is half gathered here: the step that closes it recovers).
        Call through the session's ``recover_log`` (its lock held)."""
        log, owner = self._log, self._owner
        if log is None:
            return True
        if log.write_ahead:
            return self._recover_ahead()
        if not log.failed:
            return True
        if owner.half_gathered or not owner.initialized:
            return False
        recovered = self._recover_by_checkpoint(owner.version)
        if recovered:
            _log.warning("event=session_log_recovered %s version=%d", self._log_where, owner.version)
        return recovered

    def _recover_by_checkpoint(self, version: int) -> bool:
        """Overlapped order: a checkpoint at ``version`` (everything applied) is committed, then
        the log goes on from it. Returns whether the log works again."""
        store, log = self._store, self._log
        if store.durable_version >= version:  # a checkpoint committed since holds every step applied
            log.recovered(version)  # (its rotation drained the failed writes: the log is fresh)
            return True
        try:
            log.probe()  # cheap: a disk that still fails is not asked for a whole checkpoint
            self._checkpoint()
        except OSError:
            return False
        if store.durable_version < version:
            return False
        log.recovered(version)
        return True

    def _recover_ahead(self) -> bool:
        """Write-ahead order: once the disk takes writes, cuts the failed record off the log, then
        has the session log and apply the step whose record failed (the same gradient and
        cross-shard statistic: the step it would have been). Returns whether the log works and no
        step waits for its record."""
        if self._log.failed:
            try:
                self._log.restart()
            except OSError:
                return False
        unlogged, self._unlogged = self._unlogged, None
        if unlogged is None:
            return True
        try:
            self._reserve_room(1)  # the cut gave room back
            self._owner.reapply(unlogged)
        except Unavailable:  # the disk failed again (a failed record waits once more)
            if self._unlogged is None:
                self._unlogged = unlogged
            return False
        if not self._log.syncs_each_record:
            # the failure may have been an fsync's, which also loses records written (not yet
            # synced) before the failed one: a checkpoint holds every step applied
            try:
                self._checkpoint()
            except OSError as exc:
                _log.warning("event=checkpoint_after_log_recovery_failed %s version=%d error=%s", self._log_where,
                             self._owner.version, log_value(str(exc)))
        _log.warning("event=session_log_recovered %s version=%d order=write-ahead", self._log_where,
                     self._owner.version)
        return True
