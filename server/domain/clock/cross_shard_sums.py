"""Cross-shard sums: one float per shard for a step, summed at the home clock, the same float everywhere.

A kernel with a cross-shard statistic (a global gradient norm) computes its shard's part, and
every shard of the session asks :meth:`CrossShardSums.reduce_sum` with the step's version as the
key; each gets the total once all parts arrived. The total is taken in shard-index order, so it
is bit-identical on every shard. Durable sessions journal each total before any shard gets it and
remember the recent ones, so a restarted clock (or a restarted shard asking again) is answered the
same float.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from optserve.server.domain.errors import OptservError, Timeout
from optserve.server.domain.waits import SignalCondition, Steps, drive

_log = logging.getLogger(__name__)

_KEEP_SUMS = 64  # durable sessions: cross-shard sums remembered (by step) for shards that ask again


class _Parts:
    """The parts of one step's sum that arrived (shard index -> value), and how many shards took the total."""

    __slots__ = ("values", "taken")

    def __init__(self):
        self.values: dict[int, float] = {}
        self.taken = 0


class CrossShardSums:
    """The cross-shard sums of one session (thread-safe).

    Args:
      participants: shards holding tensors of the session; a sum waits for all of them.
      cond: the home clock's condition; its lock guards the sums and the clock's state alike (a
        sum waits for its notifications without a thread).
      timeout_s: longest wait for the other shards' parts.
      journal: durable sessions: called under the lock with ``{"sum": key, "total": total}``
        before any shard gets the total (None, or false while it has no sink: totals are not
        remembered).
    """

    def __init__(self, participants: int, cond: SignalCondition, timeout_s: float,
                 journal: Optional[Callable[[Any], None]] = None):
        self._participants = participants
        self._cond = cond
        self._timeout = timeout_s
        self._journal = journal
        self._parts: dict[int, _Parts] = {}  # step -> the parts arrived so far
        self._totals: dict[int, float] = {}  # durable sessions: recent sums, answered again after a restart
        self._abandoned: Optional[OptservError] = None

    def reduce_sum(self, key: int, shard_index: int, value: float) -> float:
        """Sums ``value`` over the participants for step ``key``; returns once all arrived.

        Raises:
          Timeout: a shard's part did not arrive within ``timeout_s``.
          the session's error once :meth:`abandon` ended it.
        """
        return drive(self.reduce_sum_steps(key, shard_index, value))

    def reduce_sum_steps(self, key: int, shard_index: int, value: float) -> Steps[float]:
        """:meth:`reduce_sum` with its wait for the other shards' parts yielded (the lock released;
        see :mod:`~optserve.server.domain.waits`), so a sum waiting holds no thread."""
        if self._participants == 1:
            return value
        deadline = time.monotonic() + self._timeout
        with self._cond:
            if key in self._totals:  # decided before a restart (of this clock or of the asking shard)
                return self._totals[key]
            parts = self._parts.setdefault(key, _Parts())
            parts.values[shard_index] = value
            self._cond.notify_all()
        while True:
            with self._cond:
                if len(parts.values) >= self._participants:
                    return self._take_total(key, parts)
                if self._abandoned is not None:
                    raise self._abandoned
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if self._parts.get(key) is parts:
                        self._parts.pop(key, None)
                    raise Timeout(f"cross-shard sum for step {key}: {len(parts.values)} of "
                                  f"{self._participants} shards sent their part within {self._timeout:.0f} s")
                wait = self._cond.wait_step(remaining)
            yield wait

    def _take_total(self, key: int, parts: _Parts) -> float:
        """Every part of step ``key`` arrived: its total, journaled first by durable sessions (lock held)."""
        total = 0.0
        for index in sorted(parts.values):
            total += parts.values[index]
        if self._journal and key not in self._totals:
            self._journal_total(key, total)
        parts.taken += 1
        if parts.taken >= self._participants and self._parts.get(key) is parts:
            self._parts.pop(key, None)
        return total

    def _journal_total(self, key: int, total: float) -> None:
        """Journals and remembers step ``key``'s total (the oldest remembered are forgotten)."""
        try:
            self._journal({"sum": key, "total": total})
        except OSError as exc:  # each shard logs the total with its step: a restore needs no journal
            _log.error("event=sum_not_journaled version=%d error=%s", key, exc)
        self._totals[key] = total
        for old in [k for k in self._totals if k <= key - _KEEP_SUMS]:
            del self._totals[old]

    def remember(self, key: int, total: float) -> None:
        """A total decided before a restart (from a checkpoint or the journal); lock held."""
        self._totals[key] = total

    def forget_after(self, version: int) -> None:
        """A restore settled the session at ``version``: the totals of later steps go (those
        steps are decided afresh, maybe of other pushes); lock held."""
        for key in [k for k in self._totals if k > version]:
            del self._totals[key]

    def durable_state(self) -> dict[str, float]:
        """The remembered totals, for a checkpoint (``{str(key): total}``); lock held."""
        return {str(k): v for k, v in self._totals.items()}

    def abandon(self, error: OptservError) -> None:
        """The session ended: sums waiting, and every later one that waits, fail with ``error``."""
        with self._cond:
            self._abandoned = error
            self._cond.notify_all()
