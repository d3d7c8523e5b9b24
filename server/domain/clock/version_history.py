"""The record of each version a session's clock decided, in every mode: what ``Session.history``
answers and what replays a run.

A version's :class:`~optserve.protos.status_records.RoundRecord` lists the pushes its update
applied, in ticket order: each one's worker and client id, sequence number, staleness (so its base
version) and scale as the step used it. Sync sessions (plain and elastic) get one record per round,
async sessions one per applied push. The record is built from the tickets the clock decided
(:class:`OpenStep`), so it says exactly what every shard applied.

Where it is kept: by the session's clock on its home shard (:class:`VersionHistory`: the latest
:data:`MAX_VERSIONS_KEPT` versions; older ones are forgotten, so a reader keeps up by asking with
``since``). Durable sessions keep it across a restart: it is part of the clock state each
checkpoint saves, and the versions after a checkpoint are rebuilt from the ticket journal: an
async record, or a sync step's of one push, is a function of its tickets alone (the journal holds
each ticket with its staleness and scale), and the record of a sync round of several pushes or of
an elastic round, whose duration and closing reason no ticket holds, is journaled beside the
ticket that closes it (see :class:`~optserve.server.domain.clock.home_clock.HomeClock`).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Iterable, Optional, Sequence

from optserve.protos.status_records import RoundRecord
from optserve.server.domain.clock.clock_records import Ticket
from optserve.server.domain.config import worker_of

MAX_VERSIONS_KEPT = 4096  # versions whose record a session's clock keeps (as its tickets and hyperparameter changes)


def round_record(version: int, tickets: Sequence[Ticket], closed_by: str, duration_s: float,
                 late: Iterable[str] = ()) -> RoundRecord:
    """The record of ``version``, whose update applied the pushes of ``tickets`` (in order; a
    push-less round closer is no push)."""
    pushes = [t for t in tickets if not t.closes_round]
    # a history holds thousands of records naming the same few clients: one string object each
    clients = tuple(sys.intern(t.client_id) for t in pushes)
    return RoundRecord(version, tuple(sys.intern(worker_of(c)) for c in clients), tuple(t.scale for t in pushes),
                       tuple(late), duration_s, closed_by, clients,
                       tuple(t.sequence for t in pushes), tuple(t.staleness for t in pushes))


@dataclasses.dataclass
class OpenStep:
    """The pushes decided into the step that has not closed yet (``first_at``: when the first
    was, ``time.monotonic()`` seconds)."""

    tickets: list = dataclasses.field(default_factory=list)
    first_at: Optional[float] = None

    def add(self, ticket: Ticket, now: float) -> None:
        if self.first_at is None:
            self.first_at = now
        self.tickets.append(ticket)

    @property
    def workers(self) -> list[str]:
        """The workers that pushed into it, in ticket order."""
        return [worker_of(t.client_id) for t in self.tickets]

    def close(self, version: int, closed_by: str, now: float, late: Iterable[str] = ()) -> RoundRecord:
        """The step closed as ``version``: its record (and the next step opens empty)."""
        record = round_record(version, self.tickets, closed_by, now - (self.first_at if self.first_at is not None
                                                                        else now), late)
        self.tickets, self.first_at = [], None
        return record


class VersionHistory:
    """The records of a session's latest versions, in version order (not thread-safe: the session
    clock calls it under its lock). ``keep``: how many versions it holds."""

    def __init__(self, keep: int = MAX_VERSIONS_KEPT):
        self._keep = keep
        self._records: list[RoundRecord] = []

    def keep(self, record: RoundRecord) -> None:
        """Files ``record`` in version order, replacing one of the same version (a journaled
        record is exact where one rebuilt from tickets lacks timings); the oldest beyond the
        bound are forgotten."""
        if not self._records or self._records[-1].version < record.version:
            self._records.append(record)
        else:
            self._records = sorted([r for r in self._records if r.version != record.version] + [record],
                                   key=lambda r: r.version)
        if len(self._records) > self._keep:
            del self._records[:-self._keep]

    @property
    def latest(self) -> Optional[RoundRecord]:
        return self._records[-1] if self._records else None

    def forget_after(self, version: int) -> None:
        """A restore rolled the session back to ``version``: later records go."""
        self._records = [r for r in self._records if r.version <= version]

    def since(self, version: int) -> list[RoundRecord]:
        """The records of the versions after ``version``, oldest first."""
        return [r for r in self._records if r.version > version]

    def to_json(self) -> list:
        return [r.to_json() for r in self._records]

    def restore(self, data: Iterable[dict]) -> None:
        """Takes back the records of :meth:`to_json`."""
        self._records = []
        for record in data:
            self.keep(RoundRecord.from_json(record))
