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
        """Writes ``entry`` to the disk journal, then passes it to the standby.

        Raises:
          OSError: either could not take it (the caller hands out nothing it carries).
        """
        if self.disk is not None:
            self.disk(entry)
        if self.replica is not None:
            self.replica(entry)
