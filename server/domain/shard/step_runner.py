"""The apply side of one session on one shard: decided tickets applied in order, each as a durable step.

:class:`StepRunner` takes the tickets the session's clock decided and applies them strictly in
ordinal order (the shard's apply queue, :class:`~optserve.server.domain.shard.apply_queue.ApplyQueue`), so
every shard applies the same pushes in the same order: an async push runs the update with its
own gradient; a sync push joins its step, and the push that closes the step runs the update with
the step's mean. Each update runs as a step of the session's
:class:`~optserve.server.domain.shard.step_journal.StepJournal` (logged as its order says), and a
checkpoint follows when the ticket made one due.

Kernel failures: a step that fails only when it runs (after the clock decided it and the update
donated the state) ends the session on this shard with one SessionLost naming it
(:meth:`StepRunner.abandon`): every wait here, and the home clock's, raises it.

Locks: :attr:`StepRunner.cond` (re-entrant) guards the version, the apply queue, the journal and
the updater's state; the session's receive side takes it too.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable, Iterable, Mapping, Optional

import numpy as np

from optserve.server.compute.kernel_words import error_line
from optserve.server.compute.root_offload import NO_ROOTS, RootReplication
from optserve.server.compute.updater import Updater
from optserve.server.domain.clock import Ticket
from optserve.server.domain.config import SessionConfig, TensorSpec
from optserve.server.domain.durability import ShardProgress
from optserve.server.domain.errors import (InvalidArgument, OptservError, PeerRefused, RejectReason, SessionLost, Stale,
                                           Timeout, Unavailable)
from optserve.server.domain.shard.apply_queue import ApplyQueue, entry
from optserve.server.domain.shard.journal_records import JournaledStep, UnloggedStep
from optserve.server.domain.shard.refusals import log_value
from optserve.server.domain.shard.replica import params_digest
from optserve.server.domain.shard.shard_records import StepObserver
from optserve.server.domain.shard.staging import StagingArea
from optserve.server.domain.shard.sparse_relay import SparseRelay
from optserve.server.domain.shard.step_journal import LogWriteFailed, StepJournal
from optserve.server.domain.telemetry import SessionSeries
from optserve.server.domain.waits import SignalCondition, Steps

_log = logging.getLogger(__name__)

_GAP_POLL_S = 0.25
# Elastic rounds may commit without a push (straggler deadline, a member gone): a shard waiting in
# one asks the clock this often (one waiting thread per shard asks; the others wait on its answer).
_ROUND_POLL_S = 0.02
WAITING_NOTICE_S = 5.0  # a sync step still gathering its pushes this long is logged (once, per shard)


def _dropped_as(refused: OptservError) -> RejectReason:
    """Why a staged push whose decision was refused is dropped (counted and logged as)."""
    if isinstance(refused, Stale):
        return RejectReason.STALE
    return RejectReason.INVALID if isinstance(refused, InvalidArgument) else RejectReason.ABORTED


class StepRunner:
    """Applies a session's decided tickets on one shard (see the module's docstring).

    Args:
      config: the session.
      shard_index: this shard's index (its part of cross-shard sums).
      specs: this shard's tensors, in order.
      clock: the session's clock.
      updater: the compute side (parameters, optimizer state, the jitted step).
      staging: the session's staged pushes on this shard.
      observer / series: where applied steps are reported (series: the home shard's, else None).
      step_timeout_s: longest wait for a sync barrier, a missing ticket or a reduction.

    Attributes:
      version: steps applied here (guarded by :attr:`cond`).
      cond: the lock and condition of the session's state on this shard.
      queue: the apply queue (ticket order, idempotency, sync means).
      journal: the durable step.
    """

    def __init__(self, config: SessionConfig, shard_index: int, specs: Mapping[str, TensorSpec], clock,
                 updater: Updater, staging: StagingArea, observer: StepObserver, series: Optional[SessionSeries],
                 step_timeout_s: float):
        self.config = config
        self.shard_index = shard_index
        self.updater = updater
        self.observer = observer
        self.series = series
        self.version = 0
        self.cond = SignalCondition()  # re-entrant: the journal calls back while it is held
        self.queue = ApplyQueue(config, shard_index, step_timeout_s)
        self.journal = StepJournal(self, specs, staging.push_bytes, config.name, shard_index)
        self._tensor_names = list(specs)
        self.relay = SparseRelay(config.sparse_mean_over_senders)  # sparse steps' compact answers
        self._clock = clock
        self._is_home = clock.is_home
        self._staging = staging
        self._timeout = step_timeout_s
        self._elastic = config.is_elastic
        self._round_polled_at = 0.0  # elastic: when a waiting thread last asked the clock (under cond)
        self._abandoned: Optional[OptservError] = None  # set by abandon(): every wait raises it

    @property
    def where(self) -> str:
        """"session 'name' on shard i", as messages name this session's part here."""
        return f"session {self.config.name!r} on shard {self.shard_index}"

    @property
    def initialized(self) -> bool:
        """The initial values are installed."""
        return self.updater.initialized

    @property
    def clock(self):
        """The session's clock (see :class:`~optserve.server.domain.clock.home_clock.Clock`)."""
        return self._clock

    @property
    def abandoned(self) -> Optional[OptservError]:
        """Why the session ended on this shard (None: it did not)."""
        return self._abandoned

    def decide_steps(self, client_id: str, sequence: int, ask: Callable[[int], Steps[Ticket]],
                     until: Optional[float] = None) -> Steps[Ticket]:
        """Gets the push's ticket (``yield from ask(base_version)``), then applies tickets up to it
        (waiting until ``until`` at most, see :meth:`run_through_steps`). Waits are yielded
        (:mod:`~optserve.server.domain.waits`)."""
        try:
            ticket = yield from ask(self._staging.base_version((client_id, sequence)))
        except (Stale, PeerRefused, Unavailable, InvalidArgument) as refused:  # its buffers go back at once
            self._staging.drop((client_id, sequence), _dropped_as(refused))
            raise
        yield from self.run_through_steps(ticket, until)
        return ticket

    def run_through_steps(self, ticket: Ticket, until: Optional[float] = None) -> Steps[None]:
        """Applies tickets in ordinal order up to ``ticket``, then waits for its step: for
        ``step_timeout_s`` at most, or until the monotonic time ``until`` (the caller's deadline).
        Each wait is yielded with :attr:`cond` released, and so is the wait for :attr:`cond` itself
        while another step's update holds it (:meth:`~optserve.server.domain.waits.SignalCondition.hold_steps`)."""
        started = time.monotonic()
        deadline = started + self._timeout if until is None else min(started + self._timeout, until)
        queue = self.queue
        with (yield from self.cond.hold_steps()):
            if queue.arrive(ticket):  # else: a retry of a push applied already
                self.cond.notify_all()
        while True:  # its turn: the tickets before it applied
            with (yield from self.cond.hold_steps()):
                if queue.reached(ticket):
                    break
                pending = queue.next_ready(self._awaits_resend)
                if pending is not None:
                    self._apply_ticket(pending)
                    self.cond.notify_all()
                    continue
                self.raise_if_abandoned()
                wait = self.cond.wait_step(_GAP_POLL_S)
            if not (yield wait):
                with (yield from self.cond.hold_steps()):
                    self.raise_if_abandoned()
                    queue.poll_missing(self._clock)
            if time.monotonic() > deadline:
                with (yield from self.cond.hold_steps()):
                    raise queue.gap_timeout()
        while True:  # its step: applied once the step's pushes (sync) or the round (elastic) are in
            with (yield from self.cond.hold_steps()):
                if self.version >= ticket.target_version:
                    return
                self.raise_if_abandoned()
                self.journal.require_logged()  # write-ahead: this step's record may have failed
                if self.version >= ticket.target_version:
                    return
                if self._elastic:  # the round may commit without a push: ask the clock for its next ticket
                    pending = queue.next_ready(self._awaits_resend)
                    if pending is not None:
                        self._apply_ticket(pending)
                        self.cond.notify_all()
                        continue
                    wait = self.cond.wait_step(max(0.0, min(_ROUND_POLL_S, deadline - time.monotonic())))
                else:
                    wake_at = queue.wait_until(ticket, started, deadline, WAITING_NOTICE_S)
                    wait = self.cond.wait_step(max(0.0, wake_at - time.monotonic()))
            notified = yield wait
            with (yield from self.cond.hold_steps()):
                if self._elastic:
                    if time.monotonic() - self._round_polled_at >= _ROUND_POLL_S:
                        self._round_polled_at = time.monotonic()
                        queue.poll_missing(self._clock)
                    if time.monotonic() <= deadline:
                        continue
                elif notified:
                    continue
                elif time.monotonic() < deadline:  # the notice's time came first (said once per step)
                    queue.notice_waiting(ticket, time.monotonic() - started)
                    continue
                raise Timeout(step_timeout_message(queue, self._clock.status() if self._elastic else None,
                                                  self.config.min_workers, ticket, time.monotonic() - started))

    def _awaits_resend(self, ticket: Ticket) -> bool:
        """A durable or replicated session's ticket whose push is not staged here: it was decided
        before this shard restarted or its standby was promoted (its staged copy died with the
        primary's process), or decided though its call heard
        a refusal (the clock's ticket journal could not be written: its staged copy was dropped),
        and is applied once its client, retrying, sends it again. (Without durability such a
        ticket is a fault: see _apply_ticket.)"""
        return ((self.journal.enabled or self.journal.replicated) and not ticket.closes_round
                and not self._staging.holds((ticket.client_id, ticket.sequence)))

    def _apply_ticket(self, ticket: Ticket) -> None:
        """Applies the ticket whose turn it is (call with ``cond`` held): async, its push runs the
        update; sync, it joins the open step, and the push that closes the step runs the update
        with the step's mean."""
        try:
            self.journal.require_logged()
        except Unavailable:
            self.queue.arrive(ticket)  # still its turn: applied by a retry once the log works
            raise
        if not self.queue.sync or ticket.closes_step:  # its step is logged: room first (reserved when
            # staged; a checkpoint since may have started a fresh log segment)
            try:
                self.journal.reserve(steps=1)
            except Unavailable:
                self.queue.arrive(ticket)  # still its turn: applied by the retry once there is room
                raise
        if ticket.hyperparams:  # set since the previous ticket: in force from this ticket's step on
            self.updater.set_hyper(json.loads(ticket.hyperparams))
        if ticket.closes_round:  # an elastic round committed without a further push
            self.queue.advance(ticket)
            mean, tickets, absent = self.queue.hold_or_close(ticket)
            self._update(mean, ticket, tickets, scale=1.0, absent=absent)
            return
        staged = self._staging.take((ticket.client_id, ticket.sequence))
        if staged is None and (self.journal.enabled or self.journal.replicated):
            # It was staged when its turn came (see _awaits_resend) and was dropped since: its own
            # call heard a refusal for a ticket the clock decided all the same (the ticket journal
            # could not be written), and its client sends it again with the same sequence. Like a
            # ticket decided before a restart, it keeps its turn until that retry stages it here:
            # taking its turn without its gradient would leave this shard a push short of its step
            # for good (the clock past the step, this shard never reaching it) while its peers apply
            # the retry. Nothing was applied; the hyperparameters set above are the ticket's own.
            self.queue.arrive(ticket)
            return
        self.queue.advance(ticket)
        if staged is None:
            raise Timeout(
                f"session {self.config.name!r}: push {ticket.sequence} of client {ticket.client_id!r} was "
                f"committed but never staged on shard {self.shard_index}"
            )
        self.queue.applied(ticket)
        if self._is_home:
            self.observer.accepted(ticket.staleness)
            self.series.accepted(ticket.target_version, ticket.staleness, staged.telemetry)
        grads = staged.grads
        alone = self.queue.close_alone(grads, ticket, staged.without_gradient) if self.queue.sync else None
        if alone is not None:  # a step of one push: its gradients are the mean, released as an async push's
            mean, tickets, absent = alone
            self._update(mean, ticket, tickets, release=lambda: self._staging.release(grads), scale=1.0, absent=absent)
            return
        if self.queue.sync:
            self.queue.add(grads, ticket, staged.without_gradient)
            self._staging.release(grads)
            closed = self.queue.hold_or_close(ticket)
            if closed is not None:  # each push's scale is in the mean already
                mean, tickets, absent = closed
                self._update(mean, ticket, tickets, scale=1.0, absent=absent)
            return
        self._update(grads, ticket, (entry(ticket),), release=lambda: self._staging.release(grads),
                     absent=staged.without_gradient)

    def _update(self, grads: dict[str, np.ndarray], ticket: Ticket, tickets: tuple,
                release: Optional[Callable[[], None]] = None, scale: Optional[float] = None,
                global_stat: Optional[float] = None, absent: Iterable[str] = ()) -> None:
        """Applies one step scaled by ``scale`` (None: the ticket's) as a durable step of the
        journal (logged as its order says), then ``release()`` (the gradient buffers may be
        reused). ``global_stat``: the cross-shard statistic found already (a step whose record
        failed). ``absent``: tensors without a gradient in this step (left alone)."""
        step = JournaledStep(ticket, tickets, ticket.scale if scale is None else scale, plain_hyper(self.updater.hyper),
                             tuple(sorted(absent)))
        start = time.perf_counter()
        if global_stat is None:
            reduce = lambda partial: self._clock.reduce_sum(ticket.target_version, self.shard_index, partial)  # noqa: E731
        else:
            reduce = lambda _partial: global_stat  # noqa: E731
        try:
            with self.relay.step(self.queue.take_closed_parts(), self.updater.host_params, grads, self.version,
                                 ticket.target_version):
                self.journal.run(grads, step, lambda before: self.updater.apply(grads, step.scale, reduce,
                                                                                before=before, absent=step.absent),
                                 release)
        except LogWriteFailed:  # applied nowhere here: the step waits for the log (see StepJournal.require_logged)
            self.cond.notify_all()
            raise
        except Exception as exc:  # noqa: BLE001 - OptservError passes through (e.g. the cross-shard sum's Timeout)
            if isinstance(exc, OptservError):
                raise
            raise self._step_failed(ticket, exc) from None  # the kernel's own failure
        self.version = ticket.target_version
        self.observer.applied(time.perf_counter() - start)
        self.journal.after_step(ticket.checkpoint)

    def reapply(self, unlogged: UnloggedStep) -> None:
        """Write-ahead order: applies the step whose record failed, logged first this time (its
        journal calls this once the disk takes writes; ``cond`` held)."""
        self._update(unlogged.grads, unlogged.step.ticket, unlogged.step.tickets, None, unlogged.step.scale,
                     unlogged.global_stat, unlogged.step.absent)
        self.cond.notify_all()

    @property
    def half_gathered(self) -> bool:
        """A sync step is gathering its pushes here: the state is not at a step boundary."""
        return self.queue.half_gathered

    def checkpoint_state(self) -> tuple[ShardProgress, dict, Any, Optional[Callable], bool]:
        """What a checkpoint saves (call with ``cond`` held, between steps): the progress, the
        parameters, the optimizer state, on the home shard its clock's state, and whether the
        parameters and state are a host copy (an accelerator's) rather than views of the live state."""
        clock_state = self._clock.durable_state if self._is_home else None
        progress = self.queue.progress(self.version, plain_hyper(self.updater.hyper), self.updater.chunk_tensors)
        params, opt_state = self.updater.host_state()
        return progress, params, opt_state, clock_state, self.updater.host_state_is_copy

    def _step_failed(self, ticket: Ticket, exc: Exception) -> SessionLost:
        """The kernel raised running ``ticket``'s step (``cond`` held): the session ends here."""
        self.abandon(error := step_failure(self.config, self.shard_index, ticket, exc))
        return error

    def abandon(self, error: OptservError) -> None:
        """Ends the session on this shard (it was closed, or lost a peer shard): every call
        waiting in it, and every later one, raises ``error``; its clock's waits end too."""
        with self.cond:
            self._abandoned = error
            self.cond.notify_all()
        if self._is_home:  # the clock's waits end too
            self._clock.abandon(error)

    def raise_if_abandoned(self) -> None:
        if self._abandoned is not None:
            raise self._abandoned

    @property
    def preconditioners(self) -> RootReplication:
        """The part's matrix roots' handling (:data:`NO_ROOTS` for a kernel without roots)."""
        preconditioners = self.updater.preconditioners
        return NO_ROOTS if preconditioners is None else preconditioners

    def root_installs(self) -> list:
        """See ``JournalOwner.root_installs`` (none for a kernel without offloaded roots)."""
        return self.preconditioners.take_installs()

    def params_digest(self) -> int:
        """See ``JournalOwner.params_digest``."""
        return params_digest(self.updater.host_params(), self._tensor_names)

    def recover_log(self) -> bool:
        """A durable session whose step log failed: recovers it once the disk takes writes again
        (see :meth:`StepJournal.recover`). Returns whether the log works."""
        with self.cond:
            self.raise_if_abandoned()
            return self.journal.recover()


def step_timeout_message(queue, status, min_workers: int, ticket: Ticket, waited_s: float) -> str:
    """Why ``ticket``'s step did not complete; with an elastic session's clock ``status`` (its home
    shard), naming the members that did not push."""
    message = queue.step_timeout_message(ticket, waited_s)
    if status is None or status.elastic is None:
        return message
    missing = sorted(set(status.elastic.members) - set(queue.step.workers))
    return (f"{message}; min_workers={min_workers}, members now: "
            f"{', '.join(status.elastic.members) or 'none'}; not pushed: {', '.join(missing) or 'none'}")


def plain_hyper(hyper: Mapping[str, Mapping[str, Any]]) -> dict:
    """``{group: {option: float}}`` of the updater's hyperparameters (JSON for records)."""
    return {group: {option: float(value) for option, value in values.items()} for group, values in hyper.items()}


def step_failure(config: SessionConfig, shard_index: int, ticket: Ticket, exc: Exception) -> SessionLost:
    """The error that ends a session whose kernel raised while running the step of ``ticket``,
    after the clock decided its version and maybe after the peer shards applied it: a failure
    that tracing does not show (see ``ShardSession._require_runnable_step``), such as an XLA error
    at run time. The update donates the parameters and optimizer state, so they may be gone, and
    the shard can no longer follow the clock: every call, there and through its clock, raises the
    error, loudly rather than with shards that silently disagree. Logged here."""
    _log.error("event=step_failed session=%s shard=%d version=%d optimizer=%s", log_value(config.name),
               shard_index, ticket.target_version, log_value(config.optimizer_name), exc_info=exc)
    return SessionLost(
        f"session {config.name!r}: optimizer {config.optimizer_name!r} failed in step "
        f"{ticket.target_version} on shard {shard_index} ({error_line(exc)}) after the step was decided; "
        f"its state on this shard can no longer follow the session's version, so the session ended: close it")
