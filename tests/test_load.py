"""Load at small scale: many clients at once, each on its own session, then all on one shared
async session: every step completes (no deadlock, no error) and stays exact; and the memory of
closed sessions goes back to the shards."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import numpy as np
import pytest

from optserve.client import Client

from _service_helpers import InProcess, make_grads, make_params

CLIENTS, STEPS = 16, 20
OPTIMIZER = {"name": "adafactor_hf", "args": {"lr": 1e-2, "scale_parameter": False, "relative_step": False}}


@pytest.fixture(scope="module")
def load_server(ray_local):
    """Two shards, placement as deployed (a small session stays on one shard)."""
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig

    running = start_server(ServerConfig(host="127.0.0.1", port=0, shards=2))
    yield running
    running.stop()


def _in_threads(fn, count: int, timeout_s: float) -> list:
    """``fn(i)`` for i < count on ``count`` threads at once; fails (instead of hanging) past ``timeout_s``."""
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(fn, i) for i in range(count)]
        done, pending = concurrent.futures.wait(futures, timeout=timeout_s)
        assert not pending, f"{len(pending)} of {count} clients did not finish within {timeout_s} s (a deadlock?)"
        return [f.result() for f in futures]


def test_sixteen_clients_each_on_its_own_session_all_complete_exactly(load_server, unique_name):
    params = make_params()
    start = threading.Barrier(CLIENTS)

    def client(index: int):
        with Client(load_server.address, timeout=60) as c:
            session = c.create_session(f"{unique_name}-{index}", params, optimizer=OPTIMIZER)
            start.wait(timeout=60)
            results = [session.push_pull(make_grads(params, step, seed=index + 1)) for step in range(STEPS)]
            applied = session.status().steps_applied
            session.close()
            return results[-1], applied

    started = time.monotonic()
    outcomes = _in_threads(client, CLIENTS, timeout_s=90)
    elapsed = time.monotonic() - started
    for index, (last, applied) in enumerate(outcomes):
        assert applied == STEPS
        reference = InProcess(OPTIMIZER["name"], OPTIMIZER["args"], params)
        for step in range(STEPS):
            expected = reference.step(make_grads(params, step, seed=index + 1))
        for name in params:
            np.testing.assert_allclose(last[name], expected[name], rtol=0, atol=1e-5, err_msg=f"client {index} {name}")
    print(f"{CLIENTS} clients x {STEPS} steps on own sessions: {elapsed:.1f} s")


def test_sixteen_clients_on_one_shared_async_session_all_complete(load_server, unique_name):
    params = make_params()
    owner = Client(load_server.address, timeout=60)
    owner.create_session(unique_name, params, optimizer=OPTIMIZER, mode="async")
    start = threading.Barrier(CLIENTS)

    def client(index: int) -> int:
        with Client(load_server.address, timeout=60) as c:
            session = c.session(unique_name)
            start.wait(timeout=60)
            for step in range(STEPS):
                session.push_pull(make_grads(params, step, seed=index + 1))
            session.detach()
            return index

    try:
        assert sorted(_in_threads(client, CLIENTS, timeout_s=90)) == list(range(CLIENTS))
        status = owner.session(unique_name).status()
        assert status.steps_applied == CLIENTS * STEPS == status.pushes_accepted
        assert sum(status.rejected.values()) == 0
    finally:
        owner.close_session(unique_name)
        owner.close()


def test_memory_of_a_closed_session_goes_back_to_the_shards(load_server, unique_name):
    # A 32 MiB Adam session (two shards: params, state, pooled gradient buffers, chunks) opened,
    # stepped and closed twice. The first round warms what stays (compiled update, thread stacks);
    # the shards' freed heap would then stay resident (malloc keeps up to 1 GiB free for the next
    # transfer) unless closing a session hands it back.
    from optserve.server.ops.metrics import resident_bytes

    pids = load_server.fleet.pids()
    rss = lambda: sum(resident_bytes(pid) for pid in pids)  # noqa: E731
    params = {f"w{i}": np.zeros((512, 1024), np.float32) for i in range(16)}
    grads = {name: np.full_like(value, 1e-3) for name, value in params.items()}
    client = Client(load_server.address, timeout=120)
    try:
        measured = []
        for round_ in range(2):
            session = client.create_session(f"{unique_name}-{round_}", params,
                                            optimizer={"name": "adam", "args": {"learning_rate": 1e-3}})
            for _ in range(3):
                session.push_pull(grads)
            opened = rss()
            session.close()
            time.sleep(0.5)
            measured.append((opened, rss()))
        (_, baseline), (opened, closed) = measured
        grown = opened - baseline
        assert grown > 64 << 20, measured  # the session held at least params + state
        assert closed - baseline < grown / 3, f"RSS (MiB) open/closed by round: {[(o >> 20, c >> 20) for o, c in measured]}"
    finally:
        client.close()
