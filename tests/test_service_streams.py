"""Long-lived PushPull calls: reuse across steps, idle ends, and shards that end calls when crowded."""

from __future__ import annotations

import concurrent.futures
import time

import numpy as np
import pytest

from optserve.client import Client

from _service_helpers import InProcess, make_grads, make_params

OPTIMIZER = {"name": "adafactor_hf", "args": {"lr": 1e-2, "scale_parameter": False, "relative_step": False}}


def test_push_pull_steps_match_in_process_across_an_idle_end_of_the_stream(server, unique_name):
    client = Client(server.address, stream_idle_s=0.2)
    params = make_params()
    session = client.create_session(unique_name, params, optimizer=OPTIMIZER)
    reference = InProcess(OPTIMIZER["name"], OPTIMIZER["args"], params)
    try:
        for step in range(6):
            if step == 3:
                time.sleep(0.8)  # the open calls end while idle; the next step opens new ones
            result = session.push_pull(make_grads(params, step))
            expected = reference.step(make_grads(params, step))
            for name in params:
                np.testing.assert_allclose(result[name], expected[name], rtol=0, atol=1e-6, err_msg=name)
        assert session.status().steps_applied == 6
    finally:
        session.close()
        client.close()


def test_stream_idle_time_must_be_positive(server):
    with pytest.raises(ValueError, match="stream_idle_s"):
        Client(server.address, stream_idle_s=0)


@pytest.fixture(scope="module")
def few_thread_server(ray_local):
    """One shard whose data plane has 4 threads, so at most 2 PushPull calls stay open."""
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig

    running = start_server(ServerConfig(host="127.0.0.1", port=0, shards=1, grpc_threads=4))
    yield running
    running.stop()


def test_more_clients_than_shard_threads_all_step_because_crowded_streams_end(few_thread_server, unique_name):
    # Six clients keep stepping on a shard with 4 threads. Were every client's call kept open,
    # four would hold all the threads (their calls end only after 600 s idle) and the other two
    # would wait past their call deadline (5 s + 60 s reuse) and fail with DEADLINE_EXCEEDED;
    # the shard ends the calls past 2 after each step, so every client gets a thread in turn.
    workers, steps = 6, 5
    params = make_params()
    owner = Client(few_thread_server.address)
    owner.create_session(unique_name, params, optimizer=OPTIMIZER, mode="async")
    clients = [Client(few_thread_server.address, timeout=5.0, stream_idle_s=600.0) for _ in range(workers)]
    sessions = [c.session(unique_name) for c in clients]

    def train(index: int) -> int:
        for step in range(steps):
            sessions[index].push_pull(make_grads(params, step, seed=index + 2))
        return index

    try:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            assert sorted(pool.map(train, range(workers))) == list(range(workers))
        status = owner.session(unique_name).status()
        assert status.steps_applied == workers * steps
        assert status.rejected.get("aborted", 0) == 0
    finally:
        for session in sessions:
            session.detach()
        owner.close_session(unique_name)
        for c in clients + [owner]:
            c.close()
