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
import subprocess
import time

import pytest

from optserve.client import Client, SessionLostError
from optserve.server.domain.config import ServerConfig
from optserve.server.domain.errors import InvalidArgument
from optserve.server.domain.shard.replica import DIGEST_EVERY
from tests._service_helpers import (InProcess, REPLICA_SILENCE_S, exact_offloaded_shampoo, make_grads, make_params,
                                    max_abs_diff, train_alike)

ADAM = {"name": "adam", "args": {"learning_rate": 0.01}}


def _replicated(ray_local):
    from optserve.server.app import start_server

    return start_server(ServerConfig(host="127.0.0.1", port=0, shards=2, vote_timeout_s=20.0, min_shard_bytes=0,
                                     replicas=2, replica_same_node=True, replica_silence_s=REPLICA_SILENCE_S))


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


def _cut_stream_to_standby(running, index: int) -> None:
    """Aborts every TCP connection to shard ``index``'s standby's internal port (``ss -K``, on
    the kernel's socket: the stream from its primary breaks, both processes live on); skips the
    test where this kernel cannot."""
    port = running.fleet.standbys.clock_addresses[index].rsplit(":", 1)[1]
    cut = subprocess.run(["ss", "-K", "dst", "127.0.0.1", "dport", "=", f":{port}"], capture_output=True, text=True)
    if cut.returncode != 0 or "ESTAB" not in cut.stdout:
        pytest.skip(f"ss -K could not abort a TCP connection here: {(cut.stderr or cut.stdout).strip()[:80]}")


def _logged_by_shards(event: str, session: str) -> list[str]:
    """Lines of the local Ray's worker logs (the shard processes') that hold ``event`` and name ``session``."""
    import ray

    folder = os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs")
    found = []
    for name in os.listdir(folder):
        if name.startswith("worker-") and name.endswith((".err", ".out")):
            with open(os.path.join(folder, name), errors="replace") as log:
                found += [line for line in log if event in line and session in line]
    return found


