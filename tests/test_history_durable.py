"""``Session.history`` of plain sync and async sessions on a durable server (``--checkpoint-dir``):
after the home shard's SIGKILL and restore, the history is the one the session had (versions
before the checkpoint from the checkpointed clock, later ones from the ticket journal), and a
replay of it reaches the served parameters. The same after a whole-server SIGKILL and restart:
tests/test_durability_restart.py (one restart shared by several checks)."""

from __future__ import annotations

import concurrent.futures
import os
import signal

import pytest

from optserve.client import Client
from tests._service_helpers import make_params, max_abs_diff
from tests.test_history_modes import (ADAM, async_pushes, check_async_history, check_sync_history, replay, rounds,
                                      sync_rounds)


@pytest.fixture(scope="module")
def durable_server(ray_local, tmp_path_factory):
    """A durable server of its own (a test kills its shards), a checkpoint every 3 steps."""
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig
    from optserve.server.domain.durability import DurabilityConfig

    running = start_server(ServerConfig(
        host="127.0.0.1", port=0, shards=2, vote_timeout_s=20.0, min_shard_bytes=0,
        durability=DurabilityConfig(str(tmp_path_factory.mktemp("history-checkpoints")), every_steps=3)))
    yield running
    running.stop()


def _steps(mode: str, a, b, params, start: int) -> None:
    """Sync: two rounds of both sessions; async: the four pushes of ``async_pushes``."""
    if mode == "sync":
        sync_rounds([a, b], params, 2)
    else:
        async_pushes(a, b, params, start)


def _check(mode: str, records, a, b, start: int) -> None:
    """The records of what :func:`_steps` from version ``start`` did."""
    if mode == "sync":
        check_sync_history(records, [a, b], start + 1, start + 2)
    else:
        check_async_history(records, a, b, start)


def _create(client: Client, name: str, mode: str, params):
    if mode == "sync":
        return client.create_session(name, params, ADAM, mode="sync", num_workers=2)
    return client.create_session(name, params, ADAM, mode="async", staleness_policy="scale")


def test_history_is_the_same_after_the_home_shard_is_killed_and_restored(durable_server, unique_name):
    """A sync and an async session with the same home shard (shard 0: placement puts a session's
    largest tensor there), one SIGKILL of it: each session's history call right after it rides out
    the restore (both asked at once), and each session goes on with the history it had."""
    params = make_params(47)
    modes = ("sync", "async")
    with Client(durable_server.address, timeout=90.0) as client:
        owners, workers, before = {}, {}, {}
        try:
            for mode in modes:
                name = f"{unique_name}-{mode}"
                owners[mode] = _create(client, name, mode, params)
                workers[mode] = tuple(client.session(name, worker_id=w) for w in ("a", "b"))
            for mode in modes:
                a, b = workers[mode]
                _steps(mode, a, b, params, 0)
                _steps(mode, a, b, params, a.status().version)  # a checkpoint at 3, later versions in logs and journal
                before[mode] = rounds(a.history())
            (home,) = {owner.info.shards[0].shard_index for owner in owners.values()}  # the same for both
            os.kill(durable_server.fleet.pids()[home], signal.SIGKILL)  # the home shard
            with concurrent.futures.ThreadPoolExecutor(len(modes)) as pool:  # the calls ride out the restore
                during = {mode: pool.submit(workers[mode][0].history) for mode in modes}
                for mode in modes:
                    assert rounds(during[mode].result(timeout=120)) == before[mode], mode
            for mode in modes:
                a, b = workers[mode]
                start = a.status().version
                _steps(mode, a, b, params, start)
                history = rounds(b.history())
                assert history[:len(before[mode])] == before[mode], mode
                _check(mode, history[len(before[mode]):], a, b, start)
                assert max_abs_diff(a.pull(), replay(ADAM, params, history)) <= 1e-6, mode
                home_durability = a.status().shards[0].durability
                assert home_durability is not None and home_durability.recoveries == 1, mode
        finally:
            for mode in workers:
                a, b = workers[mode]
                a.detach(), b.detach()
            for owner in owners.values():
                owner.close()
