"""One session on one shard: the step path, from a push's chunks to its applied update.

A push arrives as chunks; :meth:`ShardSession.push` assembles and validates them into pooled
buffers, stages them under the push's identity ``(client_id, sequence)`` and, with
``auto_commit``, votes at the session clock with the session's other shards. The clock issues a
*ticket* only when every shard staged its part; tickets are applied strictly in ordinal order
(so every shard applies the same pushes in the same order), and the updater
(:mod:`optserve.server.compute.updater`) runs the step. The client-driven two-phase path
(``stage`` then ``commit`` / ``abort``) reaches the same tickets without the vote.

Idempotency: a shard remembers each client's last applied sequence; a retry of an applied push
is answered from the clock's ticket and applies nothing twice.

Kernel failures: an optimizer whose step cannot run on a shard's tensors (it raises while traced)
is found before the push is staged, so it is refused (INVALID_ARGUMENT) before any vote: applied
on no shard, the clock unmoved. A failure only the run shows comes after the clock decided the
step (and the update donated the state): the session ends with one SessionLost naming it.
An optimizer that cannot build its state for the shard's tensors is refused when the session is
opened (its ``init`` traced abstractly: see ``ShardActor.open_session``); one whose real ``init``
still fails when the initial values arrive is answered INVALID_ARGUMENT, and nothing is installed.

:class:`ShardSession` is the facade the wire layer and the shard actor call. It holds the step
path and hands each job to a collaborator: :mod:`~optserve.server.domain.staging` (staged pushes,
their expiry after ``staged_push_ttl_s``, ``max_staged_bytes``), :mod:`~optserve.server.domain.sequencer`
(ticket order, idempotency, sync means), :mod:`~optserve.server.domain.shard_durability` (step
log, checkpoints, recovery) and :mod:`~optserve.server.domain.refusals`: every push refused or
dropped is logged once on this module's logger (INFO, ``event=push_refused session=... shard=...
client=... sequence=... reason=...``; never values). Locks: ``_cond`` guards the version, the
sequencer and the updater's state; the staging area's lock is taken alone or inside ``_cond``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable, NamedTuple, Optional

import numpy as np

from optserve.server.compute.updater import Updater, error_line, tensors_in_words
from optserve.server.domain.assembly import TensorAssembler
from optserve.server.domain.clock import Ticket
from optserve.server.domain.config import Limits, SessionConfig, TensorSpec, worker_of
from optserve.server.domain.durability import SessionStore, StepRecord
from optserve.server.domain.errors import (FailedPrecondition, InvalidArgument, OptservError, PeerRefused,
                                           PermissionDenied, RejectReason, ResourceExhausted, SessionLost, Stale,
                                           Timeout, Unavailable)
from optserve.server.domain.refusals import Refusals, log_value
from optserve.server.domain.sequencer import Sequencer, entry
from optserve.server.domain.shard_durability import LogWriteFailed, ShardDurability, replay, step_tickets
from optserve.server.domain.shard_records import PushHeader, Receipt, ShardSessionStatus, StepObserver
from optserve.server.domain.shard_registry import ShardRegistry
from optserve.server.domain.staging import StagingArea
from optserve.server.domain.telemetry import SessionSeries

__all__ = ["PushHeader", "Receipt", "ShardRegistry", "ShardSession", "ShardSessionStatus", "StepObserver"]

_log = logging.getLogger(__name__)

_GAP_POLL_S = 0.25
# Elastic rounds may commit without a push (straggler deadline, a member gone): a shard waiting in
# one asks the clock this often (one waiting thread per shard asks; the others wait on its answer).
_ROUND_POLL_S = 0.02
_INIT_WAIT_S = 1.0  # longest in-thread wait for a new session's initial values (then UNAVAILABLE: retry)
_ANSWER_MARGIN_S = 1.0  # a wait bounded by the caller's deadline ends this much earlier, to answer in time
_UNCHECKED = object()  # ShardSession._step_problem before the step was traced once


class _UnloggedStep(NamedTuple):
    """Write-ahead order: a step whose log record could not be written, so applied nowhere here
    yet; its tickets are taken, and it is applied (logged first) before any later step."""

    grads: dict  # the shard's own copy (the push's buffers went back when it was answered)
    ticket: Ticket
    record: StepRecord


class ShardSession:
    """A session's tensors on one shard.

    Args:
      config: the session.
      tensor_names: the tensors this shard holds (a subset of ``config.tensors``, in order).
      shard_index: this shard's index (its vote and its part of cross-shard sums).
      clock: the session's clock (:class:`~optserve.server.domain.clock.LocalClock` in its home
        shard, a remote handle with the same methods elsewhere).
      updater: the compute side (parameters, optimizer state, the jitted step).
      step_timeout_s: longest wait for a sync barrier, a missing ticket or a reduction.
      vote_timeout_s: auto-commit: longest wait for the peer shards to stage a push.
      staged_push_ttl_s: two-phase path: a push staged without ``auto_commit`` and neither
        committed nor aborted within this long is dropped (rejection reason ABORTED).
      owner: the tenant the session belongs to ("" without tokens).
      creator: the creating client's identity; only it may send the initial values ("": anyone).
      observer: where the session reports what it does (metrics).
      store: durable sessions: where steps are logged and checkpoints written (None: not durable).
      limits: the server's limits (``max_staged_bytes`` bounds this session's staged pushes here).
    """

    def __init__(self, config: SessionConfig, tensor_names: list[str], shard_index: int, clock, updater: Updater,
                 step_timeout_s: float = 300.0, vote_timeout_s: float = 30.0, owner: str = "", creator: str = "",
                 observer: StepObserver = StepObserver(), staged_push_ttl_s: float = 60.0,
                 store: Optional[SessionStore] = None, limits: Optional[Limits] = None):
        if not staged_push_ttl_s > 0:
            raise InvalidArgument(f"staged_push_ttl_s must be > 0, got {staged_push_ttl_s}")
        by_name = config.spec_by_name
        self.config = config
        self.owner = owner
        self.creator = creator
        self.observer = observer
        self._is_home = clock.status() is not None  # the home shard reports each accepted push once
        self.series: Optional[SessionSeries] = SessionSeries() if self._is_home else None
        self.specs: dict[str, TensorSpec] = {name: by_name[name] for name in tensor_names}
        self.shard_index = shard_index
        self.updater = updater
        self.version = 0  # steps applied here; guarded by _cond
        self._clock = clock
        self._timeout = step_timeout_s
        self._vote_timeout = vote_timeout_s
        self._refusals = Refusals(config.name, shard_index, observer, self.series, _log)
        self._staging = StagingArea(config.name, shard_index, self.specs, staged_push_ttl_s, limits or Limits(),
                                    self._refusals)
        self._cond = threading.Condition()  # guards version, _sequencer and the updater's state
        self._sequencer = Sequencer(config, shard_index, step_timeout_s)
        self._elastic = config.is_elastic
        self._round_polled_at = 0.0  # elastic: when a waiting thread last asked the clock (under _cond)
        self._abandoned: Optional[OptservError] = None  # set by abandon(): every wait raises it
        self._step_problem = _UNCHECKED  # why the optimizer's step cannot run here (None: it can); see _receive
        self._durability = ShardDurability(store)
        self._unlogged: Optional[_UnloggedStep] = None  # write-ahead: the step whose record failed (guarded by _cond)
        self.last_activity_unix_s = time.time()  # a client's last push, commit, pull or init here (see touch)

    @property
    def _where(self) -> str:
        """"session 'name' on shard i", as messages name this session's part here."""
        return f"session {self.config.name!r} on shard {self.shard_index}"

    def touch(self) -> None:
        """A client used the session on this shard now (its idle lease starts again)."""
        self.last_activity_unix_s = time.time()

    @property
    def clock(self):
        """The session's clock (a LocalClock on the home shard, a handle on it elsewhere)."""
        return self._clock

    # ----------------------------------------------------------------- initial values
    @property
    def initialized(self) -> bool:
        return self.updater.initialized

    def initialize(self, chunks: Iterable, client_id: str = "") -> int:
        """Installs the initial parameters from ``chunks`` (once), sent by client ``client_id``;
        returns the version (0). Only the session's creator may send them."""
        self.touch()
        if self.creator and client_id != self.creator:
            raise PermissionDenied(f"session {self.config.name!r}: only the client that created it may send "
                                   f"its initial values")
        if self.initialized:
            raise FailedPrecondition(f"session {self.config.name!r}: parameters are already initialized")
        buffers = {s.name: np.empty(s.shape, s.dtype.numpy) for s in self.specs.values()}
        assembler = TensorAssembler(self.specs, buffers, check_finite=False)
        for chunk in chunks:
            assembler.add(chunk)
        values = assembler.finish()
        with self._cond:
            if self.initialized:
                raise FailedPrecondition(f"session {self.config.name!r}: parameters are already initialized")
            try:
                self.updater.initialize(values)
            except Exception as exc:  # noqa: BLE001 - OptservError passes through; the kernel's own failure
                raise self._init_failed(exc) from None
            if self._durability.enabled:  # the initial values are durable before they are acknowledged
                self._checkpoint(wait=True)
            self._cond.notify_all()  # pushes and pulls that arrived first (see _require_initialized)
            return self.version

    def _init_failed(self, exc: Exception) -> OptservError:
        """The optimizer raised while building its state from the initial values: a failure its
        abstract trace at open time did not show (see ``Updater.init_problem``). Nothing was
        installed (the session stays uninitialized; the creating client closes it). Logged with
        its traceback here; the caller hears one line: INVALID_ARGUMENT, or RESOURCE_EXHAUSTED
        when the device ran out of memory."""
        if isinstance(exc, OptservError):
            return exc
        _log.error("event=init_failed session=%s shard=%d optimizer=%s", log_value(self.config.name),
                   self.shard_index, log_value(self.config.optimizer_name), exc_info=exc)
        tensors = tensors_in_words({n: (s.shape, s.dtype.numpy) for n, s in self.specs.items()},
                                   list(self.specs))
        what = (f"session {self.config.name!r}: optimizer {self.config.optimizer_name!r} could not build its state "
                f"for {tensors} on shard {self.shard_index}: {error_line(exc)}")
        if "RESOURCE_EXHAUSTED" in str(exc):
            return ResourceExhausted(what)
        return InvalidArgument(what)

    def _require_initialized(self) -> None:
        """Waits a moment (at most :data:`_INIT_WAIT_S`) for the initial values, then refuses with
        Unavailable, which clients retry: a client that attaches right after the session was
        created may pull before its creator has sent them, and a wait here would hold one of the
        shard's threads that other sessions' calls need."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.initialized or self._abandoned,
                                       timeout=min(self._vote_timeout, _INIT_WAIT_S)):
                raise Unavailable(f"session {self.config.name!r}: its initial values have not reached shard "
                                  f"{self.shard_index} yet (its creating client sends them); retry")
            self._raise_if_abandoned()

    # ----------------------------------------------------------------- the step
    def push(self, header: PushHeader, chunks: Iterable, complete: Callable[[], bool] = lambda: True,
             wait_s: Optional[float] = None, in_place: bool = False) -> Receipt:
        """Receives one push and, with ``header.auto_commit``, applies it with the session's shards.

        Args:
          header: the push's identity.
          chunks: ``TensorChunk``-like items covering this shard's tensors exactly once.
          complete: asked once the chunks ran out: False if the push's stream broke or ended
            early (nothing is then applied anywhere).
          wait_s: how long the caller waits for the answer (its deadline; None: unbounded). The
            wait for the push's step ends at ``step_timeout_s`` or shortly before this, whichever
            comes first, so the caller hears the shard's Timeout rather than its own deadline.
          in_place: the chunks' bytes stay unchanged until this push is answered (a shared-memory
            region, which its client writes only between steps): whole float32 tensors are read
            where they lie (see :class:`~optserve.server.domain.assembly.TensorAssembler`).

        Returns:
          auto_commit: the applied push's receipt; else the staged push's (``committed=False``).

        Raises:
          InvalidArgument / NonFinite: a bad chunk or value (nothing staged, the peers drop theirs).
          Cancelled: the stream ended early.
          Stale / PeerRefused / Timeout: the push was refused or its step never completed (a sync
            step's Timeout names how many of num_workers pushes arrived, and from which clients).
        """
        until = self._wait_until(wait_s)
        self.touch()
        self._staging.expire()
        try:
            already_applied = self._receive(header, chunks, complete, in_place)
        except BaseException:
            if header.auto_commit:  # tell the peers to drop their parts
                self._clock.vote(header.client_id, header.sequence, -1, self.shard_index, False, self._vote_timeout)
            raise
        if not header.auto_commit:
            return Receipt(self.version, already_applied, committed=False)
        ticket = self._decide(header.client_id, header.sequence, lambda base: self._clock.vote(
            header.client_id, header.sequence, base, self.shard_index, True, self._vote_timeout), until)
        return Receipt(ticket.target_version, already_applied, True, ticket.staleness, ticket.scale,
                       self._log_waiter(ticket.target_version))

    def commit(self, client_id: str, sequence: int, wait_s: Optional[float] = None) -> Receipt:
        """Two-phase path: applies a push staged without ``auto_commit``; returns once its step is
        applied here (``wait_s``: as for :meth:`push`).

        Raises:
          NotFound: nothing is staged under the identity and it was never applied (also when it
            expired: not committed within ``staged_push_ttl_s``; the message says so).
        """
        until = self._wait_until(wait_s)
        self.touch()
        self._staging.expire()
        staged, expired_at = self._staging.claim((client_id, sequence))  # a claimed push never expires
        if staged is None and not self._sequencer.already_applied(client_id, sequence):
            raise self._staging.missing((client_id, sequence), expired_at)
        ticket = self._decide(client_id, sequence, lambda base: self._clock.commit(client_id, sequence, base), until)
        return Receipt(ticket.target_version, staged is None, True, ticket.staleness, ticket.scale,
                       self._log_waiter(ticket.target_version))

    def abort(self, client_id: str, sequence: int) -> bool:
        """Two-phase path: drops a staged push (idempotent); returns whether one was dropped."""
        return self._staging.drop((client_id, sequence), RejectReason.ABORTED)

    def _wait_until(self, wait_s: Optional[float]) -> Optional[float]:
        """The monotonic time by which a wait must end to answer a caller that waits ``wait_s``."""
        return None if wait_s is None else time.monotonic() + wait_s - _ANSWER_MARGIN_S

    def _receive(self, header: PushHeader, chunks: Iterable, complete: Callable[[], bool],
                 in_place: bool = False) -> bool:
        """Assembles and stages the push; returns True if it had been applied (nothing staged)."""
        self._require_initialized()
        self._require_runnable_step(header.client_id, header.sequence)
        self._staging.check_room(header.client_id, header.sequence)
        try:  # durable: the step log has room for this push's step (and those staged before it) on the disk
            if not self._sequencer.already_applied(header.client_id, header.sequence):  # a retry logs nothing
                self._reserve_log(steps=self._staging.count + 1)
        except Unavailable:
            self._refusals.refuse(RejectReason.ABORTED, header.client_id, header.sequence, cause="disk")
            raise
        grads, received_bytes = self._staging.assemble(header, chunks, complete,
                                                       check_finite=not self.config.allow_nonfinite,
                                                       in_place=in_place and header.auto_commit)
        self.observer.received(received_bytes)
        if self._sequencer.already_applied(header.client_id, header.sequence):
            self._staging.release(grads)
            return True
        self._staging.stage((header.client_id, header.sequence), header.base_version, grads, header.telemetry,
                            header.auto_commit)  # a retry replaces what an earlier attempt staged
        return False

    def _require_runnable_step(self, client_id: str, sequence: int) -> None:
        """Refuses the push before it is staged (so before any shard votes and the clock decides a
        version) when the optimizer's step cannot run on this shard's tensors: a kernel that raises
        while its update is traced does so for every push, and a step that failed after its ticket
        was decided would leave the clock ahead of this shard and its peers with the step applied.
        The step is traced once (see :meth:`Updater.step_problem`); the answer is kept.

        Raises:
          InvalidArgument: naming the session, the shard, the optimizer and the tensors.
        """
        if self._step_problem is _UNCHECKED:
            with self._cond:  # tracing reads the state's structure, which changes only under the lock
                if self._step_problem is _UNCHECKED:
                    self._step_problem = self.updater.step_problem()
                    if self._step_problem is not None:
                        _log.warning("event=kernel_refused session=%s shard=%d problem=%s",
                                     log_value(self.config.name), self.shard_index, log_value(self._step_problem))
        if self._step_problem is not None:
            self._refusals.refuse(RejectReason.INVALID, client_id, sequence, cause="kernel")
            raise InvalidArgument(f"{self._where}: {self._step_problem}; "
                                  f"the push was applied nowhere and the version did not change (every push of "
                                  f"this session is refused so: its tensors and optimizer do not go together)")

    def _log_waiter(self, version: int) -> Callable[[], None]:
        """What acknowledging step ``version`` waits for: its log record (see ShardDurability.waiter)."""
        return self._durability.waiter(version, self.recover_log, self._where)

    def recover_log(self) -> bool:
        """A durable session whose step log failed: once the disk takes writes again, writes a
        checkpoint of the state now (every step applied, those whose records were lost included)
        and goes on logging after it. Returns whether the log works (False: the disk still fails,
        or a sync step is half gathered here: the step that closes it recovers, see _update)."""
        with self._cond:
            self._raise_if_abandoned()
            if self._durability.write_ahead:
                return self._recover_ahead()
            if not self._durability.log_failed:
                return True
            if self._sequencer.half_gathered or not self.initialized:
                return False
            recovered = self._durability.recover(self.version, lambda: self._checkpoint(wait=True))
            if recovered:
                _log.warning("event=session_log_recovered session=%s shard=%d version=%d", self.config.name,
                             self.shard_index, self.version)
            return recovered

    def _recover_ahead(self) -> bool:
        """Write-ahead order (call with ``_cond`` held): once the disk takes writes, cuts the failed
        record off the log, then logs and applies the step whose record failed (the same gradient
        and cross-shard statistic: the step it would have been). Returns whether the log works
        and no step waits for its record."""
        if not self._durability.recover(self.version, lambda: None):
            return False
        unlogged, self._unlogged = self._unlogged, None
        if unlogged is None:
            return True
        try:
            self._durability.reserve(self._where, self._staging.push_bytes, len(self.specs))  # the cut gave room back
            self._update(unlogged.grads, unlogged.ticket, unlogged.record.tickets, None, unlogged.record.scale,
                         unlogged.record.global_stat)
        except Unavailable:  # the disk failed again (a failed record waits once more)
            if self._unlogged is None:
                self._unlogged = unlogged
            return False
        self._cond.notify_all()
        if not self._durability.syncs_each_record:
            # the failure may have been an fsync's, which also loses records written (not yet
            # synced) before the failed one: a checkpoint holds every step applied
            try:
                self._checkpoint(wait=True)
            except OSError as exc:
                _log.warning("event=checkpoint_after_log_recovery_failed session=%s shard=%d version=%d error=%s",
                             log_value(self.config.name), self.shard_index, self.version, log_value(str(exc)))
        _log.warning("event=session_log_recovered session=%s shard=%d version=%d order=write-ahead",
                     log_value(self.config.name), self.shard_index, self.version)
        return True

    def _require_logged(self) -> None:
        """Write-ahead order (call with ``_cond`` held): a step whose record failed is applied
        before any later one (its turn has come: its tickets were taken), or nothing goes on.

        Raises:
          Unavailable: the disk still fails (naming the session, shard, folder and cause).
        """
        if self._unlogged is not None and not self.recover_log():
            raise Unavailable(f"{self._where}: step "
                              f"{self._unlogged.record.version} waits for its log record ({self._durability.degraded}) "
                              f"and was applied nowhere here; retry once the disk takes writes again")

    def _reserve_log(self, steps: int) -> None:
        """Durable sessions: room on the disk for ``steps`` step records of this shard (raises
        Unavailable, naming the session, shard and directory, when there is none). After a
        failed log write nothing is applied until the log recovered (:meth:`recover_log`)."""
        what = self._where
        self._durability.reserve(what, self._staging.push_bytes, len(self.specs), steps=steps)
        if not self._durability.log_failed:
            return
        if self.recover_log():  # the checkpoint started a fresh segment: reserve there
            self._durability.reserve(what, self._staging.push_bytes, len(self.specs), steps=steps)
        elif not self._sequencer.half_gathered:
            raise Unavailable(f"{what}: the step log failed ({self._durability.degraded}) and cannot recover "
                              f"yet; nothing was applied, retry once the disk takes writes again")
        # else: the disk takes writes (the reservation probed it) but a sync step is half gathered
        # here: its pushes go on, and the update that closes it recovers the log (see _update)

    def _decide(self, client_id: str, sequence: int, ask: Callable[[int], Ticket],
                until: Optional[float] = None) -> Ticket:
        """Gets the push's ticket (``ask(base_version)``), then applies tickets up to it (waiting
        until ``until`` at most, see :meth:`_run_through`)."""
        try:
            ticket = ask(self._staging.base_version((client_id, sequence)))
        except Stale:
            self._staging.drop((client_id, sequence), RejectReason.STALE)
            raise
        except (PeerRefused, Unavailable):
            self._staging.drop((client_id, sequence), RejectReason.ABORTED)
            raise
        self._run_through(ticket, until)
        return ticket

    def _run_through(self, ticket: Ticket, until: Optional[float] = None) -> None:
        """Applies tickets in ordinal order up to ``ticket``, then waits for its step: for
        ``step_timeout_s`` at most, or until the monotonic time ``until`` (the caller's deadline)."""
        started = time.monotonic()
        deadline = started + self._timeout if until is None else min(started + self._timeout, until)
        sequencer = self._sequencer
        with self._cond:
            if sequencer.arrive(ticket):  # else: a retry of a push applied already
                self._cond.notify_all()
            while not sequencer.reached(ticket):
                pending = sequencer.next_ready(self._awaits_resend)
                if pending is not None:
                    self._apply_ticket(pending)
                    self._cond.notify_all()
                    continue
                self._raise_if_abandoned()
                if not self._cond.wait(timeout=_GAP_POLL_S):
                    self._raise_if_abandoned()
                    sequencer.poll_missing(self._clock)
                if time.monotonic() > deadline:
                    raise sequencer.gap_timeout()
            while self.version < ticket.target_version:
                self._raise_if_abandoned()
                self._require_logged()  # write-ahead: this step's record may have failed
                if self.version >= ticket.target_version:
                    break
                if self._elastic:  # the round may commit without a push: ask the clock for its next ticket
                    pending = sequencer.next_ready(self._awaits_resend)
                    if pending is not None:
                        self._apply_ticket(pending)
                        self._cond.notify_all()
                        continue
                    self._cond.wait(timeout=max(0.0, min(_ROUND_POLL_S, deadline - time.monotonic())))
                    if time.monotonic() - self._round_polled_at >= _ROUND_POLL_S:
                        self._round_polled_at = time.monotonic()
                        sequencer.poll_missing(self._clock)
                    if time.monotonic() <= deadline:
                        continue
                elif self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    continue
                raise Timeout(self._step_timeout_message(ticket, time.monotonic() - started))

    def _step_timeout_message(self, ticket: Ticket, waited_s: float) -> str:
        """Why ``ticket``'s step did not complete (an elastic session's home shard names the members
        that did not push)."""
        message = self._sequencer.step_timeout_message(ticket, waited_s)
        status = self._clock.status() if self._elastic else None
        if status is None or status.elastic is None:
            return message
        missing = sorted(set(status.elastic.members) - set(self._sequencer.step.workers))
        return (f"{message}; min_workers={self.config.min_workers}, members now: "
                f"{', '.join(status.elastic.members) or 'none'}; not pushed: {', '.join(missing) or 'none'}")

    def _awaits_resend(self, ticket: Ticket) -> bool:
        """A durable session's ticket whose push is not staged here: it was decided before this
        shard restarted (its staged copy died with the process) and is applied once its client,
        retrying, sends it again. (Without durability such a ticket is a fault: see _apply_ticket.)"""
        return (self._durability.enabled and not ticket.closes_round
                and not self._staging.holds((ticket.client_id, ticket.sequence)))

    def _apply_ticket(self, ticket: Ticket) -> None:
        """Applies the ticket whose turn it is (call with ``_cond`` held): async, its push runs the
        update; sync, it joins the open step, and the push that closes the step runs the update
        with the step's mean."""
        try:
            self._require_logged()
        except Unavailable:
            self._sequencer.arrive(ticket)  # still its turn: applied by a retry once the log works
            raise
        if not self._sequencer.sync or ticket.closes_step:  # its step is logged: room first (reserved when
            # staged; a checkpoint since may have started a fresh log segment)
            try:
                self._reserve_log(steps=1)
            except Unavailable:
                self._sequencer.arrive(ticket)  # still its turn: applied by the retry once there is room
                raise
        if ticket.closes_round:  # an elastic round committed without a further push
            self._sequencer.advance(ticket)
            mean, tickets = self._sequencer.hold_or_close(ticket)
            self._update(mean, ticket, tickets, scale=1.0)
            return
        staged = self._staging.take((ticket.client_id, ticket.sequence))
        self._sequencer.advance(ticket)
        if staged is None:
            raise Timeout(
                f"session {self.config.name!r}: push {ticket.sequence} of client {ticket.client_id!r} was "
                f"committed but never staged on shard {self.shard_index}"
            )
        self._sequencer.applied(ticket)
        if self._is_home:
            self.observer.accepted(ticket.staleness)
            self.series.accepted(ticket.target_version, ticket.staleness, staged.telemetry)
        grads = staged.grads
        if self._sequencer.sync:
            self._sequencer.add(grads, ticket)
            self._staging.release(grads)
            closed = self._sequencer.hold_or_close(ticket)
            if closed is not None:  # each push's scale is in the mean already
                mean, tickets = closed
                self._update(mean, ticket, tickets, scale=1.0)
            return
        self._update(grads, ticket, (entry(ticket),), release=lambda: self._staging.release(grads))

    def _update(self, grads: dict[str, np.ndarray], ticket: Ticket, tickets: tuple,
                release: Optional[Callable[[], None]] = None, scale: Optional[float] = None,
                global_stat: Optional[float] = None) -> None:
        """Applies one step scaled by ``scale`` (None: the ticket's), then ``release()`` (the
        gradient buffers may be reused). A durable session also logs the step: in the background
        while the update runs (its answers wait for it, see :class:`Receipt`), or, in write-ahead
        order, before the update; and checkpoints after it when the ticket says so.
        ``global_stat``: the cross-shard statistic found already (a step whose record failed)."""
        scale = ticket.scale if scale is None else scale
        start = time.perf_counter()
        ahead = self._durability.write_ahead
        if not ahead:
            self._durability.begin_step(grads, self.specs)  # the gradient goes to the log while the update runs
        records: list[StepRecord] = []

        def log_ahead(stat: float) -> None:
            records.append(StepRecord(ticket.target_version, tickets, scale, stat))
            self._durability.log_ahead(grads, self.specs, records[0], self._where)

        if global_stat is None:
            reduce = lambda partial: self._clock.reduce_sum(ticket.target_version, self.shard_index, partial)  # noqa: E731
        else:
            reduce = lambda _partial: global_stat  # noqa: E731
        try:
            global_stat = self.updater.apply(grads, scale, reduce, before=log_ahead if ahead else None)
        except LogWriteFailed:  # applied nowhere here: the step waits for the log (see _require_logged)
            # with a copy of its own: the push's buffers (the staging pool, or the client's shared-memory
            # region, which the client writes its next gradient into) are given back once it is answered
            owned = {name: np.array(grad, copy=True) for name, grad in grads.items()}
            if release is not None:
                release()
            self._unlogged = _UnloggedStep(owned, ticket, records[0])
            self._cond.notify_all()
            raise
        except BaseException as exc:
            if not ahead:
                self._durability.abort_step()
            if isinstance(exc, OptservError) or not isinstance(exc, Exception):  # e.g. the cross-shard sum's Timeout
                raise
            raise self._step_failed(ticket, exc) from None  # the kernel's own failure
        if ahead:
            if release is not None:
                release()
        else:
            self._durability.end_step(StepRecord(ticket.target_version, tickets, scale, global_stat), release)
        self.version = ticket.target_version
        self.observer.applied(time.perf_counter() - start)
        if self._durability.log_failed:  # a step boundary: its waiters find the log recovered, or not
            self.recover_log()
        elif ticket.checkpoint and self._durability.enabled:
            self._checkpoint()

    def _step_failed(self, ticket: Ticket, exc: Exception) -> SessionLost:
        """The kernel raised while running the step of ``ticket`` (call with ``_cond`` held), after
        the clock decided its version and maybe after the peer shards applied it: a failure that
        tracing does not show (see :meth:`_require_runnable_step`), such as an XLA error at run time.
        The update donates the parameters and optimizer state, so they may be gone, and this shard
        can no longer follow the clock: the session ends here (every call, here and through its
        clock, raises the error returned), loudly rather than with shards that silently disagree."""
        _log.error("event=step_failed session=%s shard=%d version=%d optimizer=%s", log_value(self.config.name),
                   self.shard_index, ticket.target_version, log_value(self.config.optimizer_name), exc_info=exc)
        error = SessionLost(
            f"session {self.config.name!r}: optimizer {self.config.optimizer_name!r} failed in step "
            f"{ticket.target_version} on shard {self.shard_index} ({error_line(exc)}) after the step was decided; "
            f"its state on this shard can no longer follow the session's version, so the session ended: close it")
        self.abandon(error)
        return error

    def abandon(self, error: OptservError) -> None:
        """Ends the session on this shard (it was closed, or lost a peer shard): every call
        waiting in it, and every later one, raises ``error``; its clock's waits end too."""
        with self._cond:
            self._abandoned = error
            self._cond.notify_all()
        abandon_clock = getattr(self._clock, "abandon", None)  # the home shard's LocalClock
        if abandon_clock is not None:
            abandon_clock(error)

    def _raise_if_abandoned(self) -> None:
        if self._abandoned is not None:
            raise self._abandoned

    # ----------------------------------------------------------------- durability
    def _checkpoint(self, wait: bool = False) -> bool:
        """Snapshots the state at the current version into the store (call with ``_cond`` held,
        between steps). The home shard adds its clock's state."""
        clock_state = getattr(self._clock, "durable_state", None) if self._is_home else None
        return self._durability.checkpoint(self._sequencer.progress(self.version), self.updater.params,
                                           self.updater.opt_state, clock_state, wait=wait)

    def checkpoint_now(self) -> bool:
        """A checkpoint of the current state, written before this returns (server shutdown);
        False when there is nothing new since the last one or nothing to save."""
        with self._cond:
            if (not self._durability.enabled or not self.initialized
                    or self._durability.has_checkpoint_of(self.version)):
                return False
            if self._sequencer.half_gathered:  # mid sync step: its log position is not a step boundary
                return False
            if self._unlogged is not None:  # its tickets count as applied: the state is one step behind
                return False
            return self._checkpoint(wait=True)

    def restore(self, store, read_log, journal_tickets: Callable[[Optional[dict]], list],
                upto: Optional[int] = None) -> int:
        """Durable sessions, at recovery: loads the latest checkpoint and replays the step log.

        Args:
          store: the session's store on this shard (also where later steps are logged).
          read_log: ``(segment_path, arrays) -> reader`` (see :func:`~.shard_durability.replay`).
          journal_tickets: ``manifest -> [entry]``: the clock journal after the checkpoint (home shard).
          upto: the version every shard of the session is restored to (a whole server's restore:
            later logged steps are rolled back, and the home clock forgets their tickets); None:
            the last step this shard logged (one shard restarted among running ones).

        Returns the version reached.
        """
        manifest = store.latest()
        with self._cond:
            if manifest is not None:
                progress, records = replay(store, manifest, self.updater, self.specs, read_log, upto)
                self.version = progress.version
                self._sequencer.restore(progress)
                if self._is_home:
                    settle_at = (progress.version, progress.next_ordinal) if upto is not None else None
                    self._clock.restore(manifest.get("clock"), journal_tickets(manifest),
                                        replayed=[t for r in records for t in step_tickets(r)], settle_at=settle_at)
            store.start_logs(manifest, self.version)
            store.recoveries += 1
            self._durability.attach(store)
            self._cond.notify_all()
            return self.version

    def attach_store(self, store: SessionStore) -> None:
        """Makes a new session durable: its steps are logged to ``store`` from now on."""
        self._durability.attach(store)

    def close_store(self) -> None:
        """Finishes a checkpoint being written and closes the log (the session is closing)."""
        self._durability.close()

    # ----------------------------------------------------------------- elastic membership (home shard)
    def membership(self, worker: str, action: str) -> tuple[int, list[str], float]:
        """Elastic sync: ``worker`` joins, renews its lease or leaves ("join" / "renew" / "leave");
        returns the version, the members and the lease in seconds."""
        self.touch()
        return self._home_clock("membership").membership(worker, action)

    def history(self, since: int) -> list:
        """Elastic sync: the :class:`~optserve.server.domain.rounds.RoundRecord` of each version after ``since``."""
        return self._home_clock("history").history(since)

    def disconnected(self, client_id: str) -> None:
        """The connection that carried ``client_id``'s pushes dropped: in an elastic session its
        worker leaves now (the home shard keeps the membership; elsewhere nothing to do)."""
        if self._elastic and self._is_home:
            self._clock.disconnected(worker_of(client_id))

    def _home_clock(self, what: str):
        if not self._is_home:
            raise FailedPrecondition(f"session {self.config.name!r}: {what} is kept by its home shard (the first "
                                     f"shard of its shard map), not shard {self.shard_index}")
        return self._clock

    # ----------------------------------------------------------------- reading
    def snapshot(self) -> tuple[int, dict[str, np.ndarray]]:
        """The current version and host views of the parameters (consistent with each other)."""
        self.touch()
        with self._cond:
            self._require_initialized()
            return self.version, self.updater.host_params()

    def status(self) -> ShardSessionStatus:
        """The session on this shard (expired staged pushes are dropped first, so counts are current)."""
        self._staging.expire()
        preconditioners = self.updater.preconditioners
        return ShardSessionStatus(
            version=self.version, initialized=self.initialized, rejected=dict(self._refusals.counts),
            device=str(self.updater.device), clock=self._clock.status(),
            preconditioners=preconditioners.status() if preconditioners is not None else None,
            state_bytes=self.updater.state_bytes(), last_activity_unix_s=self.last_activity_unix_s,
            durability=self._durability.status())
