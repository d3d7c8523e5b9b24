"""Malloc settings of the shard processes: tensor-sized buffers reused, free pages handed back on demand.

A shard allocates and frees parameter-sized buffers on every step: received chunks (multi-MiB
messages), an update's outputs and temporaries (each as large as a tensor, above any mmap
threshold). glibc's default malloc maps such allocations afresh and unmaps them when freed, so
every step page-faults on memory the kernel must zero first.

:func:`keep_large_buffers_on_heap` stops that for the whole process: the mmap threshold and the
trim threshold are fixed (set together: setting one disables the adaptation of the other) and
malloc never maps memory of its own (``M_MMAP_MAX = 0``), so freed buffers stay on the heap and
are reused by the next allocation of their size; up to ``keep_bytes`` of free heap stay resident.
:func:`release_free_memory` hands the heap's free pages back at the rare moments that free a lot
at once (a session closed, staged pushes expired). Only glibc has these calls; elsewhere both do
nothing and return False.

The client keeps only freed message memory (``optserve.client`` sets the two thresholds alone)
and leaves the rest of its host program's malloc as it is.
"""

from __future__ import annotations

from optserve.protos.malloc_settings import DEFAULT_KEEP_BYTES, MMAP_THRESHOLD_BYTES, keep_freed_memory, trim_free_memory

__all__ = ["DEFAULT_KEEP_BYTES", "MMAP_THRESHOLD_BYTES", "keep_large_buffers_on_heap", "release_free_memory"]


def keep_large_buffers_on_heap(keep_bytes: int = DEFAULT_KEEP_BYTES) -> bool:
    """Sets glibc malloc so that freed allocations of every size are reused: mmap threshold at
    its maximum (32 MiB), trim threshold ``keep_bytes``, no mmap at all. For server processes;
    True if applied (idempotent). :func:`release_free_memory` still hands free pages back.

    Raises:
      ValueError: ``keep_bytes`` outside [32 MiB, 2**31) (mallopt takes an int).
    """
    return keep_freed_memory(keep_bytes, no_mmap=True)


def release_free_memory() -> bool:
    """Returns the heap's free pages to the kernel now (glibc ``malloc_trim(0)``), whatever
    :func:`keep_large_buffers_on_heap` keeps between steps. True if called (glibc only)."""
    return trim_free_memory()
