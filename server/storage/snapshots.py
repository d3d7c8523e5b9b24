"""Host copies (or views) of a shard's state for checkpoints, and the writer threads' CPU priority."""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

_BACKGROUND_NICE = 19
_IO_THREAD_PREFIX = "ts_pool"  # tensorstore's I/O threads' names (orbax writes through them)


def yield_cpu_to_steps() -> None:
    """Lowers the CPU priority (nice 19) of the threads that write checkpoints: the calling one
    and tensorstore's (made at its first use), so a checkpoint written in the background takes
    the CPU the steps leave idle instead of slowing them down. Linux only (per-thread nice); a
    no-op elsewhere or when ``/proc`` cannot be read. (An unprivileged process cannot raise the
    priority back: those threads stay background threads, which restores can afford.)"""
    try:
        tids = [threading.get_native_id()]
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as fh:
                if fh.read().startswith(_IO_THREAD_PREFIX):
                    tids.append(int(tid))
        for tid in tids:
            if os.getpriority(os.PRIO_PROCESS, tid) < _BACKGROUND_NICE:
                os.setpriority(os.PRIO_PROCESS, tid, _BACKGROUND_NICE)
    except (OSError, AttributeError):
        pass


def leaves(tree) -> list:
    """The tree's leaves in its flattening order."""
    import jax

    return jax.tree.leaves(tree)


def _host_tree(tree):
    """The tree with every leaf a NumPy array (0-d for scalars): views of CPU device buffers."""
    import jax

    return jax.tree.map(lambda x: np.asarray(x), tree)


def _same_layout(a, b) -> bool:
    import jax

    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


class Snapshots:
    """Host copies of a shard's state for checkpoints, in buffers reused from one checkpoint to
    the next (one spare set kept). A copy, not views of the live buffers: a view would stop the
    next update from donating (reusing) those buffers, so it would allocate fresh outputs whose
    pages the kernel zeroes on first touch, at every checkpoint; the copy runs once, into warm
    memory. Thread-safe."""

    def __init__(self):
        self._spare = None
        self._lock = threading.Lock()
        self._borrowed: set[int] = set()  # ids of views handed out instead of copies

    def take(self, tree, copy: bool = True) -> Any:
        """A host copy of ``tree`` (device or host arrays); ``copy`` False: host views of it
        instead (no memory; the caller keeps the live state unchanged until it is given back)."""
        import jax

        live = _host_tree(tree)
        if not copy:
            with self._lock:
                self._spare = None  # a state too large to copy keeps no spare copy either
                self._borrowed.add(id(live))
            return live
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is None or not _same_layout(spare, live):
            spare = jax.tree.map(np.empty_like, live)
        jax.tree.map(np.copyto, spare, live)
        return spare

    def give_back(self, tree) -> None:
        """Takes back a copy once written (or superseded); views are dropped."""
        with self._lock:
            if id(tree) in self._borrowed:
                self._borrowed.discard(id(tree))
                return
            self._spare = tree
