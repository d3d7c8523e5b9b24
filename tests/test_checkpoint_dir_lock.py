"""One server per ``--checkpoint-dir``: the folder's lock (:mod:`optserve.server.storage.dir_lock`)
refuses a second holder naming the first, and a holder that died leaves nothing behind. Real
processes and real ``flock``, nothing mocked. With real servers (a second ``optserve serve`` on the
folder refused, a killed server's lock taken over): tests/test_durability_restart.py."""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import subprocess
import sys

import pytest

from optserve.server.storage.dir_lock import LOCK_NAME, DirectoryLocked, DirLock, LockHolder

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
