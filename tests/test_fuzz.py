"""The fuzzer in the suite: a seeded run of 2,000 malformed requests against every RPC of a real
server (``bench/fuzz.py``; ``python -m bench.fuzz`` runs 10,000), then a short run against the
shards' internal SessionClock endpoints alone."""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

from _service_helpers import InProcess, make_grads, make_params, max_abs_diff
from optserve.client import Client

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the repository root: bench/
from bench import fuzz  # noqa: E402

REQUESTS = 2_000
CLOCK_REQUESTS = 300  # a few seconds: a sum part whose peers never come waits the server's step timeout
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


def _fuzz_beside_a_healthy_session(running, name: str, **run_args) -> fuzz.Report:
    """Runs the fuzzer (``fuzz.run(address, **run_args)``) between two steps of a healthy session,
    and checks what must hold whatever the fuzz sent: the server answers, the healthy session's
    next step equals bit for bit that of a twin session made after the fuzz (the same tensors on
    the same shards, so the same compiled steps), and the in-process optimizer's to 1e-6, every
    fuzz session is closed, and no shard grew by RSS_GROWTH_BOUND or more. Returns the fuzzer's
    report."""
    address = running.address
    params = make_params()
    reference = InProcess(ADAM["name"], ADAM["args"], params)
    with Client(address, timeout=60) as client:
        healthy = client.create_session(name, params, optimizer=ADAM)
        first = healthy.push_pull(make_grads(params, 0))
        assert max_abs_diff(first, reference.step(make_grads(params, 0))) <= 1e-6
        rss_before = fuzz.shard_resident_bytes(address)

        report = fuzz.run(address, **run_args)

        assert fuzz.server_answers(address)
        after = healthy.push_pull(make_grads(params, 1))  # the next step, bit for bit
        twin = client.create_session(name + "-twin", params, optimizer=ADAM)
        assert [list(s.tensor_names) for s in twin.info.shards] == [list(s.tensor_names) for s in healthy.info.shards]
        twin.push_pull(make_grads(params, 0))
        expected = twin.push_pull(make_grads(params, 1))
        assert all(np.array_equal(after[n], expected[n]) for n in params)
        assert max_abs_diff(after, reference.step(make_grads(params, 1))) <= 1e-6
        assert healthy.status().steps_applied == 2
        twin.close()
        healthy.close()
        assert client.list_sessions() == []  # the fuzzer's sessions are closed too
        rss_after = fuzz.shard_resident_bytes(address)
    growth = [a - b for a, b in zip(rss_after, rss_before)]
    assert max(growth) < RSS_GROWTH_BOUND, growth
    return report


def _assert_no_fault(report: fuzz.Report, requests: int) -> None:
    """Every request was sent and answered, none UNAVAILABLE (a crash), UNKNOWN or INTERNAL."""
    assert report.requests == requests and "FUZZER_ERROR" not in report.statuses
    assert report.crashes == 0, report.examples
    assert report.unknown == 0, report.examples.get("UNKNOWN")
    assert report.statuses.get("INTERNAL", 0) == 0, report.examples.get("INTERNAL")


def test_fuzzed_requests_to_every_rpc_never_crash_or_answer_unknown_and_a_healthy_session_stays_exact(fuzz_server):
    report = _fuzz_beside_a_healthy_session(fuzz_server, "healthy-before-the-fuzz", requests=REQUESTS, seed=0,
                                            concurrency=8, clock=fuzz.clock_access_of(fuzz_server))
    _assert_no_fault(report, REQUESTS)
    assert set(report.by_rpc) == {f"{s}/{m}" for s, m, _ in fuzz.RPCS}  # every RPC of every service
    assert {s for s, _, _ in fuzz.RPCS} == set(fuzz.SERVICES)
    assert set(report.by_kind) == set(fuzz.KINDS)
    assert report.statuses["INVALID_ARGUMENT"] > REQUESTS // 4


def test_fuzzed_session_clock_requests_are_refused_or_answered_never_internal_or_unknown(fuzz_server):
    """With the internal secret, requests reach the clocks (tickets, sums and domain refusals in
    the replies) or are refused INVALID_ARGUMENT; without it, UNAUTHENTICATED."""
    report = _fuzz_beside_a_healthy_session(fuzz_server, "healthy-beside-the-clock-fuzz", requests=CLOCK_REQUESTS,
                                            seed=1, concurrency=8, clock=fuzz.clock_access_of(fuzz_server),
                                            services=("SessionClock",))
    _assert_no_fault(report, CLOCK_REQUESTS)
    assert set(report.by_rpc) == {f"SessionClock/{m}" for m, _ in fuzz.CLOCK}  # only, and every one
    assert set(report.by_kind) == set(fuzz.CLOCK_KINDS)
    assert report.statuses["UNAUTHENTICATED"] > 0  # no secret, or a wrong one
    assert report.statuses["INVALID_ARGUMENT"] > CLOCK_REQUESTS // 4  # undecodable, or numbers out of range
    outcomes = {outcome.split(": ", 1)[1] for outcome in report.clock_outcomes}
    assert {"error NOT_FOUND", "total"} <= outcomes, report.clock_outcomes  # the servicer and a clock answered
