"""A session's series: how staleness relates to loss.

The session's home shard records every push it applies (the version of its step, its staleness,
the loss and scalars its client attached, when) and every push it refuses (when, why). Bounded:
the most recent ``keep`` (20,000) of each, so a series always fits one gRPC message. ``optserve report`` plots them; the loss is also a metric.
"""

from __future__ import annotations

import array
import dataclasses
import math
import threading
import time
from typing import Mapping, Optional

from optserve.protos.contract import MAX_SCALAR_NAME, MAX_SCALARS
from optserve.server.domain.errors import InvalidArgument, RejectReason


@dataclasses.dataclass(frozen=True)
class Telemetry:
    """What a client attached to a push: its loss and other scalars (validated)."""

    loss: Optional[float] = None
    scalars: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def validate(self) -> None:
        """Raises InvalidArgument naming the limit a client's telemetry exceeds."""
        if len(self.scalars) > MAX_SCALARS:
            raise InvalidArgument(f"push header: at most {MAX_SCALARS} scalars, got {len(self.scalars)}")
        for name in self.scalars:
            if not 1 <= len(name) <= MAX_SCALAR_NAME:
                raise InvalidArgument(f"push header: scalar names have 1-{MAX_SCALAR_NAME} characters, got {name[:80]!r}")


@dataclasses.dataclass(frozen=True)
class AcceptedPush:
    version: int
    staleness: int
    telemetry: Telemetry
    unix_s: float


@dataclasses.dataclass(frozen=True)
class RefusedPush:
    unix_s: float
    reason: RejectReason


class _Ring:
    """The latest ``keep`` rows of fixed-type columns (one ``array.array`` per typecode), the
    oldest overwritten first: a row costs its columns' bytes, not a Python object per field."""

    def __init__(self, keep: int, typecodes: str):
        self._keep = keep
        self._columns = [array.array(code) for code in typecodes]
        self._next = 0  # once full: the slot the next row overwrites (the oldest)

    def append(self, *values) -> int:
        """Adds a row; returns its slot (a slot reused by a later row is the older row's no more)."""
        columns = self._columns
        if len(columns[0]) < self._keep:
            for column, value in zip(columns, values):
                column.append(value)
            return len(columns[0]) - 1
        slot = self._next
        for column, value in zip(columns, values):
            column[slot] = value
        self._next = (slot + 1) % self._keep
        return slot

    def rows(self) -> list[tuple]:
        """``(slot, *values)`` of every row, the oldest first."""
        size = len(self._columns[0])
        start = self._next if size == self._keep else 0
        order = list(range(start, size)) + list(range(start))
        return [(slot, *(column[slot] for column in self._columns)) for slot in order]


_REASONS = tuple(RejectReason)
_REASON_CODE = {reason: code for code, reason in enumerate(_REASONS)}


class SessionSeries:
    """The bounded series of one session (thread-safe), kept as columns: a session that pushes
    for hours holds ``keep`` rows of about 40 bytes each, reached in its first ``keep`` pushes
    (a record object per push cost over 300)."""

    def __init__(self, keep: int = 20_000):
        self._accepted = _Ring(keep, "qqdbd")  # version, staleness, loss, whether there is a loss, unix_s
        self._scalars: dict[int, Mapping[str, float]] = {}  # an accepted row's slot -> its scalars (if any)
        self._refused = _Ring(keep, "db")  # unix_s, reason's code
        self._lock = threading.Lock()
        self.last_loss: Optional[float] = None

    def accepted(self, version: int, staleness: int, telemetry: Telemetry) -> None:
        loss = telemetry.loss
        with self._lock:
            slot = self._accepted.append(version, staleness, 0.0 if loss is None else loss, loss is not None,
                                         time.time())
            if telemetry.scalars:
                self._scalars[slot] = telemetry.scalars
            else:
                self._scalars.pop(slot, None)
            if loss is not None and math.isfinite(loss):
                self.last_loss = loss

    def refused(self, reason: RejectReason) -> None:
        with self._lock:
            self._refused.append(time.time(), _REASON_CODE[reason])

    def snapshot(self) -> tuple[list[AcceptedPush], list[RefusedPush]]:
        with self._lock:
            accepted, scalars, refused = self._accepted.rows(), dict(self._scalars), self._refused.rows()
        return ([AcceptedPush(version, staleness, Telemetry(loss if has_loss else None, scalars.get(slot, {})), unix_s)
                 for slot, version, staleness, loss, has_loss, unix_s in accepted],
                [RefusedPush(unix_s, _REASONS[code]) for _slot, unix_s, code in refused])
