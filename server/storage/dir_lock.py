"""One server per checkpoint folder: an exclusive lock on ``DIR/optserve.lock`` held for the
server's lifetime.

Two coordinators writing the same folder corrupt each other's sessions (one's checkpoint deletes
the log segment the other appends to), so a server takes :class:`DirLock` before it starts Ray or
writes anything there, and a second one is refused with :class:`DirectoryLocked`, which names the
holder (its pid, host and start time, read from the lock file).

The lock is ``flock(LOCK_EX | LOCK_NB)`` on the lock file, kept open by the holding process. The
kernel drops it when that process exits, however it exits (SIGKILL included), so a holder that
died leaves no lock behind: the next server takes it at once and only finds the dead holder's
record in the file (logged, then overwritten). A clean release empties the file. The file itself is
never deleted: a process that opened it just before a deletion would lock an orphaned inode while
another locks a new file, and both would run.

``flock`` locks belong to an open file description, so two opens in one process conflict as two
processes do. On NFS, Linux maps ``flock`` onto byte-range locks that the server arbitrates.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import logging
import os
import socket
import time
from typing import Optional

log = logging.getLogger(__name__)

LOCK_NAME = "optserve.lock"
_RECORD_WAIT_S = 1.0  # how long a refused server waits for a just-started holder to write its record


@dataclasses.dataclass(frozen=True)
class LockHolder:
    """Who holds (or last held) a checkpoint folder: the record in its lock file."""

    pid: int
    host: str
    started_unix_s: float

    @classmethod
    def of_this_process(cls) -> "LockHolder":
        return cls(os.getpid(), socket.gethostname(), time.time())

    def encode(self) -> bytes:
        return (json.dumps(dataclasses.asdict(self), sort_keys=True) + "\n").encode()

    @classmethod
    def decode(cls, data: bytes) -> Optional["LockHolder"]:
        """The record in ``data``; None for an empty, partly written or foreign file."""
        try:
            fields = json.loads(data.decode())
            return cls(int(fields["pid"]), str(fields["host"]), float(fields["started_unix_s"]))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def describe(self) -> str:
        """E.g. ``pid 4242 on host worker-3, started 2026-11-25 04:41:54 UTC``."""
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started_unix_s))
        return f"pid {self.pid} on host {self.host}, started {started}"


class DirectoryLocked(Exception):
    """Another live process holds the checkpoint folder's lock."""

    def __init__(self, directory: str, holder: Optional[LockHolder]):
        self.directory = directory
        self.holder = holder
        who = holder.describe() if holder is not None else "a process that has not written its record"
        super().__init__(f"--checkpoint-dir {directory} is in use by another optserve server ({who}); "
                         f"one server per checkpoint folder")


def _read_record(fd: int) -> bytes:
    return os.pread(fd, 4096, 0)


class DirLock:
    """The exclusive lock on a checkpoint folder; :meth:`acquire` takes it, :meth:`release` gives
    it back (a ``with`` block does both).

    Attributes:
      directory: the checkpoint folder.
      path: its lock file.
      holder: this process's record, written into the lock file.
      previous: the record a holder that died without releasing left in the file (None: the lock
        file was new or released cleanly).
    """

    def __init__(self, directory: str, fd: int, holder: LockHolder, previous: Optional[LockHolder]):
        self.directory = directory
        self.path = os.path.join(directory, LOCK_NAME)
        self.holder = holder
        self.previous = previous
        self._fd: Optional[int] = fd

    @classmethod
    def acquire(cls, directory: str) -> "DirLock":
        """Creates ``directory`` if needed and locks it for this process.

        Raises:
          DirectoryLocked: another live process holds it (at once, never waits for it).
          OSError: the folder or its lock file cannot be created or opened.
        """
        os.makedirs(directory, exist_ok=True)
        fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise DirectoryLocked(directory, _holder_record(fd)) from None
            previous = LockHolder.decode(_read_record(fd))
            holder = LockHolder.of_this_process()
            os.ftruncate(fd, 0)
            os.pwrite(fd, holder.encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        if previous is not None:
            log.warning("event=checkpoint_dir_lock_taken_over dir=%s previous_pid=%d previous_host=%s "
                        "detail=\"the previous holder ended without releasing it (crashed or killed)\"",
                        directory, previous.pid, previous.host)
        return cls(directory, fd, holder, previous)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Empties the lock file and unlocks it; idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError:  # the record is only informative; unlocking is what matters
            pass
        finally:
            os.close(fd)  # closing the last descriptor of the open file releases the flock

    def __enter__(self) -> "DirLock":
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()


def _holder_record(fd: int) -> Optional[LockHolder]:
    """The record of the process holding the lock on ``fd``'s file, waiting briefly for a holder
    that locked the file but has not written its record yet."""
    deadline = time.monotonic() + _RECORD_WAIT_S
    while True:
        holder = LockHolder.decode(_read_record(fd))
        if holder is not None or time.monotonic() >= deadline:
            return holder
        time.sleep(0.05)
