"""Cross-shard sums served by a real clock server (gRPC on loopback, no Ray): a peer's sum waiting
for the other shards' parts holds no thread of the home shard, so many sessions' steps waiting at
once do not queue behind a pool; the waits still end in the total, a timeout or the session's end."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from optserve.server.domain.clock.cross_shard_sums import CrossShardSums
from optserve.server.domain.clock.home_clock import HomeClock
from optserve.server.domain.config import DType, Mode, SessionConfig, TensorSpec
from optserve.server.domain.errors import SessionLost, Timeout
from optserve.server.domain.waits import SignalCondition
from optserve.server.wire import clock_service
from optserve.server.wire.clock_service import ClockServer, PeerClock
from optserve.server.wire.security import InternalTrust

WAITING = 96  # sums waiting at once, each the part of a different step (a session's step, many sessions alike)
POOL = 4  # the clock server's threads in this test: far fewer than the sums waiting


@pytest.fixture
def served(monkeypatch):
    monkeypatch.setattr(clock_service, "_THREADS", POOL)
    trust = InternalTrust.generate(with_tls=False)
    server = ClockServer("127.0.0.1", "127.0.0.1", trust)
    config = SessionConfig("sums", (TensorSpec("w", DType.FLOAT32, (4,)),), "sgd", {"learning_rate": 0.1},
                           mode=Mode.ASYNC)
    clock = HomeClock(config, participants=2, reduce_timeout_s=10.0)
    server.add("sums", clock)
    try:
        yield clock, PeerClock(server.address, "sums", trust, reduce_timeout_s=30.0)
    finally:
        server.stop()


def test_peer_sums_waiting_for_the_home_shards_parts_hold_no_clock_thread(served):
    """With a wait that held its thread, the first POOL calls would take every thread and the rest
    would queue, so the home shard's part of a queued step would wait out the sum's timeout."""
    clock, peer = served
    with ThreadPoolExecutor(WAITING) as callers:  # the peer shard's side: one blocking call per step
        totals = [callers.submit(peer.reduce_sum, key, 1, float(key)) for key in range(WAITING)]
        time.sleep(1.0)  # every call at the home shard, waiting for shard 0's part
        assert not any(t.done() for t in totals)
        started = time.monotonic()
        for key in reversed(range(WAITING)):  # the home shard's own parts, the last-asked step first
            assert clock.reduce_sum(key, 0, 0.5) == key + 0.5
        assert [t.result(timeout=30) for t in totals] == [key + 0.5 for key in range(WAITING)]
    assert time.monotonic() - started < 8.0  # none waited for its timeout


def test_a_sum_waiting_for_a_part_that_never_comes_times_out_naming_the_step():
    sums = CrossShardSums(2, SignalCondition(), timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(Timeout, match="step 7: 1 of 2 shards sent their part"):
        sums.reduce_sum(7, 1, 1.0)
    assert 0.25 < time.monotonic() - started < 5.0
    with ThreadPoolExecutor(1) as other:  # the step's sum asked again: the timed-out part is not in it
        again = other.submit(sums.reduce_sum, 7, 1, 2.0)
        time.sleep(0.05)
        assert sums.reduce_sum(7, 0, 1.0) == 3.0 and again.result(timeout=10) == 3.0


def test_sums_waiting_when_the_session_ends_get_its_error():
    sums = CrossShardSums(2, SignalCondition(), timeout_s=30.0)
    outcome = {}

    def wait():
        try:
            sums.reduce_sum(3, 1, 1.0)
        except SessionLost as exc:
            outcome["error"] = exc

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.2)
    sums.abandon(SessionLost("session 'sums' ended: kernel failed"))
    waiter.join(timeout=10)
    assert "kernel failed" in str(outcome["error"])
