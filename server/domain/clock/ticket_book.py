"""A session clock's recent tickets by ordinal, kept as columns (no object per ticket).

Shards ask the home clock for the ticket whose turn it is by its ordinal, so the clock keeps the
tickets of the latest :data:`KEEP_TICKETS` ordinals; a durable session's checkpoint saves them.
"""

from __future__ import annotations

import sys
from typing import Iterable, Iterator, Optional

from optserve.server.domain.clock.clock_records import Ticket
from optserve.server.domain.clock.columns import Columns

KEEP_TICKETS = 4096  # ordinals whose ticket a session's clock keeps (shards ask for the one whose turn it is)
_ORDINAL = 0
_FIELDS = "qOqqdBqBO"  # a Ticket's fields in order: ordinal, client_id, sequence, staleness, scale,
# closes_step, target_version, checkpoint, hyperparams


class TicketBook:
    """The tickets of a session's latest ``keep`` ordinals, in ordinal order (not thread-safe:
    the session clock calls it under its lock)."""

    def __init__(self, keep: int = KEEP_TICKETS):
        self._keep = keep
        self._rows = Columns(_FIELDS)

    def __len__(self) -> int:
        return len(self._rows)

    def put(self, ticket: Ticket) -> None:
        """Books ``ticket`` (replacing one of its ordinal); tickets ``keep`` or more ordinals
        older than it are forgotten. A ticket whose numbers do not fit int64 is refused
        (``OverflowError``), the book unchanged."""
        if not self._rows.fits(_row(ticket)):
            raise OverflowError(f"ticket {ticket.ordinal} of client {ticket.client_id!r}: a number past int64")
        if len(self._rows) and self._rows.value(_ORDINAL, len(self._rows) - 1) >= ticket.ordinal:
            self._refile([t for t in self if t.ordinal != ticket.ordinal] + [ticket])
        else:
            self._rows.append(_row(ticket))
        self._rows.drop_first(self._rows.find(_ORDINAL, ticket.ordinal - self._keep, after=True))

    def get(self, ordinal: int) -> Optional[Ticket]:
        """The ticket of ``ordinal``, or None (never decided, or forgotten)."""
        index = self._rows.find(_ORDINAL, ordinal)
        if index < len(self._rows) and self._rows.value(_ORDINAL, index) == ordinal:
            return _ticket(self._rows.row(index))
        return None

    def __iter__(self) -> Iterator[Ticket]:
        """The tickets kept, in ordinal order."""
        return map(_ticket, self._rows.rows())

    def forget_deciding_after(self, version: int) -> list[Ticket]:
        """Forgets the tickets deciding a version after ``version``; returns them."""
        tickets = list(self)
        gone = [t for t in tickets if t.target_version > version]
        if gone:
            self._refile([t for t in tickets if t.target_version <= version])
        return gone

    def restore(self, tickets: Iterable[Ticket]) -> None:
        """Replaces the book's tickets with ``tickets`` (any order)."""
        self._refile(list(tickets))

    def _refile(self, tickets: list[Ticket]) -> None:
        by_ordinal = {t.ordinal: t for t in tickets}  # a later one of an ordinal replaces an earlier
        self._rows.clear()
        for ticket in sorted(by_ordinal.values(), key=lambda t: t.ordinal):
            self._rows.append(_row(ticket))


def _row(ticket: Ticket) -> tuple:
    return (ticket.ordinal, sys.intern(ticket.client_id), ticket.sequence, ticket.staleness, ticket.scale,
            ticket.closes_step, ticket.target_version, ticket.checkpoint, ticket.hyperparams)


def _ticket(row: tuple) -> Ticket:
    ordinal, client_id, sequence, staleness, scale, closes_step, target_version, checkpoint, hyperparams = row
    return Ticket(ordinal, client_id, sequence, staleness, scale, bool(closes_step), target_version, bool(checkpoint),
                  hyperparams)
