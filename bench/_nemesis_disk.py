"""The nemesis's disk: the checkpoint directory on a small filesystem of its own, the rig of
tests/test_disk_write_failure.py. An ext4 filesystem (no journal, ``errors=continue``, ``discard``)
on a loop device whose backing file lies on a tmpfs a little larger than it:

- **disk full** (:meth:`DiskRig.fill_disk`): the ext4 filesystem is filled; the step log has no room
  (ENOSPC at its reservation);
- **write error** (:meth:`DiskRig.fail_writes`): the tmpfs under the loop device is filled; the
  filesystem still sees free space, but a write to a block the backing file does not hold yet fails
  with EIO (a thin-provisioned or failing disk);

each undone by deleting the filler. Building it needs root (mount, losetup); :func:`build` says
why not where it cannot.
"""

from __future__ import annotations

import os
import subprocess
from typing import Optional, Union

from bench.filesystems import fill

IMAGE_MB = 64
BACKING_MB = 96  # the image's blocks all fit: only a filler makes its writes fail


def _run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(command), capture_output=True, text=True)


class DiskRig:
    """The mounted rig: ``mount`` (the ext4 filesystem) and ``backing`` (the tmpfs under it)."""

    def __init__(self, mount: str, backing: str, undo: list[list[str]]):
        self.mount, self.backing = mount, backing
        self._undo = undo
        self._fillers: list[str] = []

    def fill_disk(self) -> None:
        self._fillers.append(fill(self.mount, leave_bytes=4 << 10, name="nemesis-filler"))

    def fail_writes(self) -> None:
        self._fillers.append(fill(self.backing, name="nemesis-filler"))

    def free(self) -> None:
        while self._fillers:
            try:
                os.unlink(self._fillers.pop())
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.free()
        for command in reversed(self._undo):
            _run(*command)


def build(folder: str) -> Union[DiskRig, str]:
    """Mounts the rig under ``folder``; returns it, or a one-line reason it cannot be built here."""
    if os.geteuid() != 0:
        return "needs root (mount, losetup)"
    backing, mount = os.path.join(folder, "backing"), os.path.join(folder, "disk")
    os.makedirs(backing, exist_ok=True)
    os.makedirs(mount, exist_ok=True)
    image = os.path.join(backing, "disk.img")
    undo: list[list[str]] = []

    def fail(why: str) -> str:
        for command in reversed(undo):
            _run(*command)
        return why

    steps = ((["mount", "-t", "tmpfs", "-o", f"size={BACKING_MB}m", "tmpfs", backing], ["umount", "-l", backing]),
             (["truncate", "-s", f"{IMAGE_MB}M", image], None),
             (["mkfs.ext4", "-q", "-F", "-O", "^has_journal", image], None))
    try:
        for command, undone_by in steps:
            if undone_by:  # before it runs: stopped while it runs (SIGTERM), it is undone all the same
                undo.append(undone_by)
            result = _run(*command)
            if result.returncode != 0:
                return fail(f"{' '.join(command[:2])} failed: {result.stderr.strip()[:120]}")
        loop = _run("losetup", "-f", "--show", image)
        if loop.returncode != 0:
            return fail(f"no loop device: {loop.stderr.strip()[:120]}")
        device: Optional[str] = loop.stdout.strip()
        undo.append(["losetup", "-d", device])
        undo.append(["umount", "-l", mount])
        mounted = _run("mount", "-o", "errors=continue,discard", device, mount)
        if mounted.returncode != 0:
            return fail(f"cannot mount the loop device: {mounted.stderr.strip()[:120]}")
        return DiskRig(mount, backing, undo)
    except BaseException:  # stopped midway (SystemExit from a signal, KeyboardInterrupt): nothing left mounted
        fail("")
        raise
