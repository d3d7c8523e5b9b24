"""The session clock: the session-wide ordering authority every shard of a session follows.

A shard that receives a push asks the session's clock for the push's *ticket*
(:class:`~optserve.server.domain.clock.clock_records.Ticket`). The first ask decides; every later ask
for the same ``(client_id, sequence)`` gets the same ticket, so all shards agree on acceptance,
staleness and order. Accepted pushes get consecutive ordinals; each shard's apply queue
(:class:`~optserve.server.domain.shard.apply_queue.ApplyQueue`) applies tickets strictly in ordinal order,
which keeps the shards' states consistent under concurrent clients. The clock also runs the vote
among shards on each push and sums cross-shard statistics.

:class:`Clock` is what every shard calls. Where the clock lives: in the session's *home* shard,
the first shard of its shard map, as a :class:`HomeClock` (``is_home`` True), which composes

- :class:`~optserve.server.domain.clock.clock_state.ClockState`: versions, tickets, elastic rounds,
  the record of each version, checkpoint timing;
- :class:`~optserve.server.domain.clock.votes.ShardVotes`: the shards' vote on each push;
- :class:`~optserve.server.domain.clock.cross_shard_sums.CrossShardSums`: the cross-shard sums;

and adds what only the home shard does: elastic membership, the history, the ticket journal and
restore of durable sessions, ending the session's waits. The other shards of the session reach it
through :class:`~optserve.server.wire.clock_service.PeerClock` (``is_home`` False; a small gRPC
endpoint in the home shard's process). So a single-shard session never leaves its process, and a
step of a multi-shard session costs each non-home shard one short round trip.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, Protocol, Sequence

from optserve.protos.status_records import RoundRecord
from optserve.server.domain.clock.clock_journal import ClockJournal
from optserve.server.domain.clock.clock_records import ClockStatus, Ticket
from optserve.server.domain.clock.clock_state import clock_state_for
from optserve.server.domain.clock.cross_shard_sums import CrossShardSums
from optserve.server.domain.clock.votes import ShardVotes
from optserve.server.domain.config import SessionConfig
from optserve.server.domain.durability import CheckpointPolicy
from optserve.server.domain.errors import InvalidArgument, OptservError, Unavailable
from optserve.server.domain.waits import SignalCondition, Steps, drive, returns

_log = logging.getLogger(__name__)


class Clock(Protocol):
    """What every shard of a session asks its session's clock (home or peer alike).

    The home shard's clock (:class:`HomeClock`, ``is_home`` True) also answers the home-only
    calls (membership, history, disconnected, restore, durable_state, abandon, peer_down,
    peer_up); a caller makes them only when ``clock.is_home``.
    """

    @property
    def is_home(self) -> bool:
        """True on the session's home shard, where the clock itself lives."""
        ...

    def commit(self, client_id: str, sequence: int, base_version: int) -> Ticket:
        """The push's ticket, decided on the first ask; raises its refusal otherwise."""
        ...

    def ticket(self, ordinal: int) -> Optional[Ticket]:
        """The decided ticket ``ordinal`` (None: not decided yet)."""
        ...

    def vote(self, client_id: str, sequence: int, base_version: int, shard_index: int, staged: bool,
             timeout_s: float, attempt: int = 0) -> Optional[Ticket]:
        """Auto-commit: this shard's stage outcome on the client's try ``attempt`` of the push;
        the ticket once every shard staged (None to a refusing voter); raises the push's refusal
        (see :meth:`ShardVotes.vote`)."""
        ...

    def vote_steps(self, client_id: str, sequence: int, base_version: int, shard_index: int, staged: bool,
                   timeout_s: float, attempt: int = 0) -> Steps[Optional[Ticket]]:
        """:meth:`vote` with its wait for the other shards yielded (:mod:`~optserve.server.domain.waits`)."""
        ...

    def reduce_sum(self, key: int, shard_index: int, value: float) -> float:
        """The sum of ``value`` over the session's shards for step ``key``."""
        ...

    def status(self) -> Optional[ClockStatus]:
        """The clock's counters (the home clock's; None from a peer: the coordinator asks the home shard)."""
        ...


