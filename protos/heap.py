"""Keeping freed message memory in the process, so large transfers do not page-fault.

Every tensor chunk gRPC receives or sends is a fresh multi-megabyte allocation (its slices,
the Python ``bytes`` of each message). glibc's default malloc returns such memory to the
kernel soon after it is freed: chunks above its (adaptive) mmap threshold are unmapped at once,
and a heap whose free top exceeds the trim threshold (twice the mmap threshold) shrinks. The
next chunk then page-faults on every 4 KiB page it touches: measured on loopback, about 40% of
the pulled bytes per step, ~12% of the CPU time of a 400 MB push_pull.

:func:`retain_freed_memory` fixes both thresholds (they must be set together: setting one
disables the adaptation of the other, which is worse than the default), so freed chunks stay
mapped and are reused. The cost is that up to ``keep_bytes`` of free heap stay resident.
Only glibc has ``mallopt``; elsewhere this does nothing and returns False.

:func:`keep_large_buffers_on_heap` goes further for processes that own parameter-sized buffers
(the shard actors): it stops malloc from using ``mmap`` at all, so the buffers XLA and NumPy
allocate and free on every step (an update's outputs and temporaries, each as large as a
tensor, above any mmap threshold) come from the heap and are reused, instead of arriving as
fresh pages that the kernel zeroes on first touch.
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
_applied: dict[str, int] = {}


def retain_freed_memory(keep_bytes: int = DEFAULT_KEEP_BYTES) -> bool:
    """Sets glibc malloc so that freed allocations below 32 MiB are not returned to the kernel
    while the free heap top stays below ``keep_bytes``; True if applied (idempotent)."""
    if not MMAP_THRESHOLD_BYTES <= keep_bytes < 1 << 31:
        raise ValueError(f"keep_bytes must be in [{MMAP_THRESHOLD_BYTES}, 2**31) (mallopt takes an int), got {keep_bytes}")
    with _lock:
        if _applied.get("keep_bytes", 0) >= keep_bytes:
            return True
        mallopt = _glibc_mallopt()
        if mallopt is None:
            return False
        if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(_M_TRIM_THRESHOLD, keep_bytes)):
            return False
        _applied["keep_bytes"] = keep_bytes
        return True


def keep_large_buffers_on_heap(keep_bytes: int = DEFAULT_KEEP_BYTES) -> bool:
    """:func:`retain_freed_memory` for allocations of every size: malloc never maps memory of its
    own (``M_MMAP_MAX = 0``), so freed tensor-sized buffers are reused by the next allocation of
    their size. For server processes (the client leaves its host program's malloc alone); True
    if applied (idempotent). :func:`release_free_memory` still hands free pages back."""
    if not retain_freed_memory(keep_bytes):
        return False
    with _lock:
        if _applied.get("large"):
            return True
        mallopt = _glibc_mallopt()
        if mallopt is None or not mallopt(_M_MMAP_MAX, 0):
            return False
        _applied["large"] = 1
        return True


def _glibc_mallopt():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt


def release_free_memory() -> bool:
    """Returns the heap's free pages to the kernel now (glibc ``malloc_trim(0)``), whatever
    :func:`retain_freed_memory` keeps between transfers; for rare moments that free a lot at
    once (a session closed). True if called (glibc only)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = (ctypes.c_size_t,)
    trim.restype = ctypes.c_int
    trim(0)
    return True
