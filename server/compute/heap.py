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

import ctypes
import platform
import threading

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's maximum on 64-bit; chunks are at most contract.MAX_CHUNK_BYTES (4 MiB)
DEFAULT_KEEP_BYTES = 1 << 30

_lock = threading.Lock()
_kept_bytes = 0  # the keep_bytes applied so far (0: none); guarded by _lock


def keep_large_buffers_on_heap(keep_bytes: int = DEFAULT_KEEP_BYTES) -> bool:
    """Sets glibc malloc so that freed allocations of every size are reused: mmap threshold at
    its maximum (32 MiB), trim threshold ``keep_bytes``, no mmap at all. For server processes;
    True if applied (idempotent). :func:`release_free_memory` still hands free pages back.

    Raises:
      ValueError: ``keep_bytes`` outside [32 MiB, 2**31) (mallopt takes an int).
    """
    global _kept_bytes
    if not MMAP_THRESHOLD_BYTES <= keep_bytes < 1 << 31:
        raise ValueError(f"keep_bytes must be in [{MMAP_THRESHOLD_BYTES}, 2**31) (mallopt takes an int), got {keep_bytes}")
    with _lock:
        if _kept_bytes >= keep_bytes:
            return True
        mallopt = _glibc("mallopt", (ctypes.c_int, ctypes.c_int))
        if mallopt is None:
            return False
        if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(_M_TRIM_THRESHOLD, keep_bytes)
                and mallopt(_M_MMAP_MAX, 0)):
            return False
        _kept_bytes = keep_bytes
        return True


def release_free_memory() -> bool:
    """Returns the heap's free pages to the kernel now (glibc ``malloc_trim(0)``), whatever
    :func:`keep_large_buffers_on_heap` keeps between steps. True if called (glibc only)."""
    trim = _glibc("malloc_trim", (ctypes.c_size_t,))
    if trim is None:
        return False
    trim(0)
    return True


def _glibc(name: str, argtypes: tuple):
    """glibc's function ``name`` (returning a C int) with ``argtypes``, or None on another libc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function
