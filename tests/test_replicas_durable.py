"""Hot standbys on a durable server (``--replicas 2 --checkpoint-dir``): a standby writes no files
while it follows; when its primary is SIGKILLed it is promoted under a new ownership epoch, takes
the shard's files (a checkpoint of its state, the log going on after it), and serves at once,
while a session it did not hold (``replicas=1``) is restored from its files on it. A later
restart of the whole server from the same folder restores every session exactly where it was.

One server of its own per test (its shards are killed), shards and standbys on this one Ray node
(``replica_same_node``). Parameters equal an uninterrupted in-process run (1e-6).
"""

from __future__ import annotations

import os
import signal
import time

from optserve.client import Client
from optserve.server.domain.config import ServerConfig
from optserve.server.domain.durability import DurabilityConfig
from optserve.server.storage.ownership import current_epoch
from tests._service_helpers import REPLICA_SILENCE_S, InProcess, make_params, train_alike

ADAM = {"name": "adam", "args": {"learning_rate": 0.01}}


def _start(checkpoint_dir: str, **options):
    from optserve.server.app import start_server

    return start_server(ServerConfig(host="127.0.0.1", port=0, shards=2, vote_timeout_s=20.0, min_shard_bytes=0,
                                     replicas=2, replica_same_node=True, replica_silence_s=REPLICA_SILENCE_S,
                                     durability=DurabilityConfig(checkpoint_dir, every_steps=3), **options))


def _in_sync(client, index: int, timeout_s: float = 120.0):
    """Shard ``index``'s standby once it answers and holds its replicated sessions in sync."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        shard = client.server_status()[index]
        standby = shard.standby
        if standby is not None and standby.healthy and standby.replicated > 0 and standby.in_sync == standby.replicated:
            return standby
        time.sleep(0.2)
    raise AssertionError(f"shard {index}'s standby is not in sync after {timeout_s} s: {shard}")


def test_a_durable_shard_killed_is_served_by_its_standby_which_takes_its_files_and_a_restart_restores_it(
        ray_local, tmp_path, unique_name):
    import ray

    checkpoint_dir = str(tmp_path / "ckpt")
    server = _start(checkpoint_dir)
    try:
        client = Client(server.address, timeout=90.0)
        params = make_params(6)
        two = client.create_session(unique_name, params, optimizer=ADAM)
        one = client.create_session(f"{unique_name}-one", params, optimizer=ADAM, replicas=1)
        assert len(two.info.shards) == 2 and len(one.info.shards) == 2
        ref_two = InProcess(ADAM["name"], ADAM["args"], params)
        ref_one = InProcess(ADAM["name"], ADAM["args"], params)
        train_alike(two, ref_two, params, range(4))
        train_alike(one, ref_one, params, range(4))
        _in_sync(client, 0)
        standby_pid = ray.get(server.fleet.standbys.actors[0].pid.remote())
        epoch = current_epoch(checkpoint_dir, 0)
        os.kill(server.fleet.pids()[0], signal.SIGKILL)  # shard 0: the home of both sessions
        train_alike(two, ref_two, params, range(4, 9))  # the first spans the fail-over
        assert server.fleet.pids()[0] == standby_pid  # served by the promoted standby, not a restarted shard
        assert current_epoch(checkpoint_dir, 0) == epoch + 1  # it owns the shard's files: the old primary is fenced
        train_alike(one, ref_one, params, range(4, 9))  # restored from its files on the promoted standby, not lost
        _in_sync(client, 0)  # a fresh standby, caught up from the promoted one's memory
        train_alike(two, ref_two, params, range(9, 11))
        assert (two.status().version, one.status().version) == (11, 9)
        client.close()
    finally:
        server.stop()
    server = _start(checkpoint_dir)  # the whole server again: each session from its files, where it was
    try:
        client = Client(server.address, timeout=90.0)
        two = client.session(unique_name)
        one = client.session(f"{unique_name}-one")
        assert (two.status().version, one.status().version) == (11, 9)
        for index in range(2):  # the restored replicas=2 session is held by fresh standbys again
            assert _in_sync(client, index).replicated == 1
        train_alike(two, ref_two, params, range(11, 13))
        train_alike(one, ref_one, params, range(9, 11))
        client.close_session(unique_name)
        client.close_session(f"{unique_name}-one")
        client.close()
    finally:
        server.stop()


def test_an_idle_session_unloaded_and_loaded_back_is_held_by_its_standbys_again(ray_local, tmp_path, unique_name):
    """``--session-idle-s``: a session freed on its shards (and standbys) while idle is restored
    from its files on its next step, and its standbys hold it again: a shard killed after that
    is served by its standby with nothing lost."""
    server = _start(str(tmp_path / "ckpt"), session_idle_s=1.5)
    try:
        client = Client(server.address, timeout=90.0)
        params = make_params(7)
        reference = InProcess(ADAM["name"], ADAM["args"], params)
        session = client.create_session(unique_name, params, optimizer=ADAM)
        train_alike(session, reference, params, range(3))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and sum(s.sessions for s in client.server_status()) > 0:
            time.sleep(0.25)
        assert sum(s.sessions for s in client.server_status()) == 0  # unloaded
        train_alike(session, reference, params, range(3, 5))  # loaded back
        _in_sync(client, 1)
        os.kill(server.fleet.pids()[1], signal.SIGKILL)
        train_alike(session, reference, params, range(5, 8))
        assert session.status().version == 8
        client.close_session(unique_name)
        client.close()
    finally:
        server.stop()
