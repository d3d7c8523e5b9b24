"""The replica watch's probe of one shard process (server/ops/replica_watch.py ``_Prober``), over
real gRPC on loopback: a process counts as silent only once it missed three probes and its
silence passed ``silence_s``; one that never answered since it is watched (a fresh standby still
loading) is given ``first_answer_s`` instead."""

from __future__ import annotations

import socket
import time

import pytest

from optserve.server.ops.replica_watch import _Prober
from optserve.server.wire.security import InternalTrust
from tests.test_replica_stream import _Standby


def _probed(prober: _Prober, times: int, until, timeout_s: float = 0.2) -> None:
    """Sends ``times`` probes and waits until ``until()`` (their answers or failures booked)."""
    for _ in range(times):
        prober.ask(timeout_s)
    deadline = time.monotonic() + 10.0
    while not until() and time.monotonic() < deadline:
        time.sleep(0.02)


def _closed_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def trust():
    return InternalTrust.generate(with_tls=False)


def test_a_process_that_never_answered_is_given_first_answer_s_before_it_counts_as_silent(trust):
    prober = _Prober(_closed_port(), trust)
    try:
        _probed(prober, 3, lambda: prober.unanswered >= 3)
        assert prober.unanswered >= 3 and not prober.answered
        now = time.monotonic() + 1.0  # past silence_s, not past first_answer_s
        assert not prober.silent(now, silence_s=0.5, first_answer_s=10.0)
        assert prober.silent(now + 10.0, silence_s=0.5, first_answer_s=10.0)
        assert "never answered" in prober.silence(now) and "probes unanswered" in prober.silence(now)
    finally:
        prober.close()


def test_a_process_that_answered_then_stopped_counts_as_silent_after_silence_s(trust):
    standby = _Standby(trust)
    prober = _Prober(standby.address, trust)
    try:
        _probed(prober, 1, lambda: prober.answered)
        assert prober.answered and prober.unanswered == 0
        assert not prober.silent(time.monotonic() + 1.0, silence_s=0.5, first_answer_s=10.0)  # nothing missed
        standby.stop()
        _probed(prober, 3, lambda: prober.unanswered >= 3)
        assert prober.unanswered >= 3
        now = time.monotonic() + 1.0
        assert prober.silent(now, silence_s=0.5, first_answer_s=10.0)
        assert "since its last answer" in prober.silence(now)
    finally:
        prober.close()
