"""Real full disks for the fault tests and the nemesis: a size-limited tmpfs, and a filler file
that takes its free space."""

from __future__ import annotations

import contextlib
import os
import subprocess
from typing import Iterator, Optional


def fill(folder: str, leave_bytes: int = 0, name: str = "filler") -> str:
    """Writes a filler file in ``folder`` until its filesystem is full (to the last byte: big
    writes, then pages, then bytes), then gives back ``leave_bytes``; returns the filler's path
    (delete it to free the space)."""
    path = os.path.join(folder, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (64 << 10, 4 << 10, 1):
            block = b"\0" * size
            while True:
                try:
                    os.write(fd, block)
                except OSError:
                    break
    finally:
        os.close(fd)
    os.truncate(path, max(0, os.path.getsize(path) - leave_bytes))
    return path


@contextlib.contextmanager
def size_limited_tmpfs(mount_point: str, size: str) -> Iterator[Optional[str]]:
    """A tmpfs of ``size`` (e.g. "6m") mounted on ``mount_point`` (created), unmounted on exit;
    yields its path, or None with the reason in :data:`last_mount_error` when this machine cannot
    mount one (not root, no tmpfs)."""
    global last_mount_error
    os.makedirs(mount_point, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", mount_point],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        last_mount_error = mounted.stderr.strip() or f"mount exited {mounted.returncode}"
        yield None
        return
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", mount_point], capture_output=True)


last_mount_error = ""