def _in_sync(client, index: int, timeout_s: float = 120.0):
    """Shard ``index``'s standby once it answers and holds the shard's sessions in sync."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        shard = client.server_status()[index]
        if shard.standby is not None and shard.standby.healthy and shard.standby.in_sync == shard.sessions > 0:
            return shard.standby
        time.sleep(0.2)
    raise AssertionError(f"shard {index}'s standby is not in sync after {timeout_s} s: {shard}")


def test_killed_standbys_leave_their_primaries_acknowledging_alone_until_fresh_ones_catch_up(fresh_server,
                                                                                            unique_name):
    import ray

    client = Client(fresh_server.address, timeout=90.0)
    params = make_params(6)
    session = client.create_session(unique_name, params, optimizer=ADAM)
    reference = InProcess(ADAM["name"], ADAM["args"], params)
    train_alike(session, reference, params, range(4))
    standbys = fresh_server.fleet.standbys
    first = [ray.get(actor.pid.remote()) for actor in standbys.actors]
    for pid in first:
        os.kill(pid, signal.SIGKILL)
    train_alike(session, reference, params, range(4, 9))  # the first of them finds its standby gone
    for index in range(2):  # fresh standbys, caught up from the primaries' memory
        _in_sync(client, index)
    assert not set(first) & {ray.get(actor.pid.remote()) for actor in standbys.actors}
    train_alike(session, reference, params, range(9, 12))
    # a primary and its standby lost together: no copy is left, and the session says so
    os.kill(ray.get(standbys.actors[0].pid.remote()), signal.SIGKILL)
    _kill_primary(fresh_server, 0)
    with pytest.raises(SessionLostError, match="no copy of its state|could not take over"):
        session.push_pull(make_grads(params, 12))
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
def test_a_killed_shard_is_served_by_its_standby_then_by_a_fresh_one_with_no_acknowledged_step_lost(
        replicated_server, unique_name, killed):
    client = Client(replicated_server.address, timeout=90.0)
    params = make_params(5)
    session = client.create_session(unique_name, params, optimizer=ADAM)
    assert len(session.info.shards) == 2
    reference = InProcess(ADAM["name"], ADAM["args"], params)
    train_alike(session, reference, params, range(5))
    standby = _in_sync(client, killed)
    from optserve.client.cli import collect, render

    assert f"{standby.node_id[:12]} {standby.in_sync}/" in render(collect(client))
    for kill in range(2):  # the primary, then the standby promoted in its place once a fresh one is in sync
        before = replicated_server.fleet.addresses[killed]
        pid = _kill_primary(replicated_server, killed)
        train_alike(session, reference, params, range(5 + 5 * kill, 10 + 5 * kill))  # the first spans the fail-over
        assert replicated_server.fleet.addresses[killed] != before  # served by the promoted standby
        assert pid not in replicated_server.fleet.pids()
        _in_sync(client, killed)  # a fresh standby, caught up from the promoted one's memory
    assert session.status().version == 15  # every acknowledged step once: none lost, none twice
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


def test_a_primary_or_standby_that_stops_answering_is_replaced_without_waiting_for_ray(fresh_server, unique_name):
    """SIGSTOP: the process lives on, Ray never calls it dead, and it answers nothing. The
    coordinator's probes find it silent within a second: a silent primary's standby serves in its
    place (the client's step, stuck on the stopped process, is sent there), a silent standby's
    primary goes on with one copy; each silent process is killed and a fresh standby caught up."""
    import ray

    client = Client(fresh_server.address, timeout=30.0)  # far less than a step stuck on a stopped process waits
    params = make_params(4)
    session = client.create_session(unique_name, params, optimizer=ADAM)
    reference = InProcess(ADAM["name"], ADAM["args"], params)
    train_alike(session, reference, params, range(3))
    _in_sync(client, 0)
    before, stopped = fresh_server.fleet.addresses[0], fresh_server.fleet.pids()[0]
    os.kill(stopped, signal.SIGSTOP)
    try:
        train_alike(session, reference, params, range(3, 6))
        assert fresh_server.fleet.addresses[0] != before and stopped not in fresh_server.fleet.pids()
    finally:
        os.kill(stopped, signal.SIGCONT)
    _in_sync(client, 1)
    standby = ray.get(fresh_server.fleet.standbys.actors[1].pid.remote())
    os.kill(standby, signal.SIGSTOP)
    try:
        train_alike(session, reference, params, range(6, 9))  # acknowledged by shard 1 alone once it is let go
    finally:
        os.kill(standby, signal.SIGCONT)
    _in_sync(client, 1)
    assert ray.get(fresh_server.fleet.standbys.actors[1].pid.remote()) != standby
    train_alike(session, reference, params, range(9, 11))
    assert session.status().version == 11
    client.close_session(unique_name)


def test_a_live_standby_whose_stream_was_cut_is_caught_up_again_from_its_primarys_memory(fresh_server, unique_name):
    """The TCP connection from shard 0's primary to its standby is aborted (``ss -K``: a real
    socket kill; both processes live on): its sessions go on with one copy, then the same standby
    process is caught up on them again from the primary's memory, and serves in its place,
    holding every acknowledged step, once the primary is killed."""
    import ray

    client = Client(fresh_server.address, timeout=90.0)
    params = make_params(8)
    session = client.create_session(unique_name, params, optimizer=ADAM)
    reference = InProcess(ADAM["name"], ADAM["args"], params)
    train_alike(session, reference, params, range(3))
    _in_sync(client, 0)
    standbys = fresh_server.fleet.standbys
    standby_pid = ray.get(standbys.actors[0].pid.remote())
    _cut_stream_to_standby(fresh_server, 0)
    train_alike(session, reference, params, range(3, 6))
    _in_sync(client, 0)  # caught up again ...
    assert ray.get(standbys.actors[0].pid.remote()) == standby_pid  # ... by the same process, not a fresh one
    train_alike(session, reference, params, range(6, 8))
    _kill_primary(fresh_server, 0)
    train_alike(session, reference, params, range(8, 10))  # served by that standby, holding every step
    assert session.status().version == 10
    client.close_session(unique_name)


def test_offloaded_roots_reach_the_standby_and_a_promoted_one_asks_the_workers_for_its_own(ray_local, unique_name):
    """Shampoo with its roots on a preconditioner worker, age bound 0 (each root the update needs
    is installed before it, so the run equals in-process Shampoo): the primary is killed, then the
    promoted standby once a fresh one is in sync; the roots each standby installed are its
    primary's, and each promoted one goes on with roots of its own asking."""
    from optserve.server.app import start_server

    running = start_server(ServerConfig(host="127.0.0.1", port=0, shards=2, vote_timeout_s=20.0, min_shard_bytes=0,
                                        replicas=2, replica_same_node=True, replica_silence_s=REPLICA_SILENCE_S,
                                        precond_workers=1))
    try:
        client = Client(running.address, timeout=120.0)
        session, reference, params = exact_offloaded_shampoo(client, unique_name)
        worst, step = 0.0, 0
        for kill in range(2):
            for _ in range(6):
                grads = make_grads(params, step, seed=7)
                worst = max(worst, max_abs_diff(session.push_pull(grads), reference.step(grads)))
                step += 1
            _in_sync(client, 1)
            _kill_primary(running, 1)
            for pushed in range(4):
                grads = make_grads(params, step, seed=7)
                worst = max(worst, max_abs_diff(session.push_pull(grads), reference.step(grads)))
                step += 1
                if pushed == 0:  # served by the promoted standby now
                    installed = session.status().shards[1].root_offload.roots_installed
            shard = session.status().shards[1]  # a root per step (the default compute steps: 1), asked for there
            assert shard.root_offload.offloaded and shard.root_offload.roots_installed >= installed + 3
        for index in range(2):
            _in_sync(client, index)
        while step < DIGEST_EVERY + 2:  # both shards' standbys check their primary's digest of version 50
            grads = make_grads(params, step, seed=7)
            worst = max(worst, max_abs_diff(session.push_pull(grads), reference.step(grads)))
            step += 1
        assert worst <= 1e-5, worst
        assert session.status().version == step
        for index in range(2):
            _in_sync(client, index)
        assert _logged_by_shards("event=standby_promoted", unique_name)  # the shards' logs are where we look
        assert not _logged_by_shards("event=replica_diverged", unique_name)  # the same bits in both processes
        client.close_session(unique_name)
    finally:
        running.stop()


def test_replicas_other_than_1_or_2_are_refused_in_one_line():
    with pytest.raises(InvalidArgument, match="--replicas must be 1 or 2"):
        ServerConfig(replicas=3)


def test_a_cluster_of_one_node_refuses_other_node_standbys_in_one_line():
    from optserve.server.preflight import StartError
    from optserve.server.standby_fleet import standby_nodes

    assert standby_nodes(["a", "b"], ["a", "b"], same_node=False) == ["b", "a"]
    assert standby_nodes(["a", "a"], ["a", "b", "c"], same_node=False) == ["b", "c"]
    with pytest.raises(StartError, match="the cluster has 1 node that can hold shards: add a node or use --replicas 1"):
        standby_nodes(["a"], ["a"], same_node=False)
