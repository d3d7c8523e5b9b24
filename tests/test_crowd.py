"""A crowd of clients that pause between steps (more open calls than a shard's threads) never
stalls: no step waits out a vote timeout because a peer shard's part of it sat unseen in gRPC's
queue behind idle calls (the stall this guards against lasts ``vote_timeout_s``, 8 s here)."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the repository root: bench/
from bench import crowd  # noqa: E402

pytestmark = pytest.mark.serial  # bounds the slowest step of 64 clients

STALL_S = 5.0  # far above a step here (tens of ms), below the fixture server's vote timeout


def test_sixty_four_pausing_clients_in_threads_never_stall(server):
    times = crowd.run(server.address, clients=64, steps=5, max_pause_s=1.5, processes=False, seed=7)
    assert len(times) == 64 * 5
    assert max(times) < STALL_S, crowd.summary(times)
