"""Ticket order on one shard: which push applies next, which applied already, what a sync step holds.

The session clock hands out tickets with ordinals 0, 1, 2, ...; every shard applies them strictly
in that order, so all shards apply the same pushes in the same order. A ticket may reach a shard
before the tickets ahead of it (another client's call carries those); it waits in
:attr:`ApplyQueue.arrived` until its turn. A ticket the shard never hears of is fetched from the
clock (:meth:`ApplyQueue.poll_missing`, every gap poll).

Idempotency: :attr:`ApplyQueue.applied_sequence` holds each client's last applied push; a retry of
an applied push finds it there and applies nothing twice.

Sync mode: the pushes of one step are summed as they apply (:meth:`ApplyQueue.add`); the ticket
that closes the step turns the sum into the mean that the update runs with
(:meth:`ApplyQueue.hold_or_close`). A step of one push at scale 1 (``num_workers`` 1) is that
push's gradients as they are, not copied (:meth:`ApplyQueue.close_alone`).

Every attribute and method here is guarded by the shard session's condition (call with it held),
except :meth:`ApplyQueue.already_applied`, a single dictionary read as in the session's receive path.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import numpy as np

from optserve.server.compute.buffers import IO_ALIGNMENT, aligned_empty
from optserve.server.domain.clock import Ticket
from optserve.server.domain.config import Mode, SessionConfig, worker_of
from optserve.server.domain.durability import ShardProgress
from optserve.server.domain.errors import Timeout
from optserve.server.domain.shard.refusals import log_value

_log = logging.getLogger(__name__)

TicketEntry = tuple[int, str, int]  # (ordinal, client_id, sequence): one push of a step, as logged


@dataclasses.dataclass
class GatheredStep:
    """Sync mode: the open step's pushes applied on this shard so far.

    Attributes:
      total: tensor name -> the sum of their gradients (None until the first push, and again once
        the step closes: the shard is then at a step boundary).
      count: how many pushes ``total`` sums.
      clients: the clients whose pushes it holds, in ticket order (for a timeout's message).
      workers: their workers (see :func:`~optserve.server.domain.config.worker_of`).
      tickets: those pushes' entries (the closing push's entry is added when the step is logged).
      with_gradient: the tensors some push of the step had a gradient for.
      senders: sessions that average sparse tensors over their senders
        (``sparse_mean_over_senders``): tensor name -> how many of the step's pushes named each
        entry (int32, flat), for the tensors some push sent as a SparseLoCo selection.
      parts: tensor name -> each push's sparse chunks, in ticket order, for the tensors every
        push of the step sent as a SparseLoCo selection at scale 1 (what a reply may relay, see
        :mod:`~optserve.server.domain.shard.sparse_relay`).
    """

    total: Optional[dict[str, np.ndarray]] = None
    with_gradient: set = dataclasses.field(default_factory=set)
    count: int = 0
    clients: list[str] = dataclasses.field(default_factory=list)
    workers: list[str] = dataclasses.field(default_factory=list)
    tickets: list[TicketEntry] = dataclasses.field(default_factory=list)
    senders: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    parts: dict[str, list] = dataclasses.field(default_factory=dict)

    def keep_parts(self, grads: dict[str, np.ndarray], scaled: bool) -> None:
        """Keeps the push about to be added (``count`` pushes before it) among ``parts``."""
        chunks = getattr(grads, "sparse_chunks", {})
        for name in grads:
            if name in chunks and not scaled and (self.count == 0 or name in self.parts):
                self.parts.setdefault(name, []).append(chunks[name])
            else:
                self.parts.pop(name, None)

    def count_senders(self, grads: dict[str, np.ndarray]) -> None:
        """Counts the push about to be added (``count`` pushes before it): each entry its sparse
        tensors named, every entry of the others."""
        support = getattr(grads, "support", {})
        for name, positions in support.items():
            if name not in self.senders:  # the earlier pushes sent it whole
                self.senders[name] = np.full(grads[name].size, self.count, np.int32)
            self.senders[name][positions] += 1
        for name, counts in self.senders.items():
            if name not in support:
                counts += 1

    def mean(self) -> dict[str, np.ndarray]:
        """The step's mean gradient, in place of ``total``: per entry over its senders for the
        tensors in ``senders``, else over ``count``."""
        mean = {}
        for name, total in self.total.items():
            counts = self.senders.get(name)
            if counts is None:
                mean[name] = np.divide(total, np.float32(self.count), out=total)
            else:
                flat = total.reshape(-1)
                np.divide(flat, counts.astype(np.float32), out=flat, where=counts > 0)
                mean[name] = total
        return mean


def entry(ticket: Ticket) -> TicketEntry:
    """The ticket's push as a step's log names it."""
    return ticket.ordinal, ticket.client_id, ticket.sequence


class ApplyQueue:
    """Ticket order, idempotency and sync averaging of one session on one shard.

    Args:
      config: the session (its name for messages, its mode and ``num_workers``).
      shard_index: this shard's index (in messages).
      step_timeout_s: the session's ``step_timeout_s`` (named in a sync step's timeout message).

    Attributes:
      next_ordinal: the ordinal of the next ticket to apply here (every lower one is applied).
      arrived: tickets at or past ``next_ordinal`` that reached this shard, by ordinal.
      applied_sequence: client id -> the sequence of its last push applied here.
      sync: pushes are summed into steps of ``num_workers`` (sync mode, more than one worker).
      step: sync: the open step's gathered pushes.
      closed_parts: the ``parts`` of the step that closed last (taken by :meth:`take_closed_parts`).
    """

    def __init__(self, config: SessionConfig, shard_index: int, step_timeout_s: float):
        self.next_ordinal = 0
        self.arrived: dict[int, Ticket] = {}
        self.applied_sequence: dict[str, int] = {}
        self.sync = config.mode is Mode.SYNC and config.num_workers > 1
        self.step = GatheredStep()
        self.closed_parts: dict[str, list] = {}
        self._noticed_version = 0  # the last sync step logged as waiting for its pushes
        self._config = config
        self._shard_index = shard_index
        self._step_timeout_s = step_timeout_s

    # ----------------------------------------------------------------- idempotency
    def already_applied(self, client_id: str, sequence: int) -> bool:
        """Whether this shard applied the client's push ``sequence`` (or a later one)."""
        last = self.applied_sequence.get(client_id)
        return last is not None and last >= sequence

    # ----------------------------------------------------------------- order
    def arrive(self, ticket: Ticket) -> bool:
        """Files a ticket that reached this shard; False (nothing filed) for a ticket applied
        already (a retry). The caller wakes the waiters when True."""
        if ticket.ordinal < self.next_ordinal:
            return False
        self.arrived[ticket.ordinal] = ticket
        return True

    def reached(self, ticket: Ticket) -> bool:
        """Whether ``ticket`` and every ticket before it are applied here."""
        return self.next_ordinal > ticket.ordinal

    def next_ready(self, awaits_resend) -> Optional[Ticket]:
        """Takes the ticket whose turn it is, if it arrived and ``awaits_resend(ticket)`` is False
        (else it stays filed, to be applied once its push is staged again); None: none to apply."""
        pending = self.arrived.pop(self.next_ordinal, None)
        if pending is not None and awaits_resend(pending):
            self.arrived[pending.ordinal] = pending
            return None
        return pending

    def poll_missing(self, clock) -> None:
        """Asks the clock for the ticket whose turn it is (its carrier may be slow or gone)."""
        missing = clock.ticket(self.next_ordinal)
        if missing is not None:
            self.arrived.setdefault(missing.ordinal, missing)

    def gap_timeout(self) -> Timeout:
        """The error when the ticket whose turn it is did not become applicable in time."""
        waiting = self.arrived.get(self.next_ordinal)  # arrived, but its push is not staged here
        what = (f"ticket {self.next_ordinal} never arrived on shard {self._shard_index}" if waiting is None else
                f"push {waiting.sequence} of client {waiting.client_id!r} (ticket {waiting.ordinal}) was decided "
                f"but is not staged on shard {self._shard_index} (the shard restarted, or the push's own call was "
                f"refused after its ticket was decided) and its client has not sent it again")
        return Timeout(f"session {self._config.name!r}: {what}")

    def advance(self, ticket: Ticket) -> None:
        """``ticket`` is taken for applying: the next one's turn comes."""
        self.next_ordinal = ticket.ordinal + 1

    def applied(self, ticket: Ticket) -> None:
        """``ticket``'s push is applied here (a retry of it applies nothing)."""
        if not ticket.closes_round:
            self.applied_sequence[ticket.client_id] = ticket.sequence

    # ----------------------------------------------------------------- sync steps
    def add(self, grads: dict[str, np.ndarray], ticket: Ticket, without_gradient: frozenset = frozenset()) -> None:
        """Sync: adds ``ticket``'s push to the open step's sum, times the ticket's scale (1 but for
        a late gradient folded in under the SCALE policy); ``grads`` are only read;
        ``without_gradient``: the push's gradient-less tensors (zeros in ``grads``)."""
        step = self.step
        step.with_gradient.update(name for name in grads if name not in without_gradient)
        if self._config.sparse_mean_over_senders:
            step.count_senders(grads)
        step.keep_parts(grads, scaled=ticket.scale != 1.0)
        scale = None if ticket.scale == 1.0 else np.float32(ticket.scale)
        if step.total is None:
            step.total = {name: aligned_empty(g.shape, g.dtype, IO_ALIGNMENT) for name, g in grads.items()}
            for name, g in grads.items():
                np.copyto(step.total[name], g)
                if scale is not None:
                    step.total[name] *= scale
        else:
            for name, g in grads.items():
                step.total[name] += g if scale is None else g * scale
        step.count += 1

    def close_alone(self, grads: dict[str, np.ndarray], ticket: Ticket, without_gradient: frozenset = frozenset()
                    ) -> Optional[tuple[dict[str, np.ndarray], tuple[TicketEntry, ...], frozenset]]:
        """Sync: where ``ticket``'s push opens and closes its step by itself at scale 1 and sends
        no SparseLoCo selection, that push is the step's mean as it is (read, not copied): what
        :meth:`hold_or_close` returns after :meth:`add`, with ``grads`` as the mean, and the next
        step opens. None otherwise (nothing changed: add it and hold or close as usual)."""
        step = self.step
        if (step.total is not None or step.count or not ticket.closes_step or ticket.scale != 1.0
                or getattr(grads, "support", None)):
            return None
        step.keep_parts(grads, scaled=False)
        self.closed_parts = step.parts
        self.step = GatheredStep()
        with_gradient = {name for name in grads if name not in without_gradient}
        return grads, (entry(ticket),), frozenset(grads) - with_gradient

    def hold_or_close(self, ticket: Ticket) -> Optional[tuple[dict[str, np.ndarray], tuple[TicketEntry, ...], frozenset]]:
        """Sync, after :meth:`add` of ``ticket``'s push: None while the step stays open (the push is
        held); else the step's mean gradient, its pushes' entries and the tensors no push had a
        gradient for, and the next step opens."""
        step = self.step
        if not ticket.closes_step:
            step.clients.append(ticket.client_id)
            step.workers.append(worker_of(ticket.client_id))
            step.tickets.append(entry(ticket))
            return None
        mean = step.mean()
        self.closed_parts = step.parts
        self.step = GatheredStep()
        return mean, tuple(step.tickets) + (entry(ticket),), frozenset(mean) - step.with_gradient

    def take_closed_parts(self) -> dict[str, list]:
        """The sparse parts of the step that just closed (see :attr:`GatheredStep.parts`), once."""
        parts, self.closed_parts = self.closed_parts, {}
        return parts

    @property
    def half_gathered(self) -> bool:
        """A sync step holds some of its pushes (the shard is not at a step boundary)."""
        return self.step.total is not None

    def step_timeout_message(self, ticket: Ticket, waited_s: float) -> str:
        """Why ``ticket``'s step did not complete: in sync mode, which pushes of it arrived (this
        shard applied every ticket up to ``ticket``, so it knows them)."""
        message = (f"session {self._config.name!r}: step {ticket.target_version} did not complete within "
                   f"{waited_s:.1f} s")
        if not self.sync:
            return message
        workers = self._config.num_workers
        arrived = self.step.clients
        return (f"{message}: {len(arrived)} of num_workers={workers} pushes arrived for the step (from clients "
                f"{', '.join(repr(c) for c in arrived)}); waiting for {workers - len(arrived)} more "
                f"(step_timeout_s={self._step_timeout_s:g})")

    def wait_until(self, ticket: Ticket, started: float, deadline: float, notice_s: float) -> float:
        """When a wait for ``ticket``'s step (begun at ``started``) ends: its deadline, or first,
        ``notice_s`` after it began, the time to say that a sync step is still gathering its
        pushes (:meth:`notice_waiting`, once per step)."""
        if self.sync and self._noticed_version < ticket.target_version:
            return min(deadline, started + notice_s)
        return deadline

    def notice_waiting(self, ticket: Ticket, waited_s: float) -> None:
        """A sync step has gathered only some of its pushes for a while: says so once (which
        clients pushed, how many are missing, how long), long before its timeout."""
        if self._noticed_version < ticket.target_version:
            self._noticed_version = ticket.target_version
            _log.warning("event=sync_step_waiting %s", self.waiting_fields(ticket, waited_s))

    def waiting_fields(self, ticket: Ticket, waited_s: float) -> str:
        """The ``key=value`` log fields of ``ticket``'s sync step, still gathering its pushes after
        ``waited_s`` seconds: which clients pushed and how many of ``num_workers``."""
        arrived = self.step.clients
        return (f"session={log_value(self._config.name)} shard={self._shard_index} version={ticket.target_version} "
                f"waited_s={waited_s:.1f} arrived={len(arrived)} num_workers={self._config.num_workers} "
                f"clients={log_value(','.join(arrived))} step_timeout_s={self._step_timeout_s:g}")

    # ----------------------------------------------------------------- durability
    def progress(self, version: int, hyper: dict, state_chunks: int = 0) -> ShardProgress:
        """The bookkeeping a checkpoint at ``version`` saves beside the tensors (``hyper``: the
        hyperparameters of the next step; ``state_chunks``: the optimizer state's layout)."""
        return ShardProgress(version, self.next_ordinal, dict(self.applied_sequence), hyper, state_chunks)

    def restore(self, progress: ShardProgress) -> None:
        """Recovery: continues from ``progress`` (a checkpoint's, after its log's replay)."""
        self.next_ordinal = progress.next_ordinal
        self.applied_sequence = dict(progress.applied_sequence)
