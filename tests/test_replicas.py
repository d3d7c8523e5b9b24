"""Hot standbys (``--replicas 2``, issue 59's first slice on one machine): every shard has a standby
shard process that holds each step before it is acknowledged; a real SIGKILL of a shard's process
and its standby serves in its place, with nothing acknowledged lost and nothing applied twice.

A server of its own (these tests kill its shards), both shards and both standbys on this one Ray
node (``replica_same_node``: the single-machine stand-in for the other-node placement). The same
client object keeps calling ``push_pull`` across the kill, and the result equals an uninterrupted
in-process run (1e-6).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from optserve.client import Client, SessionLostError
from optserve.server.domain.config import ServerConfig
from optserve.server.domain.errors import InvalidArgument
from tests._service_helpers import InProcess, make_grads, make_params, max_abs_diff

ADAM = {"name": "adam", "args": {"learning_rate": 0.01}}


def _replicated(ray_local):
    from optserve.server.app import start_server

    return start_server(ServerConfig(host="127.0.0.1", port=0, shards=2, vote_timeout_s=20.0, min_shard_bytes=0,
                                     replicas=2, replica_same_node=True))


@pytest.fixture(scope="module")
def replicated_server(ray_local):
    """Its shards are killed one by one (each once), each promoting its standby."""
    running = _replicated(ray_local)
    yield running
    running.stop()


@pytest.fixture
def fresh_server(ray_local):
    """A replicated server for one test."""
    running = _replicated(ray_local)
    yield running
    running.stop()


def _kill_primary(running, index: int) -> int:
    pid = running.fleet.pids()[index]
    os.kill(pid, signal.SIGKILL)
    return pid


def test_a_killed_standby_leaves_its_primary_acknowledging_alone_with_nothing_lost(fresh_server,
                                                                                   unique_name):
    import ray

    client = Client(fresh_server.address, timeout=90.0)
    params = make_params(6)
    session = client.create_session(unique_name, params, optimizer=ADAM)
    reference = InProcess(ADAM["name"], ADAM["args"], params)
    for step in range(4):
        grads = make_grads(params, step)
        got, expected = session.push_pull(grads), reference.step(grads)
    standbys = fresh_server.fleet.standbys
    for index in range(len(standbys.actors)):
        os.kill(ray.get(standbys.actors[index].pid.remote()), signal.SIGKILL)
    for step in range(4, 9):  # the first of them finds its standby gone
        grads = make_grads(params, step)
        got, expected = session.push_pull(grads), reference.step(grads)
    assert max_abs_diff(got, expected) <= 1e-6
    assert session.status().version == 9
    _kill_primary(fresh_server, 0)  # no copy left: the session is lost, saying why
    with pytest.raises(SessionLostError, match="keeps no copy of its state"):
        session.push_pull(make_grads(params, 9))
    client.close_session(unique_name)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the watch restarts the shard, empty, on its next check
        try:
            fresh_server.fleet.pids()
            break
        except Exception:  # noqa: BLE001 - the dead actor until then
            time.sleep(0.2)
    fresh = client.create_session(f"{unique_name}-after", params, optimizer=ADAM)
    assert fresh.push_pull(make_grads(params, 0)).keys() == params.keys()
    client.close_session(f"{unique_name}-after")


@pytest.mark.parametrize("killed", [0, 1], ids=["home-shard", "other-shard"])
def test_a_killed_shard_is_served_by_its_standby_and_no_acknowledged_step_is_lost(replicated_server, unique_name,
                                                                                  killed):
    client = Client(replicated_server.address, timeout=90.0)
    params = make_params(5)
    session = client.create_session(unique_name, params, optimizer=ADAM)
    assert len(session.info.shards) == 2
    reference = InProcess(ADAM["name"], ADAM["args"], params)
    got = expected = None
    for step in range(5):
        grads = make_grads(params, step)
        got, expected = session.push_pull(grads), reference.step(grads)
    shards = client.server_status()
    assert shards[killed].standby is not None and shards[killed].standby.healthy
    assert shards[killed].standby.in_sync >= 1  # this session's part, at least
    from optserve.client.cli import collect, render

    assert f"{shards[killed].standby.node_id[:12]} {shards[killed].standby.in_sync}/" in render(collect(client))
    before = replicated_server.fleet.addresses[killed]
    pid = _kill_primary(replicated_server, killed)
    for step in range(5, 10):  # the first of them spans the fail-over
        grads = make_grads(params, step)
        got, expected = session.push_pull(grads), reference.step(grads)
    assert max_abs_diff(got, expected) <= 1e-6
    assert session.status().version == 10  # every acknowledged step once: none lost, none twice
    assert replicated_server.fleet.addresses[killed] != before  # served by the promoted standby
    assert pid not in replicated_server.fleet.pids()
    assert not replicated_server.fleet.has_standby(killed)  # one copy from now on (no fresh standby yet)
    assert client.server_status()[killed].standby is None
    client.close_session(unique_name)


def test_a_sync_step_in_flight_when_the_home_shard_dies_is_applied_exactly_once(fresh_server, unique_name):
    # Two workers push each step from threads; the home shard's process is killed while the
    # fourth step's pushes are on their way (gathered, applied or acknowledged: any of them).
    client = Client(fresh_server.address, timeout=90.0)
    params = make_params(7)
    client.create_session(unique_name, params, optimizer=ADAM, num_workers=2)
    workers = [Client(fresh_server.address, timeout=90.0).session(unique_name) for _ in range(2)]
    reference = InProcess(ADAM["name"], ADAM["args"], params)
    got = None
    for step in range(8):
        grads = [make_grads(params, step, seed=1 + w) for w in range(2)]
        pending = [session.push_pull_async(g) for session, g in zip(workers, grads)]
        if step == 3:  # at once: the pushes are on their way, or being gathered, or applied
            _kill_primary(fresh_server, 0)
        got = [p.result(timeout=120) for p in pending]
        expected = reference.step({n: (grads[0][n] + grads[1][n]) / 2 for n in params})
        assert max(max_abs_diff(g, expected) for g in got) <= 1e-6, step
    assert workers[0].status().version == 8
    client.close_session(unique_name)


def test_replicas_2_with_a_checkpoint_dir_or_root_workers_is_refused_in_one_line(tmp_path):
    from optserve.server.domain.durability import DurabilityConfig

    for extra in ({"durability": DurabilityConfig(str(tmp_path))}, {"precond_workers": 1}):
        with pytest.raises(InvalidArgument, match="--replicas 2 does not go with"):
            ServerConfig(replicas=2, **extra)
    with pytest.raises(InvalidArgument, match="--replicas must be 1 or 2"):
        ServerConfig(replicas=3)


def test_a_cluster_of_one_node_refuses_other_node_standbys_in_one_line():
    from optserve.server.preflight import StartError
    from optserve.server.standby_fleet import standby_nodes

    assert standby_nodes(["a", "b"], ["a", "b"], same_node=False) == ["b", "a"]
    assert standby_nodes(["a", "a"], ["a", "b", "c"], same_node=False) == ["b", "c"]
    with pytest.raises(StartError, match="the cluster has 1 node that can hold shards: add a node or use --replicas 1"):
        standby_nodes(["a"], ["a"], same_node=False)
