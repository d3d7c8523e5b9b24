"""One server per ``--checkpoint-dir``: the folder's lock (:mod:`optserve.server.storage.dir_lock`)
refuses a second holder naming the first, and a holder that died leaves nothing behind. Real
processes and real ``flock``, nothing mocked."""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests._server_process import ServerProcess
from optserve.server.storage.dir_lock import LOCK_NAME, DirectoryLocked, DirLock, LockHolder
from tests._service_helpers import InProcess, make_grads, make_params, max_abs_diff

# A process that takes the lock and holds it until it is killed.
_HOLD = ("import sys, time\n"
         "from optserve.server.storage.dir_lock import DirLock\n"
         "DirLock.acquire(sys.argv[1])\n"
         "print('locked', flush=True)\n"
         "time.sleep(600)\n")


def _hold_in_a_process(directory: str) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, directory], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


# ---------------------------------------------------------------------------------------------- units


def test_a_second_lock_in_the_same_process_is_refused_naming_the_holder_and_taken_after_release(tmp_path):
    directory = str(tmp_path / "ckpt")
    first = DirLock.acquire(directory)  # creates the folder
    assert first.held and os.path.isfile(os.path.join(directory, LOCK_NAME))
    assert first.holder.pid == os.getpid() and first.holder.host == socket.gethostname()
    assert first.previous is None
    with pytest.raises(DirectoryLocked) as refused:  # a second open file description: flock conflicts
        DirLock.acquire(directory)
    assert refused.value.holder == first.holder
    message = str(refused.value)
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in message
    assert directory in message and "\n" not in message
    first.release()
    first.release()  # idempotent
    assert not first.held
    with DirLock.acquire(directory) as second:
        assert second.previous is None  # released cleanly: no record left behind
        assert second.holder.pid == os.getpid()
    with open(os.path.join(directory, LOCK_NAME), "rb") as f:
        assert f.read() == b""


def test_the_lock_of_a_killed_holder_is_taken_over_and_its_record_logged(tmp_path, caplog):
    directory = str(tmp_path)
    holder = _hold_in_a_process(directory)
    try:
        with pytest.raises(DirectoryLocked) as refused:
            DirLock.acquire(directory)
        assert refused.value.holder.pid == holder.pid
        assert f"pid {holder.pid} on host {socket.gethostname()}" in str(refused.value)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    with caplog.at_level(logging.WARNING, logger="optserve.server.storage.dir_lock"):
        lock = DirLock.acquire(directory)  # the kernel released the dead holder's flock
    try:
        assert lock.previous is not None and lock.previous.pid == holder.pid
        assert any("event=checkpoint_dir_lock_taken_over" in r.getMessage()
                   and f"previous_pid={holder.pid}" in r.getMessage() for r in caplog.records)
        with open(os.path.join(directory, LOCK_NAME), "rb") as f:
            assert LockHolder.decode(f.read()) == lock.holder
    finally:
        lock.release()


def test_child_processes_do_not_inherit_the_lock(tmp_path):
    """The server's children (Ray's processes) must not keep the folder locked after it exits."""
    lock = DirLock.acquire(str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                             close_fds=False, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"  # running: past the exec that closed its copy
        lock.release()
        DirLock.acquire(str(tmp_path)).release()
    finally:
        child.kill()
        child.wait(timeout=30)


def test_a_holder_that_has_not_written_its_record_is_still_refused(tmp_path):
    fd = os.open(os.path.join(tmp_path, LOCK_NAME), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(DirectoryLocked) as refused:
            DirLock.acquire(str(tmp_path))
        assert refused.value.holder is None and "has not written its record" in str(refused.value)
    finally:
        os.close(fd)


def test_holder_records_round_trip_and_garbage_reads_as_none():
    record = LockHolder(1234, "node-7", 1_700_000_000.5)
    assert LockHolder.decode(record.encode()) == record
    assert "pid 1234 on host node-7, started 2023-11-14 22:13:20 UTC" == record.describe()
    for garbage in (b"", b"{", b"[]", b'{"pid": "x"}', b"\xff\xfe", b'{"pid": 1, "host": "h"}'):
        assert LockHolder.decode(garbage) is None


# ------------------------------------------------------------------------------------ real servers

OPTIMIZER = {"name": "adafactor_hf", "args": {"lr": 0.01, "relative_step": False, "beta1": 0.9}}


def _env() -> dict:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    env.pop("GRPC_VERBOSITY", None)
    return env


def _argv(checkpoint_dir: str) -> list[str]:
    return [sys.executable, "-m", "optserve.server.cli", "serve", "--port", "0", "--shards", "1",
            "--checkpoint-dir", checkpoint_dir, "--checkpoint-every-steps", "3"]


def _server(checkpoint_dir: str) -> ServerProcess:
    """``optserve serve`` on the folder (one shard), in a process session of its own, listening."""
    return ServerProcess(command=_argv(checkpoint_dir)).wait_listening()


@pytest.mark.slow
def test_one_server_per_checkpoint_dir_and_a_killed_servers_lock_is_taken_over(tmp_path):
    from optserve.client import Client

    checkpoint_dir = str(tmp_path / "ckpt")
    params = make_params(5)
    reference = InProcess(OPTIMIZER["name"], OPTIMIZER["args"], params)
    first = _server(checkpoint_dir)
    third = None
    try:
        # A second server on the folder is refused at once, naming the first; the first is untouched.
        started = time.monotonic()
        second = subprocess.run(_argv(checkpoint_dir), capture_output=True, text=True, timeout=120, env=_env())
        elapsed = time.monotonic() - started
        shown = f"stdout:\n{second.stdout[-3000:]}\nstderr:\n{second.stderr[-3000:]}"
        assert second.returncode == 2, shown
        assert second.stdout == "" and len(second.stderr.splitlines()) == 1, shown
        line = second.stderr.strip()
        assert line.startswith("optserve serve: could not start: ") and checkpoint_dir in line, line
        assert f"pid {first.process.pid} on host {socket.gethostname()}" in line, line
        assert elapsed < 10.0, f"{elapsed:.1f} s"

        client = Client(first.address, timeout=120.0)
        session = client.create_session("locked", params, optimizer=OPTIMIZER)
        for step in range(4):  # a checkpoint at 3, step 4 in the log
            grads = make_grads(params, step)
            got, expected = session.push_pull(grads), reference.step(grads)
            assert max_abs_diff(got, expected) <= 1e-6
        client.close()

        # The first dies without releasing: the next server takes the lock over and restores the session.
        first.kill_group()
        third = _server(checkpoint_dir)
        taken_over = [line for line in third.lines if "event=checkpoint_dir_lock_taken_over" in line]
        assert taken_over and f"previous_pid={first.process.pid}" in taken_over[0], "".join(third.lines[-30:])
        with Client(third.address, timeout=120.0) as fresh_client:
            assert fresh_client.list_sessions() == ["locked"]
            fresh = fresh_client.session("locked")
            assert fresh.version == 4
            for step in range(4, 6):
                grads = make_grads(params, step)
                got, expected = fresh.push_pull(grads), reference.step(grads)
            assert max_abs_diff(got, expected) <= 1e-6
            fresh.detach()
        third.process.send_signal(signal.SIGTERM)
        assert third.process.wait(timeout=120) == 0, "".join(third.lines[-30:])
        with DirLock.acquire(checkpoint_dir) as after:  # released at shutdown, cleanly
            assert after.previous is None
    finally:
        for server in (first, third):
            if server is not None:
                server.kill_group()
