"""A session's durability on one shard: its store attached and closed, a checkpoint now, a restore,
and its standby (steps shipped to one; on a standby, the shipped steps applied).

:class:`SessionDurability` is what the shard actor asks of a durable session (through
``ShardSession.durability``); the step's own durability (each step logged, checkpoints when due)
is the session's :class:`~optserve.server.domain.shard.step_journal.StepJournal`.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from optserve.server.compute.root_offload import RootInstall
from optserve.server.domain.durability import CheckpointPort, ShardProgress, StepRecord
from optserve.server.domain.errors import Unavailable
from optserve.server.domain.shard.replay import replayed_tickets
from optserve.server.domain.shard.replica import (NoStandby, ReplicaDiverged, ReplicaGap, ReplicaPort, ReplicaStart,
                                                  StateLeaves)
from optserve.server.domain.shard.step_runner import StepRunner, plain_hyper

_log = logging.getLogger(__name__)


class SessionDurability:
    """The durability calls on one session's part on a shard (``steps``: its step runner)."""

    def __init__(self, steps: StepRunner):
        self._steps = steps
        self._deferred: Optional[ReplicaPort] = None  # a standby waiting for the initial values
        self.refuse_one_copy = False  # --on-one-replica refuse: a standby that cannot start is awaited

    def attach_store(self, store: CheckpointPort) -> None:
        """Makes a new session durable: its steps are logged to ``store.log`` from now on."""
        self._steps.journal.attach(store)

    def close_store(self) -> None:
        """Finishes a checkpoint being written and closes the log (the session is closing)."""
        self._steps.journal.close()

    def set_replicated(self) -> None:
        """The session has standbys: a decided ticket whose push is not staged here keeps its turn
        until its client's retry stages it (as after a durable restart). Set on every shard of the
        session before any of them starts a standby: a shard that instead skipped such a ticket
        would fall behind its peers for good."""
        with self._steps.cond:
            self._steps.journal.replicated = True

    def start_replica(self, replica: ReplicaPort) -> None:
        """Primary: starts ``replica`` from this shard's state now (and the home clock's), then
        ships it every later step and clock entry; nothing goes out before the start.

        A part whose initial values have not arrived yet starts its standby once they did
        (:meth:`initialized`).

        Raises:
          Unavailable: the state is not at a step boundary (a sync step half gathered, whose
            pushes count as applied already; a write-ahead step waiting for its record): asked
            again once the step closed.
        """
        steps = self._steps
        with steps.cond:
            if not steps.updater.initialized:
                self._deferred = replica
                return
            if steps.half_gathered or steps.journal.step_waits:
                raise Unavailable(f"{steps.where}: a standby starts at a step boundary; this shard is inside "
                                  f"step {steps.version + 1}: try again once it closed")
            progress = steps.queue.progress(steps.version, plain_hyper(steps.updater.hyper), steps.updater.chunk_tensors)
            params, opt_state = steps.updater.host_state()
            begin = lambda clock_state: replica.start(ReplicaStart(progress, params, opt_state, clock_state))  # noqa: E731
            if steps.clock.is_home:
                steps.clock.replicate(begin, replica.clock_entry)
            else:
                begin(None)
            steps.preconditioners.keep_installs(True)  # from the start's state on, shipped with each step
            steps.journal.attach_replica(replica)

    @property
    def in_sync(self) -> bool:
        """Primary: a standby holds every step acknowledged from now on (see :attr:`standby_started`)."""
        replica = self._steps.journal.replica
        return replica is not None and not isinstance(replica, NoStandby)

    @property
    def standby_started(self) -> bool:
        """Primary, :attr:`in_sync` and its standby said it holds the start: it could serve in
        this part's place now (until then, a standby being caught up holds nothing)."""
        replica = self._steps.journal.replica
        return self.in_sync and replica.started

    def refuse_until_standby(self, why: str) -> None:
        """``--on-one-replica refuse``: this part has one copy in sync (its standby is gone, or it
        is a promoted standby): nothing is acknowledged until :meth:`start_replica` starts a
        fresh standby (a home clock's new tickets are refused UNAVAILABLE once decided: a retry
        finds its ticket, and the fresh standby's start holds it). A step applied meanwhile is
        acknowledged once that standby holds it; its client's retry is not applied again."""
        steps = self._steps
        port = NoStandby(f"{steps.where}: {why}; it has one copy in sync and --on-one-replica refuse acknowledges "
                         f"nothing until a fresh standby holds it: retry (a push is not applied twice)")
        with steps.cond:
            if steps.clock.is_home:
                steps.clock.replicate(None, port.clock_entry)
            steps.preconditioners.keep_installs(False)  # a fresh standby starts from the state then
            steps.journal.attach_replica(port)
        _log.error("event=standby_awaited %s why=%s", steps.where, why)

    def detach_replica(self, why: str) -> None:
        """The standby is gone or out of sync: steps are acknowledged with this one copy from now
        on (``--replicas 2``'s policy when one replica is left), said in the log. Steps whose
        acknowledgement waited for it were refused UNAVAILABLE; their clients' retries are
        answered without applying them again."""
        steps = self._steps
        with steps.cond:
            if steps.journal.replica is None:
                return
            if steps.clock.is_home:
                steps.clock.replicate(None, None)
            steps.preconditioners.keep_installs(False)
            steps.journal.attach_replica(None)
        _log.error("event=standby_detached %s why=%s", steps.where, why)

    def initialized(self) -> None:
        """The initial values are in (the session's lock held): a standby asked for before starts
        now, from them. One that cannot start (its stream broke) leaves the part with one copy,
        said in the log (``event=standby_not_started``)."""
        replica, self._deferred = self._deferred, None
        if replica is None:
            return
        try:
            self.start_replica(replica)
        except Exception as exc:  # noqa: BLE001 - the initial values stay installed; the part goes on alone
            _log.error("event=standby_not_started %s error=%s", self._steps.where, exc)
            if self.refuse_one_copy:
                self.refuse_until_standby(f"its standby could not start ({exc})")

    def let_go(self, why: str) -> bool:
        """Primary: the standby is gone: this part goes on with one copy (:meth:`detach_replica`),
        or, with :attr:`refuse_one_copy`, awaits a fresh one (:meth:`refuse_until_standby`); a
        standby still waiting for the initial values is forgotten. False: it had none."""
        deferred, self._deferred = self._deferred, None
        if not self.in_sync and deferred is None:
            return False
        if self.refuse_one_copy:
            self.refuse_until_standby(why)
        else:
            self.detach_replica(why)
        return True

    def start_from(self, start: ReplicaStart) -> None:
        """A fresh standby's session: takes its primary's state (see :meth:`start_replica`); it
        is replicated from then on (a ticket decided before a promotion but never shipped waits
        for its client's retry, as after a durable restart).

        Raises:
          ReplicaGap: a start that crossed a network holds tensors or state arrays that are not
            this session's (nothing installed).
        """
        steps = self._steps
        with steps.cond:
            steps.updater.use_chunks(start.progress.state_chunks)
            steps.preconditioners.follow_primary()
            opt_state = start.opt_state
            if isinstance(opt_state, StateLeaves):
                try:
                    opt_state = steps.updater.state_from_leaves(start.params, opt_state.leaves)
                except ValueError as exc:
                    raise ReplicaGap(f"{steps.where}: the standby's start is not this session's state: {exc}") from None
            steps.updater.restore(start.params, opt_state)
            steps.updater.set_hyper(start.progress.hyper)
            steps.queue.restore(start.progress)
            steps.version = start.progress.version
            if start.clock_state is not None:
                steps.clock.restore(start.clock_state, [])
            steps.journal.replicated = True
            steps.cond.notify_all()

    def follow(self, record: StepRecord, grads: Mapping[str, np.ndarray], roots: Sequence[RootInstall] = (),
               digest: Optional[int] = None) -> bool:
        """A standby's session: applies the step its primary applied (``record``, with the
        gradient the primary's update ran with, after installing the offloaded roots the primary
        installed before it), as a restore replays a logged step; returns False for a step
        applied here already. With ``digest`` (the primary's parameters' after the step), checks
        that its own parameters are the same.

        Raises:
          ReplicaGap: ``record`` does not follow this shard's version, or roots were shipped to a
            part that computes its own (its primary's optimizer is not this one).
          ReplicaDiverged: the step is applied, and the parameters differ from the primary's.
        """
        steps = self._steps
        with steps.cond:
            steps.raise_if_abandoned()
            if record.version <= steps.version:
                return False
            if record.version != steps.version + 1:
                raise ReplicaGap(f"{steps.where}: the standby is at version {steps.version} and was shipped "
                                 f"version {record.version}")
            try:
                steps.preconditioners.install_shipped(roots)
            except ValueError as exc:
                raise ReplicaGap(f"{steps.where}: version {record.version}: {exc}") from None
            steps.updater.set_hyper(record.hyper)
            steps.updater.apply(grads, record.scale, lambda _partial: record.global_stat, absent=record.absent)
            steps.queue.restore(steps.queue.progress(steps.version, {}).after(record))
            steps.version = record.version
            steps.cond.notify_all()
            if digest is not None:
                ours = steps.params_digest()
                if ours != digest:
                    _log.error("event=replica_diverged %s version=%d digest=%08x primary_digest=%08x", steps.where,
                               record.version, ours, digest)
                    raise ReplicaDiverged(f"{steps.where}: after version {record.version} the standby's parameters "
                                          f"differ from its primary's (CRC-32C {ours:08x}, the primary's {digest:08x}): "
                                          f"it no longer follows, and is caught up from its primary's state")
            return True

    def lead(self) -> None:
        """A promoted standby's part: it decides its offloaded roots from now on (it installed
        its primary's until now)."""
        steps = self._steps
        with steps.cond:
            steps.preconditioners.lead(steps.updater.opt_state)

    def take_files(self, store: CheckpointPort, arrays: Callable[[], dict], clock_journal=None) -> None:
        """A promoted standby's part of a durable session (it wrote no files while it followed):
        the step log and checkpoints in ``store`` are this part's from now on, at its version
        (``arrays``: fresh buffers for one step's gradients, to read the old log with;
        ``clock_journal``: the home clock's ticket journal from now on).

        What its lost primary logged past this version was never acknowledged (a standby holds
        every acknowledged step; a client's retry applies it afresh): the old log is sealed at
        this version and a checkpoint past it rolled back. Where the old files hold everything
        this part holds (the log reaches its version, every record intact; on the home shard, the
        ticket journal every ticket its clock decided: the disk is written first, one entry at a
        time, so it may end with one ticket more, which a ticket decided again in the new journal
        supersedes), the log goes on from there; otherwise (the primary died after shipping a
        step, before its record or journal line was written or flushed, or a file is damaged) a
        checkpoint of the state now is committed before this returns.

        Raises:
          OSError: the checkpoint could not be committed, or the old primary's checkpoint past
            this version has none kept before it to roll back to (the part must not serve: no
            file holds its state).
        """
        steps, started = self._steps, time.monotonic()
        with steps.cond:
            try:
                manifest = store.latest()
            except OSError:  # CorruptCheckpoint: a damaged manifest; the checkpoint below replaces it
                manifest = None
            if manifest is not None and int(manifest["progress"]["version"]) > steps.version:
                manifest = store.roll_back_to(steps.version)
                if manifest is None:
                    raise OSError(f"{steps.where}: the lost primary's checkpoint is past the promoted standby's "
                                  f"version {steps.version}, with none kept before it to go on from")
            logged = -1
            try:
                if manifest is not None:
                    logged = store.logged_through(manifest, arrays)
                    if clock_journal is not None and store.journaled_through(manifest) < steps.clock.next_ordinal - 1:
                        logged = -1  # a decided ticket no journal line holds: a restore would skip it
            except OSError as exc:  # CorruptCheckpoint: a damaged record
                _log.warning("event=standby_old_log_unreadable %s error=%s", steps.where, exc)
                logged = -1
            steps.journal.resume(store, manifest, steps.version)
            if clock_journal is not None:
                steps.clock.journal_to(clock_journal)
            checkpointed = logged < steps.version
            if checkpointed:
                steps.journal.checkpoint(wait=True)
                if store.durable_version < steps.version:  # a failed write is logged, not raised
                    raise OSError(f"{steps.where}: the promoted standby's checkpoint at version {steps.version} was "
                                  f"not committed")
            _log.warning("event=standby_took_files %s version=%d old_log_reached=%d checkpointed=%s seconds=%.3f",
                         steps.where, steps.version, logged, checkpointed, time.monotonic() - started)

    def checkpoint_now(self) -> bool:
        """A checkpoint of the current state, written before this returns (server shutdown);
        False when there is nothing new since the last one or nothing to save."""
        with self._steps.cond:
            return self._steps.journal.checkpoint_now()

    def restore(self, store, read_log, journal_tickets: Callable[[Optional[dict]], list],
                upto: Optional[int] = None) -> int:
        """Durable sessions, at recovery: loads the latest checkpoint and replays the step log.

        Args:
          store: the session's store on this shard (also where later steps are logged).
          read_log: ``(segment_path, arrays) -> reader`` (see :func:`~.replay.replay`).
          journal_tickets: ``manifest -> [entry]``: the clock journal after the checkpoint (home shard).
          upto: the version every shard of the session is restored to (a whole server's restore:
            later logged steps are rolled back, and the home clock forgets their tickets); None:
            the last step this shard logged (one shard restarted among running ones).

        Returns the version reached.
        """
        steps, clock = self._steps, self._steps.clock
        with steps.cond:
            restored = steps.journal.replay(store, steps.updater, read_log, upto)
            manifest = None
            if restored is not None:
                manifest, progress, records = restored
                steps.version = progress.version
                steps.queue.restore(progress)
                if clock.is_home:
                    settle_at = (progress.version, progress.next_ordinal) if upto is not None else None
                    start = ShardProgress.from_json(manifest["progress"]).hyper or steps.updater.optimizer.hyperparams
                    clock.restore(manifest.get("clock"), journal_tickets(manifest),
                                  replayed=replayed_tickets(records, start), settle_at=settle_at)
            steps.journal.resume(store, manifest, steps.version)
            if restored is not None and clock.is_home and upto is not None:
                clock.journal_settled()
            steps.cond.notify_all()
            return steps.version

