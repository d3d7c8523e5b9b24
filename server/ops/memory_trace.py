"""Where a process's Python memory goes over a long run: tracemalloc snapshots written on a period.

A diagnostic for growth that ``scripts/smaps_diff.py`` finds in anonymous memory. With
``OPTSERVE_TRACEMALLOC_DIR`` set in the server's environment, :func:`start_from_environment` in the
server process and in each shard actor (the fleet passes the ``OPTSERVE_TRACEMALLOC_*`` variables
to them: :func:`environment`) starts tracing its allocations with ``OPTSERVE_TRACEMALLOC_FRAMES``
frames each (default 8, at most 65535) and writes a snapshot to
``DIR/<label>-<pid>-<number, from 0000>-<seconds since start>s.snap`` at start and then every
``OPTSERVE_TRACEMALLOC_EVERY_S`` seconds (default 300); DIR is a path on each process's own node.
``python scripts/tracemalloc_diff.py OLD NEW`` prints what grew between two, by the line that
allocated it. Tracing costs each Python allocation several times its usual time and holds a
traceback per live block: for a soak, not for serving.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
import tracemalloc
from typing import Optional

from optserve.server.ops.periodic import Periodic

log = logging.getLogger(__name__)

DIR_ENV = "OPTSERVE_TRACEMALLOC_DIR"
FRAMES_ENV = "OPTSERVE_TRACEMALLOC_FRAMES"
EVERY_ENV = "OPTSERVE_TRACEMALLOC_EVERY_S"
MAX_FRAMES = 65535  # tracemalloc's own limit


class SnapshotWriter(Periodic):
    """Writes a tracemalloc snapshot of this process into ``folder`` every ``every_s`` seconds."""

    failure_event = "tracemalloc_snapshot_failed"

    def __init__(self, folder: str, label: str, every_s: float, started_tracing: bool = False):
        super().__init__(f"optserve-tracemalloc-{label}", every_s)
        self.folder, self.label = folder, label
        self._started_tracing = started_tracing
        self._started = time.monotonic()
        self._numbers = itertools.count()  # next() is atomic: the period's thread and a caller may both write

    def check_once(self) -> str:
        """Writes one snapshot now; returns its path."""
        seconds = int(time.monotonic() - self._started)
        path = os.path.join(self.folder, f"{self.label}-{os.getpid()}-{next(self._numbers):04d}-{seconds:06d}s.snap")
        tracemalloc.take_snapshot().dump(path + ".part")
        os.replace(path + ".part", path)  # a reader never sees half a snapshot
        return path

    def stop(self) -> None:
        """Ends the snapshots, and the tracing when this writer started it."""
        super().stop()
        if self._started_tracing:
            tracemalloc.stop()


def start_from_environment(label: str) -> Optional[SnapshotWriter]:
    """Starts tracing and the snapshots when ``OPTSERVE_TRACEMALLOC_DIR`` is set (else None).

    Raises:
      ValueError: ``OPTSERVE_TRACEMALLOC_FRAMES`` or ``OPTSERVE_TRACEMALLOC_EVERY_S`` is not a
        positive number within its bound (naming the variable).
      OSError: the folder or the first snapshot cannot be written (tracing is stopped again).
    """
    folder = os.environ.get(DIR_ENV)
    if not folder:
        return None
    frames = _positive(FRAMES_ENV, "8", int, MAX_FRAMES)
    every_s = _positive(EVERY_ENV, "300", float, threading.TIMEOUT_MAX)
    os.makedirs(folder, exist_ok=True)
    started_tracing = not tracemalloc.is_tracing()
    if started_tracing:
        tracemalloc.start(frames)
    writer = SnapshotWriter(folder, label, every_s, started_tracing)
    try:
        writer.check_once()
    except BaseException:
        if started_tracing:
            tracemalloc.stop()
        raise
    log.warning("event=tracemalloc_tracing label=%s folder=%s every_s=%s frames=%d", label, folder, every_s, frames)
    return writer.start()


def environment() -> dict[str, str]:
    """The ``OPTSERVE_TRACEMALLOC_*`` variables set in this process (for the shard actors' own
    environment, which on a Ray cluster started elsewhere is not the server's)."""
    return {name: os.environ[name] for name in (DIR_ENV, FRAMES_ENV, EVERY_ENV) if os.environ.get(name)}


def _positive(name: str, default: str, kind, largest: float):
    text = os.environ.get(name, default)
    try:
        value = kind(text)
    except ValueError:
        value = 0
    if not (0 < value <= largest and math.isfinite(value)):
        raise ValueError(f"{name}={text!r}: expected a {kind.__name__} above 0 and at most {largest:g}")
    return value
