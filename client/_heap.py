"""Keeping freed message memory in the client's process, so large transfers do not page-fault.

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

The shard processes go further (``optserve.server.compute.heap``: no mmap at all, and pages
handed back when a session closes); the client leaves the rest of its host program's malloc alone.
"""

from __future__ import annotations

import ctypes
import platform
import threading

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's maximum on 64-bit; chunks are at most contract.MAX_CHUNK_BYTES (4 MiB)
DEFAULT_KEEP_BYTES = 1 << 30

_lock = threading.Lock()
_kept_bytes = 0  # the keep_bytes applied so far (0: none); guarded by _lock


def retain_freed_memory(keep_bytes: int = DEFAULT_KEEP_BYTES) -> bool:
    """Sets glibc malloc so that freed allocations below 32 MiB are not returned to the kernel
    while the free heap top stays below ``keep_bytes``; True if applied (idempotent).

    Raises:
      ValueError: ``keep_bytes`` outside [32 MiB, 2**31) (mallopt takes an int).
    """
    global _kept_bytes
    if not MMAP_THRESHOLD_BYTES <= keep_bytes < 1 << 31:
        raise ValueError(f"keep_bytes must be in [{MMAP_THRESHOLD_BYTES}, 2**31) (mallopt takes an int), got {keep_bytes}")
    with _lock:
        if _kept_bytes >= keep_bytes:
            return True
        mallopt = _glibc_mallopt()
        if mallopt is None:
            return False
        if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(_M_TRIM_THRESHOLD, keep_bytes)):
            return False
        _kept_bytes = keep_bytes
        return True


def _glibc_mallopt():
    """glibc's ``mallopt(int, int) -> int``, or None on another libc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt
