"""The session clock: where each session's version lives, and where pushes are ordered.

A shard that receives a commit asks the session's clock for the push's *ticket*. The first
ask decides (via :func:`optserve.server.domain.staleness.decide`); every later ask for the same
(client_id, sequence) gets the same ticket, so all shards agree on acceptance, staleness and
order. Accepted pushes get consecutive ordinals; shards apply tickets strictly in ordinal order,
which keeps their states consistent under concurrent clients. The clock also sums
cross-shard statistics.

Where the clock lives: in the session's *home* shard, the first shard of its shard map, as a
:class:`LocalClock`. The home shard calls it in process; the other shards of the session reach
it through :class:`~optserve.server.wire.clock_service.PeerClock` (a small gRPC endpoint in the home
shard's process). So a single-shard session never leaves its process, and a step of a
multi-shard session costs each non-home shard one short round trip.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Optional, Sequence

from optserve.protos.status_records import ElasticStatus, RoundRecord
from optserve.server.domain.config import LatePolicy, Mode, StalenessPolicy, worker_of
from optserve.server.domain.durability import CheckpointPolicy
from optserve.server.domain.errors import InvalidArgument, Late, OptservError, PeerRefused, Stale, Timeout, Unavailable
from optserve.server.domain.rounds import Rounds
from optserve.server.domain.staleness import Decision, decide

_log = logging.getLogger(__name__)

_KEEP_TICKETS = 4096
_KEEP_SUMS = 64  # durable sessions: cross-shard sums remembered (by step) for shards that ask again
ROUND_CLOSER = ""  # client_id of a ticket that commits an elastic round without a push (see Rounds.due)


@dataclasses.dataclass(frozen=True)
class Ticket:
    """An accepted push, in the order every shard applies it.

    Attributes:
      ordinal: 0, 1, 2, ... per session.
      client_id / sequence: the push.
      staleness / scale / closes_step: see :class:`optserve.server.domain.staleness.Decision`.
      target_version: the version of the step this push belongs to (after it is applied).
        A ticket whose ``client_id`` is :data:`ROUND_CLOSER` carries no push: it commits an
        elastic round with the pushes decided into it so far.
      checkpoint: durable sessions: every shard checkpoints right after applying this step
        (set on the ticket that closes a step, by the session's checkpoint policy).
    """

    ordinal: int
    client_id: str
    sequence: int
    staleness: int
    scale: float
    closes_step: bool
    target_version: int
    checkpoint: bool = False

    def to_json(self) -> list:
        return [self.ordinal, self.client_id, self.sequence, self.staleness, self.scale, self.closes_step,
                self.target_version, self.checkpoint]

    @classmethod
    def from_json(cls, data: list) -> "Ticket":
        o, c, s, st, sc, cl, tv, ck = data
        return cls(int(o), str(c), int(s), int(st), float(sc), bool(cl), int(tv), bool(ck))

    @property
    def closes_round(self) -> bool:
        """A push-less ticket that commits an elastic round."""
        return self.client_id == ROUND_CLOSER


@dataclasses.dataclass(frozen=True)
class ClockStatus:
    """A session clock's counters: ``version`` (steps decided), ``accepted`` pushes, ``stale``
    refusals; the accepted pushes' staleness (median and largest, versions); and when the clock
    last decided a push (``last_activity_unix_s``, 0: never); ``workers``: (worker id, when it
    last pushed), the most recent first, at most :data:`MAX_WORKERS_REPORTED`."""

    version: int
    accepted: int
    stale: int
    staleness_p50: int = 0
    staleness_max: int = 0
    last_activity_unix_s: float = 0.0
    elastic: Optional[ElasticStatus] = None
    workers: tuple = ()


MAX_WORKERS_REPORTED = 256  # workers a session's status lists (the most recent pushers)
_MAX_WORKERS_KEPT = 4096  # workers whose last push a clock remembers (the oldest are forgotten)


@dataclasses.dataclass
class SessionClock:
    """One session's version and ticket book (not thread-safe; callers serialise)."""

    mode: Mode
    num_workers: int
    max_staleness: Optional[int]
    policy: StalenessPolicy
    version: int = 0
    next_ordinal: int = 0
    step_clients: set = dataclasses.field(default_factory=set)
    last: dict = dataclasses.field(default_factory=dict)  # client_id -> (sequence, Ticket | OptservError)
    tickets: dict = dataclasses.field(default_factory=dict)  # ordinal -> Ticket
    accepted: int = 0
    stale: int = 0
    staleness_counts: dict = dataclasses.field(default_factory=dict)  # staleness -> accepted pushes
    last_activity_unix_s: float = 0.0
    worker_pushes: dict = dataclasses.field(default_factory=dict)  # worker id -> its last push (unix s), oldest first
    checkpoints: Optional[CheckpointPolicy] = None  # durable sessions: when a step is checkpoint-due
    checkpoint_version: int = 0  # the version of the latest checkpoint-due step (0: initial values)
    checkpoint_time: float = dataclasses.field(default_factory=time.monotonic)
    rounds: Optional[Rounds] = None  # elastic sync sessions: membership, round rules and history
    late: LatePolicy = LatePolicy.DROP

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
            self.last[client_id] = (sequence, exc)
            raise
        ticket = Ticket(self.next_ordinal, client_id, sequence, decision.staleness, decision.scale,
                        decision.closes_step, self.version + 1, decision.closes_step and self._checkpoint_due())
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
        """Elastic sync: decides a push into the open round (see :mod:`~optserve.server.domain.rounds`);
        returns the decision and why it commits the round (None: it stays open)."""
        worker, rounds, now = worker_of(client_id), self.rounds, time.monotonic()
        if base_version > self.version:
            raise InvalidArgument(f"push from worker {worker!r} has base_version {base_version} > current version "
                                  f"{self.version}")
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
        ticket = Ticket(self.next_ordinal, ROUND_CLOSER, 0, 0, 1.0, True, self.version + 1, self._checkpoint_due())
        self.record(ticket, closed_by)
        return ticket

    def record(self, ticket: Ticket, closed_by: str = "replayed") -> None:
        """Books a decided ticket (a fresh decision, or one replayed from the ticket journal)."""
        self.next_ordinal = ticket.ordinal + 1
        self.tickets[ticket.ordinal] = ticket
        self.tickets.pop(ticket.ordinal - _KEEP_TICKETS, None)
        if self.rounds is not None:
            if not ticket.closes_round:
                self.rounds.add(worker_of(ticket.client_id), ticket.scale, time.monotonic())
            if ticket.closes_step:
                self.rounds.commit(ticket.target_version, closed_by, time.monotonic())
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

    def truncate(self, version: int, next_ordinal: int) -> int:
        """Forgets every ticket deciding a version after ``version`` (a restore brought the shards
        back to it) and continues at ``next_ordinal``; returns how many tickets were forgotten.
        A client whose latest ticket is forgotten is answered from its previous one still kept
        (or decided afresh)."""
        dropped = [t for t in self.tickets.values() if t.target_version > version]
        for ticket in dropped:
            del self.tickets[ticket.ordinal]
        self.accepted -= sum(not t.closes_round for t in dropped)
        self.version, self.next_ordinal = min(self.version, version), next_ordinal
        self.step_clients = set()  # the open step was after ``version``: its tickets are gone
        if self.rounds is not None:
            self.rounds.forget_after(version)
        for client, (_, latest) in list(self.last.items()):
            if isinstance(latest, Ticket) and latest.target_version > version:
                kept = [t for t in self.tickets.values() if t.client_id == client]
                if kept:
                    newest = max(kept, key=lambda t: t.ordinal)
                    self.last[client] = (newest.sequence, newest)
                else:
                    del self.last[client]
        return len(dropped)

    def to_json(self) -> dict:
        """The clock's durable state (refusals remembered for retries are left out: a retried
        refused push is decided afresh)."""
        return {"version": self.version, "next_ordinal": self.next_ordinal, "step_clients": sorted(self.step_clients),
                "last": {c: t.to_json() for c, (_, t) in self.last.items() if isinstance(t, Ticket)},
                "tickets": [t.to_json() for t in self.tickets.values()], "accepted": self.accepted,
                "stale": self.stale, "staleness_counts": {str(k): v for k, v in self.staleness_counts.items()},
                "checkpoint_version": self.checkpoint_version,
                "rounds": [r.to_json() for r in self.rounds.history] if self.rounds is not None else []}

    def restore(self, data: dict) -> None:
        """Takes back the state of :meth:`to_json` (the checkpoint clock restarts now)."""
        self.version, self.next_ordinal = int(data["version"]), int(data["next_ordinal"])
        self.step_clients = set(data["step_clients"])
        self.last = {c: (t.sequence, t) for c, t in ((c, Ticket.from_json(v)) for c, v in data["last"].items())}
        self.tickets = {t.ordinal: t for t in map(Ticket.from_json, data["tickets"])}
        self.accepted, self.stale = int(data["accepted"]), int(data["stale"])
        self.staleness_counts = {int(k): int(v) for k, v in data["staleness_counts"].items()}
        self.checkpoint_version, self.checkpoint_time = int(data["checkpoint_version"]), time.monotonic()
        if self.rounds is not None:
            self.rounds.history = [RoundRecord.from_json(r) for r in data.get("rounds", [])]

    def status(self) -> ClockStatus:
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


def new_session_clock(config, checkpoints: Optional[CheckpointPolicy] = None) -> SessionClock:
    return SessionClock(config.mode, config.num_workers, config.max_staleness, config.staleness_policy,
                        checkpoints=checkpoints, rounds=Rounds(config) if config.is_elastic else None,
                        late=config.elastic.late)


class _VoteRound:
    """The votes on one push: shard index -> staged?, and the outcome once decided."""

    __slots__ = ("votes", "outcome", "taken", "started", "retried")

    def __init__(self):
        self.votes: dict[int, bool] = {}
        self.outcome = None  # Ticket | OptservError
        self.taken = 0
        self.started = time.monotonic()
        # Decided without a vote the client cannot have: a shard that never staged in time or is
        # down. The client retries the push, and its new votes must meet in a fresh round (a
        # missing shard's next vote would otherwise take this round's outcome, and the others'
        # votes open yet another round that waits in vain: every retry failing the same way).
        self.retried = False


_STALE_ROUND_S = 600.0  # a decided round some shard never voted in is forgotten after this long


class LocalClock:
    """A session's clock, in the home shard's process: thread-safe, for ``participants`` shards.

    Args:
      config: the session (mode, num_workers, staleness options).
      participants: shards holding tensors of the session; votes and sums wait for all of them.
      reduce_timeout_s: longest wait for the other shards' parts of a cross-shard sum.
      checkpoints: durable sessions: the checkpoint policy (marks checkpoint-due steps).
      journal: durable sessions: called under the clock's lock with each new ticket's JSON
        (``Ticket.to_json``) before any shard sees it, and with ``{"sum": key, "total": total}``
        for each cross-shard sum before any shard gets it: the journal a restarted clock replays.
    """

    def __init__(self, config, participants: int = 1, reduce_timeout_s: float = 300.0,
                 checkpoints: Optional[CheckpointPolicy] = None, journal: Optional[Callable[[Any], None]] = None):
        self._clock = new_session_clock(config, checkpoints)
        self._journal = journal  # durable sessions: each new ticket is written here before it is handed out
        self._participants = participants
        self._reduce_timeout = reduce_timeout_s
        self._cond = threading.Condition()
        self._votes: dict[tuple[str, int], _VoteRound] = {}
        self._sums: dict[int, dict] = {}
        self._totals: dict[int, float] = {}  # durable sessions: recent sums, answered again after a restart
        self._abandoned: Optional[OptservError] = None
        self._down: dict[int, OptservError] = {}  # shard index -> why (restarting), see peer_down

    def abandon(self, error: OptservError) -> None:
        """The session ended (closed, or a shard of it died): pending and later votes and sums
        fail with ``error``."""
        with self._cond:
            self._abandoned = error
            for round_ in self._votes.values():
                if round_.outcome is None:
                    round_.outcome = error
            self._cond.notify_all()

    @property
    def participants(self) -> int:
        return self._participants

    def commit(self, client_id: str, sequence: int, base_version: int) -> Ticket:
        with self._cond:
            return self._commit_locked(client_id, sequence, base_version)

    def _commit_locked(self, client_id: str, sequence: int, base_version: int) -> Ticket:
        fresh_from = self._clock.next_ordinal
        ticket = self._clock.commit(client_id, sequence, base_version)
        if ticket.ordinal >= fresh_from:
            try:
                self._write_journal(ticket)
            except OSError as exc:  # decided all the same: a restore rebuilds it from the shards' step logs
                raise Unavailable(f"push {sequence} of client {client_id!r}: the ticket journal could not be "
                                  f"written ({exc}); retry") from None
        return ticket

    def _write_journal(self, ticket: Ticket) -> None:
        """Journals a fresh ticket, and the record of the elastic round it commits (lock held)."""
        if self._journal is None:
            return
        self._journal(ticket.to_json())
        if ticket.closes_step and self._clock.rounds is not None:
            self._journal({"round": self._clock.rounds.history[-1].to_json()})

    def _close_round_if_due(self) -> None:
        """Elastic sync: commits the open round without a push when it is due (lock held); the
        shards find the closing ticket when they next ask for the ticket whose turn it is."""
        ticket = self._clock.close_due(time.monotonic())
        if ticket is None:
            return
        try:
            self._write_journal(ticket)
        except OSError as exc:  # a restore rebuilds it from the shards' step logs
            _log.error("event=round_not_journaled version=%d error=%s", ticket.target_version, exc)
        self._cond.notify_all()

    def membership(self, worker: str, action: str) -> tuple[int, list[str], float]:
        """Elastic sync: ``action`` "join" / "renew" / "leave" for ``worker``; returns the version,
        the members and the lease (seconds).

        Raises:
          FailedPrecondition-like InvalidArgument: the session is not elastic.
          ResourceExhausted: joining past ``max_workers``.
        """
        with self._cond:
            rounds = self._clock.rounds
            if rounds is None:
                raise InvalidArgument("membership is for elastic sync sessions (min_workers < num_workers or "
                                      "max_workers > num_workers)")
            if action == "leave":
                rounds.leave(worker)
            else:
                rounds.expire(time.monotonic())
                rounds.touch(worker, time.monotonic())
            self._close_round_if_due()
            return self._clock.version, rounds.members(), rounds.lease_s

    def disconnected(self, worker: str) -> None:
        """Elastic sync: ``worker``'s connection to the home shard dropped: it leaves now."""
        with self._cond:
            if self._clock.rounds is not None and self._clock.rounds.leave(worker, disconnected=True):
                _log.info("event=member_disconnected worker=%s", worker)
                self._close_round_if_due()

    def history(self, since: int) -> list[RoundRecord]:
        """Elastic sync: the records of the versions after ``since`` (empty for other sessions)."""
        with self._cond:
            rounds = self._clock.rounds
            return rounds.since(since) if rounds is not None else []

    def restore(self, state: Optional[dict], journal: list, replayed: Sequence[Ticket] = (),
                settle_at: Optional[tuple[int, int]] = None) -> None:
        """Durable sessions, at recovery: the clock state of the latest checkpoint (None: none),
        then the journal entries written after it, with ``replayed`` (the tickets of the steps the
        home shard's log replayed) filling what the journal lacks (a journal segment lost or cut).
        ``settle_at=(version, next_ordinal)``: every shard of the session was restored to
        ``version``, so tickets deciding later versions are forgotten (their pushes were never
        acknowledged: the clients' retries are decided afresh)."""
        with self._cond:
            if state is not None:
                self._clock.restore(state)
                self._totals.update({int(k): float(v) for k, v in state.get("sums", {}).items()})
            tickets, records = {}, []
            for entry in journal:
                if isinstance(entry, dict) and "round" in entry:
                    records.append(RoundRecord.from_json(entry["round"]))
                    continue
                if isinstance(entry, dict):
                    self._totals[int(entry["sum"])] = float(entry["total"])
                    continue
                ticket = Ticket.from_json(entry)
                tickets[ticket.ordinal] = ticket
            for ticket in replayed:
                tickets.setdefault(ticket.ordinal, ticket)
            for ordinal in sorted(tickets):
                if ordinal >= self._clock.next_ordinal:
                    self._clock.record(tickets[ordinal])
            if self._clock.rounds is not None:  # the journal's records are exact (replayed ones lack timings)
                for record in records:
                    if record.version <= self._clock.version:
                        self._clock.rounds.keep(record)
            if settle_at is not None:
                self._clock.truncate(*settle_at)

    def durable_state(self, rotate: Callable[[], None]) -> dict:
        """The clock's state for a checkpoint, with ``rotate()`` (start a new journal segment)
        run under the same lock: the state covers exactly what was journaled before it."""
        with self._cond:
            state = self._clock.to_json()
            state["sums"] = {str(k): v for k, v in self._totals.items()}
            rotate()
            return state

    def peer_down(self, shard_index: int, error: OptservError) -> None:
        """Shard ``shard_index`` died (and is being restarted): votes waiting for it end now with
        ``error``, and so do later ones until :meth:`peer_up`, instead of at their timeout."""
        with self._cond:
            self._down[shard_index] = error
            for round_ in self._votes.values():
                if round_.outcome is None and shard_index not in round_.votes:
                    round_.outcome, round_.retried = error, True
            self._cond.notify_all()

    def peer_up(self, shard_index: int) -> None:
        """Shard ``shard_index`` serves the session again."""
        with self._cond:
            self._down.pop(shard_index, None)

    def ticket(self, ordinal: int) -> Optional[Ticket]:
        """The decided ticket ``ordinal`` (None: not decided yet). Shards waiting in an elastic
        round ask for its next ticket while they wait: the round commits here when due."""
        with self._cond:
            self._close_round_if_due()
            return self._clock.tickets.get(ordinal)

    def vote(self, client_id: str, sequence: int, base_version: int, shard_index: int, staged: bool,
             timeout_s: float) -> Optional[Ticket]:
        """Auto-commit: one shard's stage outcome; returns the ticket once every shard staged.

        The push is decided (:meth:`SessionClock.commit`) only when all participants voted
        ``staged=True``; one refusal, or a shard that does not vote within ``timeout_s``, refuses
        it everywhere (:class:`PeerRefused`). Every voter gets the same outcome, also one that votes
        after the refusal; a refusing voter gets None at once (it reports its own error). A shard
        voting again on a decided push is a retry: the push is decided afresh.
        """
        if self._participants == 1:  # the only shard decides alone
            return self.commit(client_id, sequence, base_version) if staged else None
        key = (client_id, sequence)
        with self._cond:
            if self._abandoned is not None:
                raise self._abandoned
            round_ = self._votes.get(key)
            if round_ is None or (round_.outcome is not None and shard_index in round_.votes):
                # the first vote, or a shard voting again on a decided push: a retry, decided afresh
                round_ = self._votes[key] = _VoteRound()
                self._forget_stale_rounds()
            round_.votes[shard_index] = staged
            if round_.outcome is None:
                down = next((error for index, error in self._down.items() if index not in round_.votes), None)
                if down is not None:
                    round_.outcome, round_.retried = down, True
                    self._cond.notify_all()
                elif not staged:
                    round_.outcome = PeerRefused(
                        f"push {sequence} of client {client_id!r} was refused by shard {shard_index}; applied on no shard")
                elif len(round_.votes) >= self._participants:
                    try:
                        round_.outcome = self._commit_locked(client_id, sequence, base_version)
                    except OptservError as exc:
                        round_.outcome = exc
                if round_.outcome is not None:
                    self._cond.notify_all()
            deadline = time.monotonic() + timeout_s
            while round_.outcome is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(self._participants)) - set(round_.votes))
                    round_.outcome = PeerRefused(
                        f"push {sequence} of client {client_id!r} was not staged on every shard within "
                        f"{timeout_s:.0f} s (shards {missing} did not vote); applied on no shard")
                    round_.retried = True
                    self._cond.notify_all()
                    break
                self._cond.wait(remaining)
            round_.taken += 1
            # Kept until every shard voted: a refusal that arrives before a peer's vote must still
            # answer that vote (the peer would otherwise wait for the vote timeout). Not a round
            # its client retries: a late vote of it starts a round of its own, and is refused there.
            if (round_.taken >= self._participants or round_.retried) and self._votes.get(key) is round_:
                del self._votes[key]
            outcome = round_.outcome
        if not staged:
            return None
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def _forget_stale_rounds(self) -> None:
        """Drops decided rounds that some shard never voted in (its client vanished), once old."""
        if len(self._votes) < 256:
            return
        now = time.monotonic()
        for key in [k for k, r in self._votes.items() if r.outcome is not None and now - r.started > _STALE_ROUND_S]:
            del self._votes[key]

    def reduce_sum(self, key: int, shard_index: int, value: float) -> float:
        """Sums ``value`` over the participants for step ``key``; returns once all arrived.

        The sum is taken in shard-index order, so every shard gets the same float.

        Raises:
          Timeout: a shard's part did not arrive within ``reduce_timeout_s``.
        """
        if self._participants == 1:
            return value
        with self._cond:
            if key in self._totals:  # decided before a restart (of this clock or of the asking shard)
                return self._totals[key]
            entry = self._sums.setdefault(key, {"values": {}, "taken": 0})
            entry["values"][shard_index] = value
            self._cond.notify_all()
            deadline = time.monotonic() + self._reduce_timeout
            while len(entry["values"]) < self._participants:
                if self._abandoned is not None:
                    raise self._abandoned
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._sums.pop(key, None)
                    raise Timeout(f"cross-shard sum for step {key}: {len(entry['values'])} of "
                                  f"{self._participants} shards sent their part within {self._reduce_timeout:.0f} s")
                self._cond.wait(remaining)
            total = 0.0
            for index in sorted(entry["values"]):
                total += entry["values"][index]
            if self._journal is not None and key not in self._totals:
                try:
                    self._journal({"sum": key, "total": total})
                except OSError as exc:  # each shard logs the total with its step: a restore needs no journal
                    _log.error("event=sum_not_journaled version=%d error=%s", key, exc)
                self._totals[key] = total
                for old in [k for k in self._totals if k <= key - _KEEP_SUMS]:
                    del self._totals[old]
            entry["taken"] += 1
            if entry["taken"] >= self._participants:
                self._sums.pop(key, None)
            return total

    def status(self) -> ClockStatus:
        with self._cond:
            self._close_round_if_due()  # lapsed leases are counted (and may commit the open round)
            return self._clock.status()
