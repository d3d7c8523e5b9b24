"""Elastic sync rounds: who is a member, when a round commits, and the record of each version.

A sync session whose ``min_workers < num_workers`` or ``max_workers > num_workers`` keeps a
membership (:class:`Rounds`, owned by the session clock and guarded by its lock). A worker is the
part of a push's ``client_id`` before its first '/' (:func:`~optserve.server.domain.config.worker_of`),
so one worker may reconnect with a fresh client object and keep its identity.

Members
  A worker joins at its first push, or explicitly (the Membership RPC); more than
  ``max_workers`` at once is refused (ResourceExhausted). Every push and renewal extends its
  lease to ``lease_s`` from then. It leaves when it says so, when its connection to the home shard
  drops (the shard's stream servicer reports it), or when its lease lapses.

Rounds
  A round is the set of pushes decided for one version. It commits with the push that makes it

  - ``num_workers`` pushes (today's strict rule), or
  - at least ``min_workers`` pushes with every *expected* member in it ("members");

  and without a push (a closing marker ticket, see :meth:`Rounds.due`) when it holds at least
  ``min_workers`` pushes and either the straggler deadline passed since its first push
  ("deadline") or a member left and every remaining expected member pushed ("left").
  A member is expected unless it is a *straggler*: one that missed the last round committed at its
  deadline. A straggler that pushes on time is expected again. So one slow worker costs the others
  one deadline, not one per round.

Every committed version gets a :class:`RoundRecord` (:func:`~optserve.server.domain.clock.version_history.round_record`):
its pushes (in ticket order, with the scale of each gradient in the mean), the late gradients
dropped while it was open, its duration and why it committed. The update averages exactly the
participants' gradients, so a run can be replayed from its records; the session clock keeps them
(:class:`~optserve.server.domain.clock.version_history.VersionHistory`).
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import Optional

from optserve.protos.status_records import ElasticStatus, RoundRecord
from optserve.server.domain.clock.clock_records import Ticket
from optserve.server.domain.clock.version_history import OpenStep
from optserve.server.domain.config import SessionConfig, worker_of
from optserve.server.domain.errors import ResourceExhausted

_PERIODS_KEPT = 16
_MIN_ADAPTIVE_S = 0.05


@dataclasses.dataclass
class _Member:
    lease_until: float
    straggler: bool = False


class Rounds:
    """Membership and the open round of one elastic session (not thread-safe: the session clock
    calls it under its lock). Times are ``time.monotonic()`` seconds."""

    def __init__(self, config: SessionConfig):
        self._num_workers = config.num_workers
        self._min_workers = config.min_workers
        self._max_workers = config.max_workers
        self._lease_s = config.elastic.lease_s
        self._straggler_s = config.elastic.straggler_s
        self._members: dict[str, _Member] = {}
        self._open = OpenStep()
        self._late: list[str] = []  # late gradients dropped since the last commit
        self._periods: collections.deque = collections.deque(maxlen=_PERIODS_KEPT)
        self._durations: collections.deque = collections.deque(maxlen=_PERIODS_KEPT)
        self._last_commit_at: Optional[float] = None
        self._left_since_open = False
        self.lease_expiries = 0
        self.disconnects = 0
        self.rounds_short = 0
        self.late_dropped = 0

    @property
    def lease_s(self) -> float:
        return self._lease_s

    # ----------------------------------------------------------------- members
    def members(self) -> list[str]:
        return sorted(self._members)

    def touch(self, worker: str, now: float) -> None:
        """A push or renewal from ``worker``: joins it if needed and extends its lease.

        Raises:
          ResourceExhausted: it is not a member and ``max_workers`` members are.
        """
        member = self._members.get(worker)
        if member is None:
            if len(self._members) >= self._max_workers:
                raise ResourceExhausted(f"worker {worker!r} cannot join: the session has max_workers="
                                        f"{self._max_workers} members ({', '.join(sorted(self._members))})")
            member = self._members[worker] = _Member(now + self._lease_s)
        member.lease_until = now + self._lease_s

    def leave(self, worker: str, disconnected: bool = False) -> bool:
        """``worker`` leaves now; returns whether it was a member."""
        if self._members.pop(worker, None) is None:
            return False
        self.disconnects += disconnected
        self._left_since_open = True
        return True

    def expire(self, now: float) -> list[str]:
        """Members whose lease lapsed leave; returns them."""
        lapsed = [w for w, m in self._members.items() if m.lease_until < now]
        for worker in lapsed:
            del self._members[worker]
        self.lease_expiries += len(lapsed)
        if lapsed:
            self._left_since_open = True
        return lapsed

    # ----------------------------------------------------------------- rounds
    def in_round(self, worker: str) -> bool:
        return worker in self._open.workers

    def closes_with(self, worker: str) -> Optional[str]:
        """Why the round would commit with ``worker``'s push (None: it stays open)."""
        pushers = set(self._open.workers)
        pushers.add(worker)
        return self._closing(pushers)

    def _closing(self, pushers: set) -> Optional[str]:
        if len(pushers) >= self._num_workers:
            return "num_workers"
        expected = {w for w, m in self._members.items() if not m.straggler}
        if len(pushers) >= self._min_workers and expected <= pushers:
            return "members"
        return None

    def due(self, now: float) -> Optional[str]:
        """Why the open round should commit now without a further push (None: it waits)."""
        round_ = self._open
        if len(round_.tickets) < self._min_workers:
            return None
        if self._left_since_open and self._closing(set(round_.workers)) is not None:
            return "left"
        deadline = self.straggler_deadline()
        if deadline is not None and now >= round_.first_at + deadline:
            return "deadline"
        return None

    def straggler_deadline(self) -> Optional[float]:
        """Seconds after a round's first push at which it commits with whoever pushed (None: none yet)."""
        if self._straggler_s is not None:
            return self._straggler_s
        if len(self._periods) < 2:
            return None
        return max(_MIN_ADAPTIVE_S, 0.5 * statistics.median(self._periods))

    def add(self, ticket: Ticket, now: float) -> None:
        """The push of ``ticket`` was decided into the open round (opening it if needed)."""
        if not self._open.tickets:
            self._left_since_open = False
        self._open.add(ticket, now)
        member = self._members.get(worker_of(ticket.client_id))
        if member is not None:
            member.straggler = False

    def dropped_late(self, worker: str) -> None:
        self._late.append(worker)
        self.late_dropped += 1

    def commit(self, version: int, closed_by: str, now: float) -> RoundRecord:
        """The open round committed as ``version``; returns its record."""
        pushers = set(self._open.workers)
        if closed_by == "deadline":
            for worker, member in self._members.items():
                if worker not in pushers:
                    member.straggler = True
        if len(self._open.tickets) < self._num_workers:
            self.rounds_short += 1
        record = self._open.close(version, closed_by, now, self._late)
        if self._last_commit_at is not None:
            self._periods.append(now - self._last_commit_at)
        self._last_commit_at = now
        self._durations.append(record.duration_s)
        self._late = []
        return record

    def forget_after(self, version: int) -> None:
        """A restore rolled the session back to ``version``: the open round goes."""
        self._open, self._late = OpenStep(), []

    def status(self) -> ElasticStatus:
        deadline = self.straggler_deadline()
        return ElasticStatus(tuple(sorted(self._members)),
                             tuple(sorted(w for w, m in self._members.items() if m.straggler)),
                             self.lease_expiries, self.disconnects, self.rounds_short, self.late_dropped,
                             statistics.median(self._durations) if self._durations else 0.0,
                             deadline if deadline is not None else 0.0)
