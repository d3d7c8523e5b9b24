"""``--on-one-replica refuse``: a session part left with one copy in sync (its standby lost, or its
primary lost and the standby promoted) acknowledges nothing until a fresh standby holds it; and a
session's own ``replicas``: 1 on a ``--replicas 2`` server keeps no standby (it is lost with its
shard), 2 on a ``--replicas 1`` server is refused.

A server of its own (its processes are SIGKILLed), shards and standbys on this one Ray node
(``replica_same_node``). A push sent after a kill returns only once a fresh standby holds the
step: the shard's status shows the fresh standby in sync the moment it returns (with ``continue``
the push returns within a second, long before a fresh standby has started). The results equal an
uninterrupted in-process run (1e-6), every step applied once.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from optserve.client import Client, FailedPreconditionError, SessionLostError
from optserve.server.domain.config import ServerConfig
from optserve.server.domain.errors import InvalidArgument
from tests._service_helpers import REPLICA_SILENCE_S, InProcess, make_grads, make_params, max_abs_diff
from tests.test_replicas import ADAM, _cut_stream_to_standby, _in_sync, _kill_primary


@pytest.fixture
def refusing_server(ray_local):
    from optserve.server.app import start_server

    running = start_server(ServerConfig(host="127.0.0.1", port=0, shards=2, vote_timeout_s=20.0, min_shard_bytes=0,
                                        replicas=2, replica_same_node=True, replica_silence_s=REPLICA_SILENCE_S,
                                        on_one_replica="refuse"))
    yield running
    running.stop()


def _step(session, reference, params, step: int) -> None:
    grads = make_grads(params, step)
    assert max_abs_diff(session.push_pull(grads), reference.step(grads)) <= 1e-6


def _held_by_a_fresh_standby(client, index: int, gone_pid: int, standbys, sessions: int = 1) -> None:
    import ray

    shard = client.server_status()[index]
    assert shard.standby is not None and shard.standby.healthy and shard.standby.in_sync == sessions, shard
    assert ray.get(standbys.actors[index].pid.remote()) != gone_pid


def test_with_refuse_no_step_is_acknowledged_with_one_copy_until_a_fresh_standby_holds_it(refusing_server,
                                                                                          unique_name):
    import ray

    client = Client(refusing_server.address, timeout=120.0)
    params = make_params(6)
    session = client.create_session(unique_name, params, optimizer=ADAM)
    assert len(session.info.shards) == 2
    reference = InProcess(ADAM["name"], ADAM["args"], params)
    for step in range(3):
        _step(session, reference, params, step)
    for index in range(2):
        _in_sync(client, index)
    standbys = refusing_server.fleet.standbys
    alone = client.create_session(f"{unique_name}-alone", params, optimizer=ADAM, replicas=1)
    assert (alone.options.replicas, alone.info.hot_standby) == (1, False)
    assert (session.options.replicas, session.info.hot_standby) == (2, True)
    alone.push_pull(make_grads(params, 0))
    shard = client.server_status()[0]  # in sync: 1 of the 1 session kept with a standby, of 2 there
    assert (shard.sessions, shard.standby.replicated, shard.standby.in_sync) == (2, 1, 1), shard
    from optserve.client.cli import collect, render

    assert f"{shard.standby.node_id[:12]} 1/1" in render(collect(client))

    gone = ray.get(standbys.actors[0].pid.remote())  # the home shard's standby lost
    os.kill(gone, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while standbys.actors[0] is not None and time.monotonic() < deadline:  # forgotten, the fresh one not up
        time.sleep(0.02)
    late = client.create_session(f"{unique_name}-late", params, optimizer=ADAM)  # its part there awaits one
    late.push_pull(make_grads(params, 0))  # returns once a fresh standby holds it: the one lost is replaced
    assert standbys.actors[0] is not None and ray.get(standbys.actors[0].pid.remote()) != gone
    _step(session, reference, params, 3)
    _held_by_a_fresh_standby(client, 0, gone, standbys, sessions=2)
    alone.push_pull(make_grads(params, 1))  # it had no standby to lose: one copy, as it asked

    promoted = ray.get(standbys.actors[1].pid.remote())
    _kill_primary(refusing_server, 1)  # the other shard's primary lost: its standby is promoted
    _step(session, reference, params, 4)
    late.push_pull(make_grads(params, 1))
    assert refusing_server.fleet.pids()[1] == promoted
    _held_by_a_fresh_standby(client, 1, promoted, standbys, sessions=2)
    with pytest.raises(SessionLostError, match="created with replicas=1"):
        alone.push_pull(make_grads(params, 2))
    client.close_session(f"{unique_name}-alone")
    client.close_session(f"{unique_name}-late")

    for step in range(5, 8):
        _step(session, reference, params, step)
    assert session.status().version == 8  # every step once: none lost, none twice
    client.close_session(unique_name)


def test_with_refuse_a_session_whose_stream_was_cut_waits_until_its_live_standby_is_caught_up_again(
        refusing_server, unique_name):
    # Both processes live: each step is acknowledged once the same standby process holds the
    # session again (caught up from its primary's memory), not with one copy and not never.
    import ray

    client = Client(refusing_server.address, timeout=120.0)
    params = make_params(9)
    session = client.create_session(unique_name, params, optimizer=ADAM)
    reference = InProcess(ADAM["name"], ADAM["args"], params)
    for step in range(3):
        _step(session, reference, params, step)
    _in_sync(client, 0)
    standbys = refusing_server.fleet.standbys
    standby_pid = ray.get(standbys.actors[0].pid.remote())
    _cut_stream_to_standby(refusing_server, 0)
    for step in range(3, 6):
        _step(session, reference, params, step)
    assert ray.get(standbys.actors[0].pid.remote()) == standby_pid  # the same process, caught up again
    _in_sync(client, 0)
    _kill_primary(refusing_server, 0)  # it serves in its place, holding every acknowledged step
    for step in range(6, 8):
        _step(session, reference, params, step)
    assert session.status().version == 8
    client.close_session(unique_name)


def test_a_session_asking_for_two_replicas_on_a_server_with_one_is_refused_naming_the_flag(server, unique_name):
    client = Client(server.address)
    with pytest.raises(FailedPreconditionError, match="asks for replicas=2.*--replicas 1"):
        client.create_session(unique_name, make_params(2), optimizer=ADAM, replicas=2)
    assert unique_name not in client.list_sessions()
    alone = client.create_session(unique_name, make_params(2), optimizer=ADAM)
    assert (alone.options.replicas, alone.info.hot_standby) == (1, False)
    client.close_session(unique_name)


def test_on_one_replica_refuse_without_replicas_is_refused_in_one_line():
    with pytest.raises(InvalidArgument, match="--on-one-replica refuse .* needs --replicas 2"):
        ServerConfig(on_one_replica="refuse")
    with pytest.raises(InvalidArgument, match="--on-one-replica must be one of continue, refuse"):
        ServerConfig(replicas=2, on_one_replica="wait")