class HomeClock:
    """A session's clock, in the home shard's process: thread-safe, for ``participants`` shards.

    Args:
      config: the session (mode, num_workers, staleness options).
      participants: shards holding tensors of the session; votes and sums wait for all of them.
      reduce_timeout_s: longest wait for the other shards' parts of a cross-shard sum.
      checkpoints: durable sessions: the checkpoint policy (marks checkpoint-due steps).
      journal: durable sessions: called under the clock's lock with each new ticket's JSON
        (``Ticket.to_json``) before any shard sees it, with ``{"round": record}`` after a ticket
        that closes a sync round of several pushes or an elastic one (other records are rebuilt
        from their tickets: see ``ClockState.latest_record_journaled``), and with
        ``{"sum": key, "total": total}`` for each cross-shard sum before any shard gets it: the
        journal a restarted clock replays.
    """

    def __init__(self, config: SessionConfig, participants: int = 1, reduce_timeout_s: float = 300.0,
                 checkpoints: Optional[CheckpointPolicy] = None, journal: Optional[Callable[[Any], None]] = None):
        self._state = clock_state_for(config, checkpoints)
        self._journal = ClockJournal(journal)  # each new ticket is written here before it is handed out
        self._participants = participants
        self._cond = SignalCondition()  # guards the state, the votes and the sums
        self._votes = ShardVotes(participants, self._cond, self._commit_locked)
        self._sums = CrossShardSums(participants, self._cond, reduce_timeout_s, self._journal)
        self._following = False  # a standby's clock: it books its primary's entries and decides nothing

    @property
    def is_home(self) -> bool:
        return True

    @property
    def participants(self) -> int:
        return self._participants

    # ----------------------------------------------------------------- every shard's calls
    def commit(self, client_id: str, sequence: int, base_version: int) -> Ticket:
        with self._cond:
            return self._commit_locked(client_id, sequence, base_version)

    def ticket(self, ordinal: int) -> Optional[Ticket]:
        """The decided ticket ``ordinal`` (None: not decided yet). Shards waiting in an elastic
        round ask for its next ticket while they wait: the round commits here when due."""
        with self._cond:
            self._close_round_if_due()
            return self._state.tickets.get(ordinal)

    def vote(self, client_id: str, sequence: int, base_version: int, shard_index: int, staged: bool,
             timeout_s: float, attempt: int = 0) -> Optional[Ticket]:
        """Auto-commit: one shard's stage outcome; returns the ticket once every shard staged
        (see :meth:`~optserve.server.domain.clock.votes.ShardVotes.vote`; the only shard of a session
        decides alone)."""
        return drive(self.vote_steps(client_id, sequence, base_version, shard_index, staged, timeout_s, attempt))

    def vote_steps(self, client_id: str, sequence: int, base_version: int, shard_index: int, staged: bool,
                   timeout_s: float, attempt: int = 0) -> Steps[Optional[Ticket]]:
        """:meth:`vote`, its wait for the other shards yielded (see :mod:`~optserve.server.domain.waits`)."""
        if self._participants == 1:
            return (yield from returns(self.commit(client_id, sequence, base_version) if staged else None))
        return (yield from self._votes.vote_steps(client_id, sequence, base_version, shard_index, staged, timeout_s,
                                                  attempt))

    def reduce_sum(self, key: int, shard_index: int, value: float) -> float:
        """See :meth:`~optserve.server.domain.clock.cross_shard_sums.CrossShardSums.reduce_sum`."""
        return self._sums.reduce_sum(key, shard_index, value)

    def reduce_sum_steps(self, key: int, shard_index: int, value: float) -> Steps[float]:
        """:meth:`reduce_sum`, its wait for the other shards' parts yielded (a peer's ``ReduceSum`` call)."""
        return (yield from self._sums.reduce_sum_steps(key, shard_index, value))

    def status(self) -> ClockStatus:
        with self._cond:
            self._close_round_if_due()  # lapsed leases are counted (and may commit the open round)
            return self._state.status()

    # ----------------------------------------------------------------- deciding and journaling
    def _commit_locked(self, client_id: str, sequence: int, base_version: int) -> Ticket:
        if self._following:
            raise Unavailable(f"push {sequence} of client {client_id!r}: this clock is a standby's, which decides "
                              f"nothing while its primary serves; retry")
        fresh_from = self._state.next_ordinal
        ticket = self._state.commit(client_id, sequence, base_version)
        if ticket.ordinal >= fresh_from:
            try:
                self._journal.ticket(ticket, self._state)
            except OSError as exc:  # decided all the same: a restore rebuilds it from the shards' step logs
                _log.error("event=ticket_not_journaled version=%d ordinal=%d sequence=%d error=%s",
                           ticket.target_version, ticket.ordinal, sequence, exc)
                raise Unavailable(f"push {sequence} of client {client_id!r}: the ticket journal could not be "
                                  f"written ({exc}); retry") from None
        return ticket

    def _close_round_if_due(self) -> None:
        """Elastic sync: commits the open round without a push when it is due (lock held); the
        shards find the closing ticket when they next ask for the ticket whose turn it is."""
        if self._following:  # a standby's: its primary closes the rounds
            return
        ticket = self._state.close_due(time.monotonic())
        if ticket is None:
            return
        try:
            self._journal.ticket(ticket, self._state)
        except OSError as exc:  # a restore rebuilds it from the shards' step logs
            _log.error("event=round_not_journaled version=%d error=%s", ticket.target_version, exc)
        self._cond.notify_all()

    # ----------------------------------------------------------------- elastic membership (home only)
    def membership(self, worker: str, action: str) -> tuple[int, list[str], float]:
        """Elastic sync: ``action`` "join" / "renew" / "leave" for ``worker``; returns the version,
        the members and the lease (seconds).

        Raises:
          FailedPrecondition-like InvalidArgument: the session is not elastic.
          ResourceExhausted: joining past ``max_workers``.
        """
        with self._cond:
            self._refuse_if_following(f"membership ({action}) of {worker!r}")
            rounds = self._state.rounds
            if rounds is None:
                raise InvalidArgument("membership is for elastic sync sessions (min_workers < num_workers or "
                                      "max_workers > num_workers)")
            if action == "leave":
                rounds.leave(worker)
            else:
                rounds.expire(time.monotonic())
                rounds.touch(worker, time.monotonic())
            self._close_round_if_due()
            return self._state.version, rounds.members(), rounds.lease_s

    def disconnected(self, worker: str) -> None:
        """Elastic sync: ``worker``'s connection to the home shard dropped: it leaves now."""
        with self._cond:
            if self._following:  # a standby's: no client is connected to it
                return
            if self._state.rounds is not None and self._state.rounds.leave(worker, disconnected=True):
                _log.info("event=member_disconnected worker=%s", worker)
                self._close_round_if_due()

    def history(self, since: int) -> list[RoundRecord]:
        """The records of the versions after ``since``, oldest first (the latest
        :data:`~optserve.server.domain.clock.version_history.MAX_VERSIONS_KEPT` versions are kept; see
        :mod:`~optserve.server.domain.clock.version_history`)."""
        with self._cond:
            view = self._state.history.view_since(since)
        return view.records()  # built without the lock: pushes go on meanwhile

    # ----------------------------------------------------------------- hyperparameters (home only)
    def set_hyperparams(self, values: dict) -> tuple[int, bool]:
        """Asks for hyperparameters ``{group: {option: value}}`` (checked by the caller); returns
        ``(the version of the first step running with them, whether anything changed)`` (see
        :mod:`~optserve.server.domain.clock.hyperparam_book`). Durable sessions journal a change before
        answering.

        Raises:
          Unavailable: the journal could not be written (nothing changed).
        """
        with self._cond:
            self._refuse_if_following("a hyperparameter change")
            book = self._state.hyper
            before = (book.pending, book.pending_since)
            version, changed = book.request(values, self._state.version)
            if changed and self._journal:
                try:
                    self._journal({"hyper": book.pending})
                except OSError as exc:
                    book.pending, book.pending_since = before
                    raise Unavailable(f"the hyperparameter change could not be journaled ({exc}); retry") from None
            return version, changed

    def hyperparam_history(self, since: int) -> list:
        """The hyperparameter changes in force from a version after ``since``, oldest first."""
        with self._cond:
            return self._state.hyper.since(since)

    # ----------------------------------------------------------------- durability (home only)
    def start_at(self, version: int) -> None:
        """A session created from a saved state: it is at ``version`` before any ticket (its
        first step decides ``version + 1``; a checkpoint is next due counted from there)."""
        with self._cond:
            if self._state.next_ordinal:
                raise RuntimeError("start_at: the clock already decided tickets")
            self._state.version = self._state.checkpoint_version = int(version)

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
                self._state.restore(state)
                for key, total in state.get("sums", {}).items():
                    self._sums.remember(int(key), float(total))
            parts = _settled_parts(journal)
            for number, (entries, settled) in enumerate(parts):
                _book(self._state, self._sums, entries, replayed if number == len(parts) - 1 else ())
                if settled is not None:  # an earlier restore settled here: what it forgot stays forgotten
                    self._settle(*settled)
            self._state.hyper.settle()
            if settle_at is not None:
                self._settle(*settle_at)

    def replicate(self, begin: Optional[Callable[[dict], None]], entry: Optional[Callable[[Any], None]]) -> None:
        """Primary: ``begin(state)`` with the clock's state now (what a standby's clock starts
        from, with :meth:`restore`), then every later journal entry passed to ``entry`` too; both
        under the clock's lock, so no entry goes out before the state. ``(None, None)``: no more."""
        with self._cond:
            if begin is not None:
                state = self._state.to_json(with_history=True)
                state["sums"] = self._sums.durable_state()
                begin(state)
            self._journal.replica = entry

    def _refuse_if_following(self, what: str) -> None:
        """A standby's clock changes only as its primary's entries say (lock held)."""
        if self._following:
            raise Unavailable(f"{what}: this clock is a standby's, which follows its primary's; retry")

    def set_following(self, following: bool) -> None:
        """A standby's clock follows its primary's (True: it decides no ticket and closes no round)
        until the standby is promoted (False)."""
        with self._cond:
            self._following = following
            self._cond.notify_all()

    @property
    def next_ordinal(self) -> int:
        """The ordinal the next ticket decided here gets (every one before it is decided)."""
        with self._cond:
            return self._state.next_ordinal

    def journal_to(self, disk: Callable[[Any], None]) -> None:
        """A promoted standby's clock of a durable session: each entry from now on is written to
        ``disk`` (its ticket journal) before anything else, as a durable home clock's is."""
        with self._cond:
            self._journal.disk = disk

    def follow(self, entries: list) -> None:
        """A standby's clock: books its primary clock's journal entries (see ``journal``), in the
        order the primary wrote them, as a restore reads them back.

        Raises:
          Unavailable: a ticket that does not follow the last one booked (an entry went missing:
            this clock no longer follows its primary's; nothing of ``entries`` is booked past it).
        """
        with self._cond:
            for part, settled in _settled_parts(entries):
                _book(self._state, self._sums, part, strict=True)
                if settled is not None:  # a restore of the primary's settled its clock: this one alike
                    self._settle(*settled)
            self._state.hyper.settle()
            self._cond.notify_all()

    def _settle(self, version: int, next_ordinal: int) -> None:
        """Forgets the tickets and cross-shard sums of the steps after ``version`` (lock held)."""
        self._state.truncate(version, next_ordinal)
        self._sums.forget_after(version)

    def journal_settled(self) -> None:
        """After a restore that settled the clock (``settle_at``): journals where it settled, so a
        later restore reading the same journal (its forgotten tickets are still in it, before this
        line) forgets them again instead of taking them for decided steps.

        Raises:
          OSError: the journal could not be written.
        """
        with self._cond:
            if self._journal:
                self._journal({"settle": [self._state.version, self._state.next_ordinal]})

    def durable_state(self, rotate: Callable[[], None]) -> dict:
        """The clock's state for a checkpoint, with ``rotate()`` (start a new journal segment)
        run under the same lock: the state covers exactly what was journaled before it."""
        with self._cond:
            state = self._state.to_json(with_history=False)
            history = self._state.history.view(0)
            state["sums"] = self._sums.durable_state()
            rotate()
        state["rounds"] = history.to_json()  # without the lock: pushes go on meanwhile
        return state

    # ----------------------------------------------------------------- ending waits (home only)
    def abandon(self, error: OptservError) -> None:
        """The session ended (closed, or a shard of it died): pending and later votes and sums
        fail with ``error``."""
        with self._cond:
            self._votes.abandon(error)
            self._sums.abandon(error)

    def peer_down(self, shard_index: int, error: OptservError) -> None:
        """Shard ``shard_index`` died (and is being restarted): votes waiting for it end now with
        ``error``, and so do later ones until :meth:`peer_up`, instead of at their timeout."""
        self._votes.peer_down(shard_index, error)

    def peer_up(self, shard_index: int) -> None:
        """Shard ``shard_index`` serves the session again."""
        self._votes.peer_up(shard_index)


