"""The session clock's ordering state: versions, tickets, elastic rounds, the history, checkpoint timing.

:class:`ClockState` decides each push the first time it is asked (via
:func:`optserve.server.domain.clock.staleness.decide`, or the elastic round rules of
:mod:`optserve.server.domain.clock.rounds`) and answers every later ask for the same
``(client_id, sequence)`` with the same :class:`~optserve.server.domain.clock.clock_records.Ticket`, so
all shards agree on acceptance, staleness and order. Accepted pushes get consecutive ordinals.
It also keeps the record of each version (:mod:`~optserve.server.domain.clock.version_history`), marks
checkpoint-due steps and keeps the counters of :class:`ClockStatus`; its durable part round-trips
through :meth:`ClockState.to_json` / :meth:`ClockState.restore`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Optional

from optserve.server.domain.clock.clock_records import MAX_WORKERS_REPORTED, ROUND_CLOSER, ClockStatus, Ticket
from optserve.server.domain.clock.hyperparam_book import HyperparamBook
from optserve.server.domain.clock.rounds import Rounds
from optserve.server.domain.clock.staleness import Decision, decide
from optserve.server.domain.clock.ticket_book import TicketBook
from optserve.server.domain.clock.version_history import OpenStep, VersionHistory
from optserve.server.domain.config import LatePolicy, Mode, SessionConfig, StalenessPolicy, worker_of
from optserve.server.domain.durability import CheckpointPolicy
from optserve.server.domain.errors import FutureBase, InvalidArgument, Late, OptservError, Stale

_MAX_WORKERS_KEPT = 4096  # workers whose last push a clock remembers (the oldest are forgotten)


@dataclasses.dataclass
class ClockState:
    """One session's ordering state: its version, the ticket book (each client's latest push and
    the recent tickets by ordinal), the counters of its status, the elastic membership and rounds
    (:class:`~optserve.server.domain.clock.rounds.Rounds`), the record of each version
    (:class:`~optserve.server.domain.clock.version_history.VersionHistory`) and when a checkpoint is next due.

    Not thread-safe: the home clock (:class:`~optserve.server.domain.clock.home_clock.HomeClock`) calls it
    under its lock. Build it for a session with :func:`clock_state_for`.
    """

    mode: Mode
    num_workers: int
    max_staleness: Optional[int]
    policy: StalenessPolicy
    version: int = 0
    next_ordinal: int = 0
    step_clients: set = dataclasses.field(default_factory=set)
    last: dict = dataclasses.field(default_factory=dict)  # client_id -> (sequence, Ticket | OptservError)
    tickets: TicketBook = dataclasses.field(default_factory=TicketBook)  # the latest tickets by ordinal
    accepted: int = 0
    stale: int = 0
    staleness_counts: dict = dataclasses.field(default_factory=dict)  # staleness -> accepted pushes
    last_activity_unix_s: float = 0.0
    worker_pushes: dict = dataclasses.field(default_factory=dict)  # worker id -> its last push (unix s), oldest first
    checkpoints: Optional[CheckpointPolicy] = None  # durable sessions: when a step is checkpoint-due
    checkpoint_version: int = 0  # the version of the latest checkpoint-due step (0: initial values)
    checkpoint_time: float = dataclasses.field(default_factory=time.monotonic)
    rounds: Optional[Rounds] = None  # elastic sync sessions: membership, round rules, the open round
    late: LatePolicy = LatePolicy.DROP
    hyper: HyperparamBook = dataclasses.field(default_factory=HyperparamBook)  # hyperparameters set, in ticket order
    history: VersionHistory = dataclasses.field(default_factory=VersionHistory)  # each version's record
    open_step: OpenStep = dataclasses.field(default_factory=OpenStep)  # plain sync / async: the open step's pushes

    def commit(self, client_id: str, sequence: int, base_version: int) -> Ticket:
        """Returns the push's ticket, deciding it on the first call; raises the refusal otherwise."""
        previous = self.last.get(client_id)
        if previous is not None and previous[0] == sequence:
            if isinstance(previous[1], OptservError):
                raise previous[1]
            return previous[1]
        if previous is not None and previous[0] > sequence:
            raise Stale(f"push {sequence} of client {client_id!r} is older than its push {previous[0]}; "
                        f"current version is {self.version}", self.version)
        self.last_activity_unix_s = time.time()
        closed_by = "num_workers"
        try:
            if self.rounds is not None:
                decision, closed_by = self._decide_elastic(client_id, base_version)
            else:
                decision = decide(
                    mode=self.mode, version=self.version, base_version=base_version, num_workers=self.num_workers,
                    pushes_in_step=len(self.step_clients), client_in_step=client_id in self.step_clients,
                    max_staleness=self.max_staleness, policy=self.policy, client_id=client_id,
                )
        except OptservError as exc:
            self.stale += isinstance(exc, Stale) and not isinstance(exc, Late)
            if not isinstance(exc, FutureBase):  # kept for the push's retries; a corrected base is decided afresh
                self.last[client_id] = (sequence, exc)
            raise
        ticket = Ticket(self.next_ordinal, client_id, sequence, decision.staleness, decision.scale,
                        decision.closes_step, self.version + 1, decision.closes_step and self._checkpoint_due(),
                        self.hyper.take(self.version + 1))
        self.record(ticket, closed_by)
        self._note_worker(worker_of(client_id), self.last_activity_unix_s)  # an accepted push
        return ticket

    def _note_worker(self, worker: str, unix_s: float) -> None:
        """Remembers ``worker``'s latest push (the oldest of too many workers is forgotten)."""
        self.worker_pushes.pop(worker, None)
        self.worker_pushes[worker] = unix_s
        if len(self.worker_pushes) > _MAX_WORKERS_KEPT:
            del self.worker_pushes[next(iter(self.worker_pushes))]

    def _checkpoint_due(self) -> bool:
        """Durable sessions: the step being closed now is due for a checkpoint."""
        return self.checkpoints is not None and self.checkpoints.due(
            self.version + 1 - self.checkpoint_version, time.monotonic() - self.checkpoint_time)

    def _decide_elastic(self, client_id: str, base_version: int) -> tuple[Decision, Optional[str]]:
        """Elastic sync: decides a push into the open round (see :mod:`~optserve.server.domain.clock.rounds`);
        returns the decision and why it commits the round (None: it stays open)."""
        worker, rounds, now = worker_of(client_id), self.rounds, time.monotonic()
        if base_version > self.version:
            raise FutureBase(f"push from worker {worker!r} has base_version {base_version} > current version "
                             f"{self.version}", self.version)
        rounds.expire(now)
        rounds.touch(worker, now)
        staleness = self.version - base_version
        if staleness and self.late is LatePolicy.DROP:
            rounds.dropped_late(worker)
            raise Late(f"late gradient: worker {worker!r} computed it from version {base_version}, whose round "
                       f"already committed (current version {self.version}); dropped (late='drop'): pull the current "
                       f"parameters and go on", self.version)
        if staleness and self.max_staleness is not None and staleness > self.max_staleness:
            raise Stale(f"late gradient of worker {worker!r} has staleness {staleness} > max_staleness "
                        f"{self.max_staleness}; current version is {self.version}", self.version)
        if rounds.in_round(worker):
            raise InvalidArgument(f"worker {worker!r} already pushed for version {self.version}")
        scale = 1.0 / (1.0 + staleness) if staleness and self.policy is StalenessPolicy.SCALE else 1.0
        closed_by = rounds.closes_with(worker)
        return Decision(staleness, scale, closed_by is not None), closed_by

    def close_due(self, now: float) -> Optional[Ticket]:
        """Elastic sync: a push-less ticket committing the open round, when it is due now (its
        straggler deadline passed, or members left and everyone expected pushed); else None."""
        if self.rounds is None:
            return None
        self.rounds.expire(now)
        closed_by = self.rounds.due(now)
        if closed_by is None:
            return None
        ticket = Ticket(self.next_ordinal, ROUND_CLOSER, 0, 0, 1.0, True, self.version + 1, self._checkpoint_due(),
                        self.hyper.take(self.version + 1))
        self.record(ticket, closed_by)
        return ticket

    def record(self, ticket: Ticket, closed_by: str = "replayed") -> None:
        """Books a decided ticket (a fresh decision, or one replayed from the ticket journal);
        ``closed_by``: why an elastic round it closes committed."""
        self.tickets.put(ticket)  # first: a ticket it cannot keep changes nothing
        self.next_ordinal = ticket.ordinal + 1
        if ticket.hyperparams:  # a fresh ticket's change is booked already (a replayed one's is not)
            self.hyper.applied(ticket.target_version, json.loads(ticket.hyperparams))
        self._add_to_step(ticket, closed_by)
        if ticket.checkpoint:
            self.checkpoint_version, self.checkpoint_time = ticket.target_version, time.monotonic()
        if ticket.closes_round:
            self.version += 1
            return
        self.accepted += 1
        self.staleness_counts[ticket.staleness] = self.staleness_counts.get(ticket.staleness, 0) + 1
        if ticket.closes_step:
            self.version += 1
            self.step_clients.clear()
        else:
            self.step_clients.add(ticket.client_id)
        self.last[ticket.client_id] = (ticket.sequence, ticket)

    def _add_to_step(self, ticket: Ticket, closed_by: str) -> None:
        """Adds ``ticket``'s push to the open step; a ticket closing it files the step's record."""
        now = time.monotonic()
        if self.rounds is not None:
            if not ticket.closes_round:
                self.rounds.add(ticket, now)
            if ticket.closes_step:
                self.history.keep(self.rounds.commit(ticket.target_version, closed_by, now))
            return
        self.open_step.add(ticket, now)
        if ticket.closes_step:  # plain sync: the K-th push; async: every push
            self.history.keep(self.open_step.close(ticket.target_version,
                                                   "num_workers" if self.mode is Mode.SYNC else "push", now))

    @property
    def latest_record_journaled(self) -> bool:
        """The record just filed holds what its tickets do not (an elastic round's closing reason
        and duration, a plain sync round's duration), so durable sessions journal it beside the
        ticket that closed it; an async record, or a sync step of one push (duration 0), is
        rebuilt exactly from its ticket."""
        latest = self.history.latest
        return self.rounds is not None or (self.mode is Mode.SYNC and latest is not None and len(latest.clients) > 1)

    def truncate(self, version: int, next_ordinal: int) -> int:
        """Forgets every ticket deciding a version after ``version`` (a restore brought the shards
        back to it) and continues at ``next_ordinal``; returns how many tickets were forgotten.
        A client whose latest ticket is forgotten is answered from its previous one still kept
        (or decided afresh)."""
        dropped = self.tickets.forget_deciding_after(version)
        self.accepted -= sum(not t.closes_round for t in dropped)
        self.version, self.next_ordinal = min(self.version, version), next_ordinal
        self.step_clients = set()  # the open step was after ``version``: its tickets are gone
        if self.rounds is not None:
            self.rounds.forget_after(version)
        self.open_step = OpenStep()
        self.history.forget_after(version)
        self.hyper.forget_after(version)
        newest_kept = {t.client_id: t for t in self.tickets}  # in ordinal order: each client's newest wins
        for client, (_, latest) in list(self.last.items()):
            if isinstance(latest, Ticket) and latest.target_version > version:
                newest = newest_kept.get(client)
                if newest is not None:
                    self.last[client] = (newest.sequence, newest)
                else:
                    del self.last[client]
        return len(dropped)

    def to_json(self, with_history: bool = True) -> dict:
        """The clock's durable state (refusals remembered for retries are left out: a retried
        refused push is decided afresh); ``with_history=False``: without its ``"rounds"`` (the
        caller adds ``history.view(0).to_json()``)."""
        state = {"version": self.version, "next_ordinal": self.next_ordinal, "step_clients": sorted(self.step_clients),
                "last": {c: t.to_json() for c, (_, t) in self.last.items() if isinstance(t, Ticket)},
                "tickets": [t.to_json() for t in self.tickets], "accepted": self.accepted,
                "stale": self.stale, "staleness_counts": {str(k): v for k, v in self.staleness_counts.items()},
                "checkpoint_version": self.checkpoint_version, "hyper": self.hyper.to_json()}
        if with_history:
            state["rounds"] = self.history.to_json()
        return state

    def restore(self, data: dict) -> None:
        """Takes back the state of :meth:`to_json` (the checkpoint clock restarts now); the open
        step is rebuilt from the tickets deciding the next version."""
        self.version, self.next_ordinal = int(data["version"]), int(data["next_ordinal"])
        self.step_clients = set(data["step_clients"])
        self.last = {c: (t.sequence, t) for c, t in ((c, Ticket.from_json(v)) for c, v in data["last"].items())}
        self.tickets.restore(map(Ticket.from_json, data["tickets"]))
        self.accepted, self.stale = int(data["accepted"]), int(data["stale"])
        self.staleness_counts = {int(k): int(v) for k, v in data["staleness_counts"].items()}
        self.checkpoint_version, self.checkpoint_time = int(data["checkpoint_version"]), time.monotonic()
        self.hyper.restore(data.get("hyper"))
        self.history.restore(data.get("rounds", []))
        if self.rounds is not None:
            self.rounds.forget_after(self.version)
        self.open_step = OpenStep()
        for ticket in self.tickets:
            if ticket.target_version > self.version and not ticket.closes_step:  # decided into the open step
                if self.rounds is not None:
                    self.rounds.add(ticket, time.monotonic())
                else:
                    self.open_step.add(ticket, time.monotonic())

    def status(self) -> ClockStatus:
        """The counters of :class:`ClockStatus` (the elastic ones from :class:`Rounds`)."""
        return ClockStatus(self.version, self.accepted, self.stale, _median(self.staleness_counts),
                           max(self.staleness_counts, default=0), self.last_activity_unix_s,
                           self.rounds.status() if self.rounds is not None else None,
                           tuple(reversed(list(self.worker_pushes.items())[-MAX_WORKERS_REPORTED:])))


def _median(counts: dict) -> int:
    """The median of a histogram ``value -> count`` (the lower one of an even count; 0 if empty)."""
    total, seen = sum(counts.values()), 0
    for value in sorted(counts):
        seen += counts[value]
        if 2 * seen >= total:
            return value
    return 0


def clock_state_for(config: SessionConfig, checkpoints: Optional[CheckpointPolicy] = None) -> ClockState:
    """A fresh clock state for ``config`` (elastic sync sessions get their :class:`Rounds`)."""
    return ClockState(config.mode, config.num_workers, config.max_staleness, config.staleness_policy,
                      checkpoints=checkpoints, rounds=Rounds(config) if config.is_elastic else None,
                      late=config.elastic.late)
