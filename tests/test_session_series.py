"""A session's series on its home shard (``server/domain/telemetry.py``): the latest ``keep``
accepted and refused pushes, oldest first, each as it was recorded, in a few dozen bytes each (a
session that pushes for hours must not grow its shard for hours)."""

from __future__ import annotations

import math
import tracemalloc

from optserve.server.domain.errors import RejectReason
from optserve.server.domain.telemetry import SessionSeries, Telemetry


def test_the_series_keeps_the_latest_pushes_oldest_first_with_their_losses_and_scalars():
    series = SessionSeries(keep=4)
    for version in range(1, 8):  # 7 pushes into 4 rows: the first 3 are overwritten
        loss = None if version == 5 else (math.nan if version == 6 else version / 10)
        scalars = {"acc": version / 100} if version % 2 else {}
        series.accepted(version, version % 3, Telemetry(loss, scalars))
    for reason in (RejectReason.STALE, RejectReason.NONFINITE):
        series.refused(reason)
    accepted, refused = series.snapshot()
    assert [p.version for p in accepted] == [4, 5, 6, 7]
    assert [p.staleness for p in accepted] == [1, 2, 0, 1]
    assert accepted[0].telemetry.loss == 0.4 and accepted[1].telemetry.loss is None
    assert math.isnan(accepted[2].telemetry.loss) and accepted[3].telemetry.loss == 0.7
    # scalars go with their push: slot 0 held version 1's (odd) and now version 5's
    assert [dict(p.telemetry.scalars) for p in accepted] == [{}, {"acc": 0.05}, {}, {"acc": 0.07}]
    assert all(p.unix_s > 1e9 for p in accepted)
    assert [r.reason for r in refused] == [RejectReason.STALE, RejectReason.NONFINITE]
    assert series.last_loss == 0.7  # NaN and None do not replace the last finite loss


def test_a_full_series_of_twenty_thousand_pushes_holds_under_a_megabyte():
    series = SessionSeries()  # keep: 20,000
    telemetry = Telemetry(0.5)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for version in range(40_000):  # twice round: every row written twice
            series.accepted(version, 1, telemetry)
            series.refused(RejectReason.STALE)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 1_000_000, f"{held / 40_000:.0f} bytes per accepted and refused push kept"
    assert len(series.snapshot()[0]) == 20_000
