"""A shard actor killed by Ray's memory monitor (the node past ``RAY_memory_usage_threshold``) is a
shard death like a SIGKILL: the server sees it, the shard's sessions are lost and said so at once
(DATA_LOSS), and the shard is replaced. Ray raises OutOfMemoryError, not RayActorError, for every
later call to such an actor; the shard watch took that for a failure of its own, every second, and
never replaced the shard, so the session's client retried UNAVAILABLE for an hour (found at a
billion parameters on the NumPy path, where the node ran out of memory)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from optserve.client import Client, SessionLostError, UnavailableError
from tests._server_process import ServerProcess

GIB = 1 << 30


def _meminfo() -> dict[str, int]:
    with open("/proc/meminfo") as fh:
        return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in fh}


def test_a_shard_killed_by_rays_memory_monitor_loses_its_session_at_once_and_is_replaced():
    info = _meminfo()
    used, total = info["MemTotal"] - info["MemAvailable"], info["MemTotal"]
    # the server's start (its Ray, two shard actors, JAX) fits below the threshold; a 1 GiB session
    # (the client's arrays, its two regions, the shard's copy: about 4 GiB) does not
    threshold = (used + 3 * GIB) / total
    if threshold > 0.9 or info["MemAvailable"] < 8 * GIB:
        pytest.skip(f"needs 8 GiB of free memory for a threshold the test can cross (has {info['MemAvailable'] / GIB:.1f})")
    server = ServerProcess(env={"RAY_memory_usage_threshold": f"{threshold:.4f}"}).wait_listening()
    try:
        params = {f"w{i}": np.full((4096, 4096), 0.5, np.float32) for i in range(16)}  # 1 GiB
        with Client(server.address, timeout=30) as client:
            started = time.monotonic()
            try:  # the monitor kills a shard while the session is initialized or stepping
                session = client.create_session("oom", params, optimizer={"name": "sgd",
                                                                          "args": {"learning_rate": 0.1}})
                while time.monotonic() - started < 120:
                    session.push_pull(params)
            except (SessionLostError, UnavailableError):  # lost, or its initial values never arrived
                pass
            del params
            # the session is lost, said at once (before: UNAVAILABLE, retried for the client's timeout)
            with pytest.raises(SessionLostError, match="died"):
                client.session("oom").pull()
        output = server.output()
        assert "event=shard_died" in output and "event=shard_watch_failed" not in output, output[-4000:]
    finally:
        server.kill_group()
