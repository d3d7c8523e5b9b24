"""Host passes over large arrays split across a few threads (NumPy releases the GIL for both), for
the passes a shared-memory step makes on the shard's host: writing the parameters into a client's
region (:func:`parallel_copy`), checking its gradients are finite (:func:`parallel_all_finite`).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import numpy as np

SPLIT_MIN_BYTES = 16 << 20  # below this one thread is as fast (a split costs a few tens of microseconds)
_pool: Optional[ThreadPoolExecutor] = None
_pool_lock = threading.Lock()


def host_threads() -> int:
    """Threads a host pass is split across: half the CPUs this process may run on, at most 4
    (memory bandwidth, not the core count, bounds a copy beyond that); 1 on a 2-CPU machine."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus // 2))


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=host_threads(), thread_name_prefix="optserve-host")
        return _pool


def _split(flat_arrays: tuple[np.ndarray, ...], work: Callable[..., Any], threads: Optional[int]) -> list:
    """``work(*pieces)`` over ``threads`` (default :func:`host_threads`) equal ranges of the
    same-length 1-d ``flat_arrays``: the first in this thread, the others in the pool; the
    results in no particular order."""
    threads = threads or host_threads()
    size = flat_arrays[0].size
    if threads == 1 or flat_arrays[0].nbytes < SPLIT_MIN_BYTES:
        return [work(*flat_arrays)]
    bounds = np.linspace(0, size, threads + 1).astype(np.int64)
    pieces = [tuple(a[lo:hi] for a in flat_arrays) for lo, hi in zip(bounds, bounds[1:])]
    jobs: list[concurrent.futures.Future] = []
    try:
        for piece in pieces[1:]:
            jobs.append(_executor().submit(work, *piece))
    except RuntimeError:  # the interpreter is shutting down: the pieces not handed out run here
        pass
    try:  # this thread does the first piece (and any not handed out)
        results = [work(*piece) for piece in [pieces[0]] + pieces[1 + len(jobs):]]
    finally:
        concurrent.futures.wait(jobs)  # every piece has ended before anything is raised: none writes on after
    return results + [job.result() for job in jobs]


def parallel_copy(destination: np.ndarray, source: np.ndarray, threads: Optional[int] = None) -> None:
    """``destination[...] = source``, byte for byte (the same number of bytes; ``destination``
    C-contiguous), split over ``threads`` (default :func:`host_threads`) when large."""
    dst, src = destination.reshape(-1).view(np.uint8), np.ascontiguousarray(source).reshape(-1).view(np.uint8)
    if dst.size != src.size:
        raise ValueError(f"copy of {src.size} bytes into {dst.size}")
    _split((dst, src), np.copyto, threads)


def parallel_all_finite(values: np.ndarray, check: Callable[[np.ndarray], bool],
                        threads: Optional[int] = None) -> bool:
    """Whether ``check`` (a finiteness test of one 1-d piece) holds for every piece of ``values``
    (C-contiguous), split over ``threads`` (default :func:`host_threads`) when large."""
    return all(_split((values.reshape(-1),), check, threads))
