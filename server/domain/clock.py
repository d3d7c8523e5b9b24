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

from optserve.server.domain.config import Mode, StalenessPolicy
from optserve.server.domain.durability import CheckpointPolicy
from optserve.server.domain.errors import OptservError, PeerRefused, Stale, Timeout, Unavailable
from optserve.server.domain.staleness import decide

_log = logging.getLogger(__name__)

_KEEP_TICKETS = 4096
_KEEP_SUMS = 64  # durable sessions: cross-shard sums remembered (by step) for shards that ask again


@dataclasses.dataclass(frozen=True)
class Ticket:
    """An accepted push, in the order every shard applies it.

    Attributes:
      ordinal: 0, 1, 2, ... per session.
      client_id / sequence: the push.
      staleness / scale / closes_step: see :class:`optserve.server.domain.staleness.Decision`.
      target_version: the version of the step this push belongs to (after it is applied).
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


@dataclasses.dataclass(frozen=True)
class ClockStatus:
    """A session clock's counters: ``version`` (steps decided), ``accepted`` pushes, ``stale``
    refusals; the accepted pushes' staleness (median and largest, versions); and when the clock
    last decided a push (``last_activity_unix_s``, 0: never)."""

    version: int
    accepted: int
    stale: int
    staleness_p50: int = 0
    staleness_max: int = 0
    last_activity_unix_s: float = 0.0


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
    checkpoints: Optional[CheckpointPolicy] = None  # durable sessions: when a step is checkpoint-due
    checkpoint_version: int = 0  # the version of the latest checkpoint-due step (0: initial values)
    checkpoint_time: float = dataclasses.field(default_factory=time.monotonic)

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
        try:
            decision = decide(
                mode=self.mode, version=self.version, base_version=base_version, num_workers=self.num_workers,
                pushes_in_step=len(self.step_clients), client_in_step=client_id in self.step_clients,
                max_staleness=self.max_staleness, policy=self.policy, client_id=client_id,
            )
        except OptservError as exc:
            self.stale += isinstance(exc, Stale)
            self.last[client_id] = (sequence, exc)
            raise
        checkpoint = decision.closes_step and self.checkpoints is not None and self.checkpoints.due(
            self.version + 1 - self.checkpoint_version, time.monotonic() - self.checkpoint_time)
        ticket = Ticket(self.next_ordinal, client_id, sequence, decision.staleness, decision.scale,
                        decision.closes_step, self.version + 1, checkpoint)
        self.record(ticket)
        return ticket

    def record(self, ticket: Ticket) -> None:
        """Books a decided ticket (a fresh decision, or one replayed from the ticket journal)."""
        self.next_ordinal = ticket.ordinal + 1
        self.accepted += 1
        self.staleness_counts[ticket.staleness] = self.staleness_counts.get(ticket.staleness, 0) + 1
        if ticket.closes_step:
            self.version += 1
            self.step_clients.clear()
        else:
            self.step_clients.add(ticket.client_id)
        if ticket.checkpoint:
            self.checkpoint_version, self.checkpoint_time = ticket.target_version, time.monotonic()
        self.last[ticket.client_id] = (ticket.sequence, ticket)
        self.tickets[ticket.ordinal] = ticket
        self.tickets.pop(ticket.ordinal - _KEEP_TICKETS, None)

    def truncate(self, version: int, next_ordinal: int) -> int:
        """Forgets every ticket deciding a version after ``version`` (a restore brought the shards
        back to it) and continues at ``next_ordinal``; returns how many tickets were forgotten.
        A client whose latest ticket is forgotten is answered from its previous one still kept
        (or decided afresh)."""
        dropped = [t for t in self.tickets.values() if t.target_version > version]
        for ticket in dropped:
            del self.tickets[ticket.ordinal]
        self.accepted -= len(dropped)
        self.version, self.next_ordinal = min(self.version, version), next_ordinal
        self.step_clients = set()  # the open step was after ``version``: its tickets are gone
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
                "checkpoint_version": self.checkpoint_version}

    def restore(self, data: dict) -> None:
        """Takes back the state of :meth:`to_json` (the checkpoint clock restarts now)."""
        self.version, self.next_ordinal = int(data["version"]), int(data["next_ordinal"])
        self.step_clients = set(data["step_clients"])
        self.last = {c: (t.sequence, t) for c, t in ((c, Ticket.from_json(v)) for c, v in data["last"].items())}
        self.tickets = {t.ordinal: t for t in map(Ticket.from_json, data["tickets"])}
        self.accepted, self.stale = int(data["accepted"]), int(data["stale"])
        self.staleness_counts = {int(k): int(v) for k, v in data["staleness_counts"].items()}
        self.checkpoint_version, self.checkpoint_time = int(data["checkpoint_version"]), time.monotonic()

    def status(self) -> ClockStatus:
        return ClockStatus(self.version, self.accepted, self.stale, _median(self.staleness_counts),
                           max(self.staleness_counts, default=0), self.last_activity_unix_s)


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
                        checkpoints=checkpoints)


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
        if self._journal is not None and ticket.ordinal >= fresh_from:
            try:
                self._journal(ticket.to_json())
            except OSError as exc:  # decided all the same: a restore rebuilds it from the shards' step logs
                raise Unavailable(f"push {sequence} of client {client_id!r}: the ticket journal could not be "
                                  f"written ({exc}); retry") from None
        return ticket

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
            tickets = {}
            for entry in journal:
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
        with self._cond:
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
            return self._clock.status()
