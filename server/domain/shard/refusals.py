"""The pushes one shard session refused or dropped: counted by reason, reported and logged once.

Each refusal goes to the session's status counts, its observer (metrics), the home shard's series
and one INFO log line of ``key=value`` fields (``event=push_refused session=... shard=...
client=... sequence=... reason=...``, plus ``cause=...`` when one is given); never tensor values.
"""

from __future__ import annotations

import json
import logging
from typing import Optional

from optserve.server.domain.errors import InvalidArgument, RejectReason
from optserve.server.domain.shard.shard_records import StepObserver
from optserve.server.domain.telemetry import SessionSeries

_log = logging.getLogger(__name__)


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


_UNCHECKED = object()  # StepCheck's answer before the step was traced once


class StepCheck:
    """Refuses a push before it is staged (so before any shard votes and the clock decides a
    version) when the optimizer's step cannot run on this shard's tensors: a kernel that raises
    while its update is traced does so for every push, and a step that failed after its ticket
    was decided would leave the clock ahead of this shard and its peers with the step applied.
    The step is traced once (see :meth:`Updater.step_problem`), under ``cond`` (tracing reads
    the state's structure, which changes only under the session's lock); the answer is kept.

    Args:
      cond: the session's lock on this shard; updater: its updater; refusals: where refusals are
      counted; session / shard_index: for log lines and messages.
    """

    def __init__(self, cond, updater, refusals: "Refusals", session: str, shard_index: int):
        self._cond, self._updater, self._refusals = cond, updater, refusals
        self._session, self._shard = session, shard_index
        self._where = f"session {session!r} on shard {shard_index}"
        self._problem = _UNCHECKED  # why the step cannot run here (None: it can)

    def require(self, client_id: str, sequence: int) -> None:
        """Raises InvalidArgument (naming the session, the shard, the optimizer and the tensors)
        when the step cannot run here."""
        if self._problem is _UNCHECKED:
            with self._cond:
                if self._problem is _UNCHECKED:
                    self._problem = self._updater.step_problem()
                    if self._problem is not None:
                        _log.warning("event=kernel_refused session=%s shard=%d problem=%s", log_value(self._session),
                                     self._shard, log_value(self._problem))
        if self._problem is not None:
            self._refusals.refuse(RejectReason.INVALID, client_id, sequence, cause="kernel")
            raise InvalidArgument(f"{self._where}: {self._problem}; the push was applied nowhere and the version did "
                                  f"not change (every push of this session is refused so: its tensors and optimizer "
                                  f"do not go together)")
