"""Filling a real filesystem for the disk-fault tests."""

from __future__ import annotations

import os


def fill(folder: str, leave_bytes: int) -> str:
    """Writes a filler file in ``folder`` until its filesystem is full, then gives back
    ``leave_bytes``; returns the filler's path (delete it to free the space)."""
    path = os.path.join(folder, "filler")
    chunk = b"\0" * (64 << 10)
    with open(path, "wb") as fh:
        try:
            while True:
                fh.write(chunk)
                fh.flush()
        except OSError:
            pass
    os.truncate(path, max(0, os.path.getsize(path) - leave_bytes))
    return path
