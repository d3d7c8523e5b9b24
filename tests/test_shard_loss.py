"""A shard process that dies (real SIGKILL): its sessions are lost, said plainly and at once;
the server replaces the shard and goes on serving.

The server keeps no copy of a session's state yet, so a session with tensors on the dead shard
cannot be recovered; these tests pin that it fails fast with DATA_LOSS naming the session and the
shard (not minutes of retries), that calls blocked on the surviving shard end, and that new
sessions on the restarted shard train exactly.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from optserve.client import Client, SessionLostError
from tests._service_helpers import InProcess, make_grads, make_params, max_abs_diff

OPTIMIZER = {"name": "adafactor_hf", "args": {"lr": 0.01, "relative_step": False, "beta1": 0.9}}


@pytest.fixture(scope="module")
def own_server(ray_local):
    """A server of its own: these tests kill its shards."""
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig

    running = start_server(ServerConfig(host="127.0.0.1", port=0, shards=2, vote_timeout_s=8.0, min_shard_bytes=0))
    yield running
    running.stop()


def _kill_shard(running, index: int) -> None:
    os.kill(running.fleet.pids()[index], signal.SIGKILL)


def _wait_until_all_shards_serve(client: Client, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        shards = client.server_status()
        if all(s.healthy for s in shards):
            return
        time.sleep(0.5)
    raise AssertionError(f"shards did not all serve again within {timeout_s:.0f} s: {shards}")


def test_a_session_on_a_killed_shard_fails_fast_naming_the_session_and_shard_and_the_server_goes_on(own_server):
    client = Client(own_server.address, timeout=60.0)
    params = make_params(0)
    session = client.create_session("doomed", params, optimizer=OPTIMIZER)
    for step in range(3):
        session.push_pull(make_grads(params, step))

    _kill_shard(own_server, 1)
    with pytest.raises(SessionLostError) as lost:
        session.push_pull(make_grads(params, 3))
    assert "'doomed'" in str(lost.value) and "shard 1" in str(lost.value)
    assert lost.value.code == "DATA_LOSS"
    assert "doomed" in client.list_sessions()  # still listed: its owner sees what happened
    with pytest.raises(SessionLostError):
        client.session_status("doomed")
    with pytest.raises(SessionLostError):
        client.session("doomed")
    from optserve.client.cli import collect, render

    report = collect(client)  # `optserve status` shows it as lost instead of failing
    assert [s["name"] for s in report["lost_sessions"]] == ["doomed"]
    assert "doomed" not in [s["name"] for s in report["sessions"]]
    assert "lost session" in render(report)

    _wait_until_all_shards_serve(client)
    # A new session spans the replaced shard too, and trains exactly like the kernel in process.
    fresh = client.create_session("fresh", params, optimizer=OPTIMIZER)
    assert len(fresh.info.shards) == 2
    reference = InProcess(OPTIMIZER["name"], OPTIMIZER["args"], params)
    for step in range(3):
        grads = make_grads(params, step)
        got = fresh.push_pull(grads)
        assert max_abs_diff(got, reference.step(grads)) <= 1e-6
    # The lost session's name is free again once its owner closes it.
    session.close()
    again = client.create_session("doomed", params, optimizer=OPTIMIZER)
    assert again.pull().keys() == params.keys()
    for s in (fresh, again):
        s.close()
    client.close()


def test_a_step_waiting_on_the_surviving_shard_ends_when_its_peer_dies(own_server):
    """Sync with two workers and only one pushing: the push waits for the step on both shards.
    Killing one shard must end the wait on the other with DATA_LOSS, not after the step timeout."""
    client = Client(own_server.address, timeout=60.0)
    _wait_until_all_shards_serve(client)
    params = make_params(1)
    session = client.create_session("waiting", params, optimizer=OPTIMIZER, num_workers=2)
    pending = session.push_pull_async(make_grads(params, 0))
    time.sleep(1.0)  # the push is staged and waits for the second worker
    assert not pending.done()
    _kill_shard(own_server, 0)  # the home shard: its clock goes with it
    with pytest.raises(SessionLostError) as lost:
        pending.result(timeout=45)  # the server's step timeout is 300 s
    assert "'waiting'" in str(lost.value) and "shard 0" in str(lost.value)
    session.close()
    _wait_until_all_shards_serve(client)
    client.close()
