"""A durable session's log files on one shard as a restore reads them: the step-log segments and
the ticket journal after a checkpoint, the seals that bound a replaced owner's segments, and
cutting the log back (a torn tail, a rollback). :class:`~.step_log.StepLog`, which appends to
them, is one.

A shard that takes over a log (a restore) never appends to its predecessor's segments: it opens a
fresh one and *seals* it first (``seals.json``: segment index -> the version it starts after). A
record that a predecessor still wrote into an older segment past that version (a replaced shard,
cut off, finishing its last write) is then no part of the log (:meth:`LogFiles.stray_after`).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Optional

from optserve.server.storage.files import write_atomically
from optserve.server.storage.log_reader import read_journal
from optserve.server.storage.segments import STEPS, TICKETS, segment_indices, segment_number

log = logging.getLogger(__name__)

SEALS = "seals.json"


class LogFiles:
    """The log files in ``folder`` (one session's, one shard's; ``session`` / ``shard`` name them
    in messages). ``fence``: the shard's :class:`~.ownership.ShardFence` (None: not checked),
    checked before each change to the files."""

    def __init__(self, folder: str, session: str, shard: int, fence=None):
        self.folder, self._session, self._shard = folder, session, shard
        self._fence = fence

    def segments(self, manifest: Optional[dict]) -> list[str]:
        """The step-log segments after ``manifest``'s checkpoint (all: None), in order."""
        start = manifest["steps_from"] if manifest else 0
        return [os.path.join(self.folder, f"{STEPS}-{i}.log") for i in segment_indices(self.folder, STEPS, start)]

    def journal(self, manifest: Optional[dict]) -> list:
        """The clock's journal entries after ``manifest``'s checkpoint (all: None), in order."""
        start = manifest["tickets_from"] if manifest else 0
        out = []
        for i in segment_indices(self.folder, TICKETS, start):
            out.extend(read_journal(os.path.join(self.folder, f"{TICKETS}-{i}.log")))
        return out

    def stray_after(self, segment: str) -> Optional[int]:
        """The version past which ``segment``'s records are not part of the log (a later segment
        was sealed to start after it: records past it are a replaced owner's late writes); None:
        no bound."""
        index = segment_number(segment)
        return min((v for i, v in self.seals().items() if i > index), default=None)

    def seals(self) -> dict[int, int]:
        try:
            with open(os.path.join(self.folder, SEALS), "rb") as fh:
                return {int(i): int(v) for i, v in json.loads(fh.read()).items()}
        except FileNotFoundError:
            return {}

    def seal(self, index: int, version: int) -> None:
        """Segment ``index`` (not written yet) starts after ``version``; seals of segments at or
        past it (a rolled-back log's) are dropped."""
        existing = set(segment_indices(self.folder, STEPS, 0))
        seals = {i: v for i, v in self.seals().items() if i < index and i in existing}
        seals[index] = version
        self._check_owner(f"sealing segment {index}")
        write_atomically(os.path.join(self.folder, SEALS), json.dumps(seals, sort_keys=True).encode())

    def cut(self, segment: str, at: int, drop_later: bool) -> None:
        """Drops the log from byte ``at`` of ``segment`` on: a torn record (``drop_later`` False),
        or the steps after a version every shard of the session reaches, which a restore rolls
        back (``drop_later``: every later segment too)."""
        self._check_owner(f"cutting {segment}")
        os.truncate(segment, at)
        later = []
        if drop_later:
            later = [path for path in self.segments(None) if segment_number(path) > segment_number(segment)]
        for path in later:
            os.unlink(path)
        log.warning("event=step_log_cut session=%s shard=%d path=%s at=%d later_segments_dropped=%d", self._session,
                    self._shard, segment, at, len(later))

    def _check_owner(self, before: str) -> None:
        if self._fence is not None:
            self._fence.check(before)
