"""A full disk for real: the checkpoint directory on a size-limited tmpfs that the test fills.

While the step log has no room, a push is refused when it is staged (UNAVAILABLE naming the
directory and the cause) and applied on no shard; the session shows ``degraded``; once space is
freed the next push succeeds without a restart, and after a SIGKILL the restored session equals the
uninterrupted reference: nothing acknowledged was lost, nothing refused was applied."""

from __future__ import annotations

import concurrent.futures
import os
import time

import numpy as np
import pytest

from optserve.client import Client
from optserve.client.errors import UnavailableError
from bench import filesystems
from bench.filesystems import fill
from bench.process_session import session_pids, titled
from tests._server_process import ServerProcess
from tests._service_helpers import InProcess, make_grads, max_abs_diff


OPTIMIZER = {"name": "adam", "args": {"learning_rate": 0.01}}
SHAPES = {"w": (256, 256), "b": (256,)}


@pytest.fixture
def small_disk(tmp_path):
    with filesystems.size_limited_tmpfs(str(tmp_path / "disk"), "6m") as mount:
        if mount is None:
            pytest.skip(f"this machine cannot mount a size-limited tmpfs: {filesystems.last_mount_error}")
        yield mount


def test_a_full_disk_refuses_steps_applies_nothing_and_recovers_by_itself(small_disk):
    root = os.path.join(small_disk, "ckpt")
    rng = np.random.default_rng(4)
    params = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}
    reference = InProcess(OPTIMIZER["name"], OPTIMIZER["args"], params)
    server = ServerProcess("--checkpoint-dir", root, "--checkpoint-every-steps", "1000").wait_listening()
    restarted = None
    try:
        with Client(server.address, timeout=60.0) as client:
            session = client.create_session("full-disk", params, optimizer=OPTIMIZER)
            for step in range(2):
                expected = reference.step(make_grads(params, step))
                session.push_pull(make_grads(params, step))

            filler = fill(small_disk, leave_bytes=96 << 10)  # less than one step's record of w
            with Client(server.address, timeout=4.0) as impatient:  # the SDK retries UNAVAILABLE this long
                started = time.monotonic()
                with pytest.raises(UnavailableError) as refused:
                    impatient.session("full-disk").push_pull(make_grads(params, 2))
                assert time.monotonic() - started < 20
            assert "No space left on device" in str(refused.value) and root in str(refused.value), refused.value
            status = session.status()
            assert [s.version for s in status.shards] == [2, 2]  # applied nowhere
            assert any(s.durability.degraded.startswith("disk: ") for s in status.shards)
            assert max_abs_diff(session.pull(), expected) <= 1e-6

            # A step while the disk is full: the SDK keeps retrying it; freeing space lets it through.
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pending = pool.submit(session.push_pull, make_grads(params, 2))
                time.sleep(2.0)
                assert not pending.done() and [s.version for s in session.status().shards] == [2, 2]
                os.unlink(filler)  # no restart, no operator action beyond the space
                expected = reference.step(make_grads(params, 2))
                assert max_abs_diff(pending.result(timeout=60), expected) <= 1e-6
            expected = reference.step(make_grads(params, 3))
            assert max_abs_diff(session.push_pull(make_grads(params, 3)), expected) <= 1e-6
            status = session.status()
            assert [s.version for s in status.shards] == [4, 4]  # the refused pushes applied nowhere
            assert all(s.durability.degraded == "" for s in status.shards)
        tree = session_pids(server.process.pid)
        assert len(titled(tree, b"ray::ShardActor")) >= 2, tree
        server.kill_group()
        # the whole tree is gone at once, the shard actors too (Ray keeps them in process groups of
        # their own): none is left writing the directory the restarted server opens
        assert session_pids(server.process.pid) == []

        restarted = ServerProcess("--checkpoint-dir", root, "--checkpoint-every-steps", "1000").wait_listening()
        with Client(restarted.address, timeout=30.0) as client:
            session = client.session("full-disk")
            assert session.version == 4
            assert max_abs_diff(session.pull(), expected) <= 1e-6  # every acknowledged step, nothing more
            session.detach()
    finally:
        server.kill_group()
        if restarted is not None:
            restarted.kill_group()
