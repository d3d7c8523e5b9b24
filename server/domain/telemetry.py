"""A session's series: how staleness relates to loss.

The session's home shard records every push it applies (the version of its step, its staleness,
the loss and scalars its client attached, when) and every push it refuses (when, why). Bounded:
the most recent ``keep`` (20,000) of each, so a series always fits one gRPC message. ``optserve report`` plots them; the loss is also a metric.
"""

from __future__ import annotations

import collections
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


class SessionSeries:
    """The bounded series of one session (thread-safe)."""

    def __init__(self, keep: int = 20_000):
        self._accepted: collections.deque[AcceptedPush] = collections.deque(maxlen=keep)
        self._refused: collections.deque[RefusedPush] = collections.deque(maxlen=keep)
        self._lock = threading.Lock()
        self.last_loss: Optional[float] = None

    def accepted(self, version: int, staleness: int, telemetry: Telemetry) -> None:
        with self._lock:
            self._accepted.append(AcceptedPush(version, staleness, telemetry, time.time()))
            if telemetry.loss is not None and math.isfinite(telemetry.loss):
                self.last_loss = telemetry.loss

    def refused(self, reason: RejectReason) -> None:
        with self._lock:
            self._refused.append(RefusedPush(time.time(), reason))

    def snapshot(self) -> tuple[list[AcceptedPush], list[RefusedPush]]:
        with self._lock:
            return list(self._accepted), list(self._refused)
