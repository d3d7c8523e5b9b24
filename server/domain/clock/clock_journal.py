"""Where a home clock's journal entries go: a durable session's ticket journal on disk, and a
standby's clock (``docs/plans/hot_standby.md``), each entry to both before the ticket it carries is
handed out."""

from __future__ import annotations

from typing import Any, Callable, Optional

Sink = Callable[[Any], None]


class ClockJournal:
    """The clock's entry sinks (called under the clock's lock, in order). False while it has none:
    then no entry is built at all.

    Args:
      disk: the durable session's ticket journal (None: not durable).
    """

    def __init__(self, disk: Optional[Sink] = None):
        self.disk = disk
        self.replica: Optional[Sink] = None  # a standby's clock, from HomeClock.replicate on

    def __bool__(self) -> bool:
        return self.disk is not None or self.replica is not None

    def __call__(self, entry: Any) -> None:
        """Writes ``entry`` to the disk journal, then passes it to the standby, also when the disk
        refused it (the clock keeps a ticket it decided: its standby's must hold it too).

        Raises:
          OSError: either could not take it (the caller hands out nothing it carries).
        """
        try:
            if self.disk is not None:
                self.disk(entry)
        finally:
            if self.replica is not None:
                self.replica(entry)

    def ticket(self, ticket, state) -> None:
        """Journals a fresh ``ticket`` (a ``Ticket``), and the record of the sync round it closes
        (``state``: the clock's ``ClockState``, which says whether that record is journaled).

        Raises:
          OSError: as :meth:`__call__`.
        """
        if not self:
            return
        self(ticket.to_json())
        if ticket.closes_step and state.latest_record_journaled:
            self({"round": state.history.latest.to_json()})
