"""A disk whose writes fail after the space was reserved, for real: the checkpoint directory on an
ext4 filesystem (no journal, ``errors=continue``) on a loop device whose backing file lies on a
small tmpfs. The filesystem sees free space and takes the step log's reservation, but once the
tmpfs is full the device fails the step's direct write (the kernel logs an I/O error): a write
failing *during* a step, the fault the reservation cannot turn away (a thin-provisioned or failing
disk).

The step being written is applied on its shard but not acknowledged (UNAVAILABLE naming the folder
and the cause); while the disk fails no further push is applied anywhere; once space is back the
session recovers by itself (it checkpoints everything it applied and logs on after it), the SDK's
retry goes through, and after a SIGKILL the restored session equals the uninterrupted reference
with every step applied exactly once."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import time

import numpy as np
import pytest

from optserve.client import Client
from optserve.client.errors import UnavailableError
from bench.filesystems import fill
from tests._server_process import ServerProcess
from tests._service_helpers import InProcess, make_grads, max_abs_diff


OPTIMIZER = {"name": "adam", "args": {"learning_rate": 0.01}}
SHAPES = {"w": (256, 256), "b": (256,)}  # w's record (256 KiB) goes to the disk with direct I/O


def _run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(command), capture_output=True, text=True)


@pytest.fixture
def thin_disk(tmp_path):
    """(mount point of the ext4 filesystem, folder of the tmpfs that backs it)."""
    backing, mount = tmp_path / "backing", tmp_path / "disk"
    backing.mkdir()
    mount.mkdir()
    image = backing / "disk.img"
    done: list[list[str]] = []
    try:
        for command, undo in (
                (["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(backing)], ["umount", "-l", str(backing)]),
                (["truncate", "-s", "128M", str(image)], None),
                (["mkfs.ext4", "-q", "-F", "-O", "^has_journal", str(image)], None)):
            result = _run(*command)
            if result.returncode != 0:
                pytest.skip(f"this machine cannot build a thin disk ({' '.join(command[:2])}): "
                            f"{result.stderr.strip()}")
            if undo:
                done.append(undo)
        loop = _run("losetup", "-f", "--show", str(image))
        if loop.returncode != 0:
            pytest.skip(f"this machine has no loop device: {loop.stderr.strip()}")
        device = loop.stdout.strip()
        done.append(["losetup", "-d", device])
        mounted = _run("mount", "-o", "errors=continue", device, str(mount))
        if mounted.returncode != 0:
            pytest.skip(f"this machine cannot mount a loop device: {mounted.stderr.strip()}")
        done.append(["umount", "-l", str(mount)])
        yield str(mount), str(backing)
    finally:
        for undo in reversed(done):
            _run(*undo)


def test_a_write_failing_mid_step_is_not_acknowledged_applies_nothing_more_and_recovers_by_itself(thin_disk):
    mount, backing = thin_disk
    root = os.path.join(mount, "ckpt")
    rng = np.random.default_rng(5)
    params = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}
    reference = InProcess(OPTIMIZER["name"], OPTIMIZER["args"], params)
    # --fsync step: a record that went through the page cache meets the failing device at its fsync
    server = ServerProcess("--checkpoint-dir", root, "--checkpoint-every-steps", "1000", "--fsync", "step",
                           "--log-io", "direct").wait_listening()
    restarted = None
    try:
        with Client(server.address, timeout=60.0) as client:
            session = client.create_session("thin-disk", params, optimizer=OPTIMIZER)
            for step in range(2):
                expected = reference.step(make_grads(params, step))
                session.push_pull(make_grads(params, step))

            filler = fill(backing, leave_bytes=64 << 10)  # less than w's record: its write fails
            with Client(server.address, timeout=4.0) as impatient:  # the SDK retries UNAVAILABLE this long
                started = time.monotonic()
                with pytest.raises(UnavailableError) as failed:
                    impatient.session("thin-disk").push_pull(make_grads(params, 2))
                assert time.monotonic() - started < 30
            assert root in str(failed.value) and "not durable" in str(failed.value), failed.value
            expected = reference.step(make_grads(params, 2))  # applied, not acknowledged
            assert max_abs_diff(session.pull(), expected) <= 1e-6  # (the next sync push builds on it)
            status = session.status()
            assert [s.version for s in status.shards] == [3, 3]
            degraded = [s.durability.degraded for s in status.shards if s.durability.degraded]
            assert degraded and all(d.startswith("disk: ") and root in d for d in degraded), degraded
            # the step log's refusal is an expected condition: one line naming it (no traceback)
            failures = [line for line in server.output().splitlines() if "event=step_log_failed" in line]
            assert failures and all("error=OSError" in line for line in failures), failures

            # While the disk fails, nothing more is applied: the SDK keeps retrying this step.
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pending = pool.submit(session.push_pull, make_grads(params, 3))
                time.sleep(3.0)
                assert not pending.done() and [s.version for s in session.status().shards] == [3, 3]
                os.unlink(filler)  # no restart, no operator action beyond the space
                expected = reference.step(make_grads(params, 3))
                assert max_abs_diff(pending.result(timeout=60), expected) <= 1e-6
            expected = reference.step(make_grads(params, 4))
            assert max_abs_diff(session.push_pull(make_grads(params, 4)), expected) <= 1e-6
            status = session.status()
            assert [s.version for s in status.shards] == [5, 5]
            assert all(s.durability.degraded == "" for s in status.shards)
        server.kill_group()

        restarted = ServerProcess("--checkpoint-dir", root, "--checkpoint-every-steps", "1000").wait_listening()
        with Client(restarted.address, timeout=30.0) as client:
            session = client.session("thin-disk")
            assert session.version == 5
            assert max_abs_diff(session.pull(), expected) <= 1e-6  # each step once, every acknowledged one
            session.detach()
    finally:
        server.kill_group()
        if restarted is not None:
            restarted.kill_group()


def test_write_ahead_a_step_whose_write_fails_is_applied_nowhere_on_its_shard_and_once_when_the_disk_works(
        thin_disk):
    """``--write-ahead``: the shard whose record failed keeps the state before the step (its
    version does not move; a shard whose record was written applied it), nothing more is applied
    while the disk fails, and once it works the shard applies the step (logged first) exactly once
    before the next one, with the gradient it was pushed with (not what the client wrote into its
    shared-memory buffers since); a restart from that log equals the reference."""
    mount, backing = thin_disk
    root = os.path.join(mount, "ckpt")
    rng = np.random.default_rng(6)
    params = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}
    reference = InProcess(OPTIMIZER["name"], OPTIMIZER["args"], params)
    flags = ("--checkpoint-dir", root, "--checkpoint-every-steps", "1000", "--fsync", "step", "--log-io", "direct")
    server = ServerProcess(*flags, "--write-ahead").wait_listening()
    restarted = None
    try:
        with Client(server.address, timeout=60.0) as client, Client(server.address, timeout=4.0) as impatient:
            session = client.create_session("write-ahead", params, optimizer=OPTIMIZER)
            for step in range(2):
                before = reference.step(make_grads(params, step))
                session.push_pull(make_grads(params, step))
            holds_w = next(s.index for s in session.status().shards if "w" in s.tensors)

            # A full backing tmpfs fails a write to blocks it does not hold yet; blocks the disk
            # held before (a file written and deleted earlier) still take one, so a step may go
            # through: it is applied and acknowledged, and the next one is tried.
            handle = impatient.session("write-ahead")
            step = 2
            for _ in range(8):
                filler = fill(backing, leave_bytes=0)
                try:
                    got = handle.push_pull(make_grads(params, step))  # through the client's shared-memory region
                except UnavailableError as exc:
                    failed = exc
                    break
                before = reference.step(make_grads(params, step))
                assert max_abs_diff(got, before) <= 1e-6
                os.unlink(filler)
                step += 1
            else:
                pytest.fail("the thin disk took every write")
            assert root in str(failed) and "applied nowhere" in str(failed), failed
            assert set(handle.data_paths().values()) == {"shared_memory"}
            for buffer in handle.gradient_buffers().values():  # the client moves on: its next gradient
                buffer[...] = 1e6  # goes into the region the failed push was read from
            shards = session.status().shards
            assert shards[holds_w].version == step and shards[holds_w].durability.degraded.startswith("disk: ")
            for shard in shards:  # a shard whose own record was written applied the step; none other did
                assert shard.version == (step if shard.durability.degraded else step + 1), shards
            assert max_abs_diff({"w": session.pull()["w"]}, {"w": before["w"]}) <= 1e-6  # applied nowhere

            # While the disk fails nothing more is applied; the next step (the clock decided the
            # failed one: a fresh handle builds on it) waits, and once space is back the shard
            # applies the failed step, logged first, and then the next one.
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pending = pool.submit(lambda: client.session("write-ahead").push_pull(make_grads(params, step + 1)))
                time.sleep(3.0)
                assert not pending.done() and session.status().shards[holds_w].version == step
                os.unlink(filler)
                reference.step(make_grads(params, step))
                expected = reference.step(make_grads(params, step + 1))
                assert max_abs_diff(pending.result(timeout=60), expected) <= 1e-6  # the failed step applied once
            status = session.status()
            assert [s.version for s in status.shards] == [step + 2, step + 2]
            assert all(s.durability.degraded == "" for s in status.shards)
        server.kill_group()

        restarted = ServerProcess(*flags).wait_listening()  # the log holds each step once, the cut record gone
        with Client(restarted.address, timeout=30.0) as client:
            session = client.session("write-ahead")
            assert session.version == step + 2
            assert max_abs_diff(session.pull(), expected) <= 1e-6
            session.detach()
    finally:
        server.kill_group()
        if restarted is not None:
            restarted.kill_group()
