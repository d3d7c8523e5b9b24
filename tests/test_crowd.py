"""A crowd of clients that pause between steps (more open calls than a shard's threads) never
stalls: no step waits out a vote timeout because a peer shard's part of it sat unseen in gRPC's
queue behind idle calls (the stall this guards against lasts ``vote_timeout_s``, 8 s here)."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the repository root: bench/
from bench import crowd  # noqa: E402
from bench._crowd_watch import ServerWatch  # noqa: E402

pytestmark = pytest.mark.serial  # bounds the slowest step of 64 clients

STALL_S = 5.0  # far above a step here (tens of ms), below the fixture server's vote timeout


def test_sixty_four_pausing_clients_in_threads_never_stall(server):
    times = crowd.run(server.address, clients=64, steps=5, max_pause_s=1.5, processes=False, seed=7)
    assert len(times) == 64 * 5
    assert max(times) < STALL_S, crowd.summary(times)


def test_a_crowd_of_async_sessions_and_an_elastic_sync_session_steps_and_is_measured(server):
    watch = ServerWatch(os.getpid())  # the fixture's server runs in this process, its shards below it
    layout = crowd.Layout(sessions=2, workers=3, sync_workers=2)
    phase = crowd.run_phase(server.address, watch, layout, procs=2, mean_pause_s=0.05, sync_pause_s=0.05,
                            duration_s=4.0, idle_wait_s=0.0)
    assert phase.errors == {} and phase.unfinished == 0
    assert phase.idle_clients == 0 and len(phase.sync_times) >= 2  # every client stepped, the sync ones too
    assert len(phase.async_times) >= 6
    # the watch found the shard actors below this process (its own CPU is the server's and pytest's)
    assert phase.threads.readings >= 2 and phase.threads.peak > 0 and phase.rss_bytes.peak > 0
