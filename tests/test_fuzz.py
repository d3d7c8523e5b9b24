"""The fuzzer in the suite: a seeded run of 2,000 malformed requests against every RPC of a real
server (``bench/fuzz.py``; ``python -m bench.fuzz`` runs 10,000)."""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

from _service_helpers import InProcess, make_grads, make_params
from optserve.client import Client

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the repository root: bench/
from bench import fuzz  # noqa: E402

REQUESTS = 2_000
RSS_GROWTH_BOUND = 100 << 20  # bytes per shard (a seeded run grows a shard by ~10 MiB)
ADAM = {"name": "adam", "args": {"learning_rate": 0.01}}


@pytest.fixture(scope="module")
def fuzz_server(ray_local):
    """Short waits: a push the fuzzer sends to one shard only is refused after vote_timeout_s."""
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig

    running = start_server(ServerConfig(host="127.0.0.1", port=0, shards=2, min_shard_bytes=0, vote_timeout_s=1.0,
                                        step_timeout_s=5.0, staged_push_ttl_s=2.0))
    yield running
    running.stop()


def test_fuzzed_requests_to_every_rpc_never_crash_or_answer_unknown_and_a_healthy_session_stays_exact(fuzz_server):
    address = fuzz_server.address
    params = make_params()
    reference = InProcess(ADAM["name"], ADAM["args"], params)
    with Client(address, timeout=60) as client:
        healthy = client.create_session("healthy-before-the-fuzz", params, optimizer=ADAM)
        first = healthy.push_pull(make_grads(params, 0))
        assert all(np.array_equal(first[n], v) for n, v in reference.step(make_grads(params, 0)).items())
        rss_before = fuzz.shard_resident_bytes(address)

        report = fuzz.run(address, REQUESTS, seed=0, concurrency=8)

        assert report.requests == REQUESTS and "FUZZER_ERROR" not in report.statuses
        assert set(report.by_rpc) == {f"{s}/{m}" for s, m, _ in fuzz.RPCS}  # every RPC of every service
        assert set(report.by_kind) == set(fuzz.KINDS)
        assert report.crashes == 0, report.examples
        assert report.unknown == 0, report.examples.get("UNKNOWN")
        assert report.statuses.get("INTERNAL", 0) == 0, report.examples.get("INTERNAL")
        assert report.statuses["INVALID_ARGUMENT"] > REQUESTS // 4
        assert fuzz.server_answers(address)
        after = healthy.push_pull(make_grads(params, 1))  # the next step, bit for bit
        expected = reference.step(make_grads(params, 1))
        assert all(np.array_equal(after[n], expected[n]) for n in params)
        assert healthy.status().steps_applied == 2
        healthy.close()
        assert client.list_sessions() == []  # the fuzzer's sessions are closed too
        rss_after = fuzz.shard_resident_bytes(address)
    growth = [a - b for a, b in zip(rss_after, rss_before)]
    assert max(growth) < RSS_GROWTH_BOUND, growth