def _settled_parts(journal: list) -> list[tuple[list, Optional[tuple[int, int]]]]:
    """The journal cut at its settle lines: ``[(entries, (version, next_ordinal) or None)]``."""
    parts, entries = [], []
    for entry in journal:
        if isinstance(entry, dict) and "settle" in entry:
            parts.append((entries, (int(entry["settle"][0]), int(entry["settle"][1]))))
            entries = []
        else:
            entries.append(entry)
    parts.append((entries, None))
    return parts


def _book(state, sums: CrossShardSums, entries: list, replayed: Sequence[Ticket] = (), strict: bool = False) -> None:
    """Books journal entries into the clock's ``state`` (its lock held), with ``replayed`` tickets
    filling what they lack; ``strict``: each ticket must follow the last one booked.

    Raises:
      Unavailable: ``strict``, a ticket past the next one (an entry went missing).
    """
    tickets, records, hyper = _read_journal(entries, sums)
    for ticket in replayed:
        tickets.setdefault(ticket.ordinal, ticket)
    for ordinal in sorted(tickets):
        if strict and ordinal > state.next_ordinal:
            raise Unavailable(f"the standby's clock is at ticket {state.next_ordinal} and was shipped ticket {ordinal}")
        if ordinal >= state.next_ordinal:
            state.record(tickets[ordinal])
    for record in records:  # the journal's records are exact (replayed ones lack timings)
        if record.version <= state.version:
            state.history.keep(record)
    for values in hyper:  # changes asked for that no ticket carried are pending again
        state.hyper.request(values, state.version)


def _read_journal(journal: list, sums: CrossShardSums) -> tuple[dict[int, Ticket], list[RoundRecord], list[dict]]:
    """The tickets (by ordinal), sync round records and hyperparameter requests of a clock
    journal; its sums go to ``sums``."""
    tickets, records, hyper = {}, [], []
    for entry in journal:
        if isinstance(entry, dict) and "round" in entry:
            records.append(RoundRecord.from_json(entry["round"]))
        elif isinstance(entry, dict) and "hyper" in entry:
            hyper.append(entry["hyper"])  # asked for; those a later ticket carried are dropped below
        elif isinstance(entry, dict):
            sums.remember(int(entry["sum"]), float(entry["total"]))
        else:
            ticket = Ticket.from_json(entry)
            tickets[ticket.ordinal] = ticket
            if ticket.hyperparams:  # it carried every change asked for before it
                hyper.clear()
    return tickets, records, hyper
