"""The pushes one shard session refused or dropped: counted by reason, reported and logged once.

Each refusal goes to the session's status counts, its observer (metrics), the home shard's series
and one INFO log line of ``key=value`` fields (``event=push_refused session=... shard=...
client=... sequence=... reason=...``, plus ``cause=...`` when one is given); never tensor values.
"""

from __future__ import annotations

import json
import logging
from typing import Optional

from optserve.server.domain.errors import RejectReason
from optserve.server.domain.shard.shard_records import StepObserver
from optserve.server.domain.telemetry import SessionSeries


def log_value(value) -> str:
    """A ``key=value`` log field's value: as is when plain, else JSON-quoted (spaces, quotes, '=')."""
    text = str(value)
    if text and all(c.isalnum() or c in "-_.:/@+" for c in text):
        return text
    return json.dumps(text)


class Refusals:
    """Counts, reports and logs the pushes one shard session refuses.

    Args:
      session: the session's name (logged).
      shard_index: this shard's index (logged).
      observer: told of every refusal (metrics).
      series: the home shard's series (None elsewhere): records every refusal.
      log: where the line goes (the shard session's logger, the name operators filter on).

    Attributes:
      counts: refusals so far by reason (every reason present, 0 until one happens). Updated
        without a lock, as single increments.
    """

    def __init__(self, session: str, shard_index: int, observer: StepObserver, series: Optional[SessionSeries],
                 log: logging.Logger):
        self.counts: dict[RejectReason, int] = {reason: 0 for reason in RejectReason}
        self._session = session
        self._shard_index = shard_index
        self._observer = observer
        self._series = series
        self._log = log

    def refuse(self, reason: RejectReason, client_id: str, sequence: int, cause: str = "") -> None:
        """Counts (status, metrics, series) and logs one push this shard refused or dropped."""
        self.counts[reason] += 1
        self._observer.rejected(reason)
        if self._series is not None:
            self._series.refused(reason)
        self._log.info("event=push_refused session=%s shard=%d client=%s sequence=%d reason=%s%s",
                       log_value(self._session), self._shard_index, log_value(client_id), sequence, reason.name,
                       f" cause={log_value(cause)}" if cause else "")
