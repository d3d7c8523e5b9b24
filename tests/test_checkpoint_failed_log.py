"""A checkpoint that a full disk refuses, for real (a size-limited tmpfs filled nearly to the last
byte): the shard logs one line naming the cause, not a traceback with tensorstore's whole spec
(a long outage used to fill the log with them), and the store keeps the error for its status."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from bench import filesystems
from optserve.server.domain.durability import DurabilityConfig, ShardProgress
from optserve.server.storage import ShardStore



@pytest.fixture
def tiny_disk(tmp_path):
    with filesystems.size_limited_tmpfs(str(tmp_path / "disk"), "2m") as mount:
        if mount is None:
            pytest.skip(f"this machine cannot mount a size-limited tmpfs: {filesystems.last_mount_error}")
        yield mount


def test_a_checkpoint_refused_by_a_full_disk_is_logged_in_one_line(tiny_disk, caplog):
    store = ShardStore(tiny_disk, "full", 0, DurabilityConfig(tiny_disk), home=False)
    store.start_logs(None)
    filler = filesystems.fill(tiny_disk, leave_bytes=64 << 10)  # room for the log's fresh segments only
    params = {"w": np.ones(1 << 18, np.float32)}  # 1 MiB
    with caplog.at_level(logging.ERROR, logger="optserve.server.storage.shard_store"):
        store.checkpoint(ShardProgress(1, 0, {}), params, {"m": np.zeros(1 << 18, np.float32)}, wait=True)
    failed = [r for r in caplog.records if "event=checkpoint_failed" in r.getMessage()]
    assert failed, [r.getMessage() for r in caplog.records]
    for record in failed:
        message = record.getMessage()
        assert record.exc_info is None, message
        assert "\n" not in message and "tensorstore_spec" not in message, message
        assert "error=" in message and ("No space left" in message or "os_error_code" in message), message
    assert store.durable_version == -1 and store.last_error
    store.close()
    os.remove(filler)


_REFUSED_CHECKPOINTS = """
import logging, sys
import numpy as np
from optserve.server.domain.durability import DurabilityConfig, ShardProgress
from optserve.server.storage import ShardStore

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
root = sys.argv[1]
store = ShardStore(root, "full", 0, DurabilityConfig(root), home=False)
store.start_logs(None)
for version in range(1, 4):
    store.checkpoint(ShardProgress(version, 0, {}), {"w": np.ones(1 << 18, np.float32)},
                     {"m": np.zeros(1 << 18, np.float32), "v": np.zeros(1 << 18, np.float32)}, wait=True)
print("durable", store.durable_version, flush=True)
"""


def test_a_process_whose_checkpoints_a_full_disk_refuses_prints_no_traceback(tiny_disk):
    """What the storage libraries report themselves while their writes fail and the process ends
    (orbax's writer threads, asyncio's unretrieved futures, tensorstore's callbacks that find their
    event loop closed) is one line each too, nothing of it a traceback."""
    import subprocess
    import sys

    filler = filesystems.fill(tiny_disk, leave_bytes=64 << 10)
    try:
        result = subprocess.run([sys.executable, "-c", _REFUSED_CHECKPOINTS, tiny_disk], capture_output=True,
                                text=True, timeout=300)
    finally:
        os.remove(filler)
    assert result.returncode == 0 and "durable -1" in result.stdout, result.stdout + result.stderr[-3000:]
    assert "event=checkpoint_failed" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
