"""glibc malloc's thresholds, set once per process: what both sides do so that freed message and
tensor memory is reused instead of page-faulted anew.

gRPC messages (chunks of at most :data:`~optserve.protos.contract.MAX_CHUNK_BYTES`) and tensor
buffers are freed and allocated again at every step. glibc returns memory above its (adaptive)
mmap threshold to the kernel at once, and shrinks a heap whose free top passes the trim
threshold; the next allocation then page-faults on every page it touches. :func:`keep_freed_memory`
fixes both thresholds (set together: setting one disables the adaptation of the other) and, for
server processes, stops malloc mapping memory of its own. The client
(``optserve.client._heap``) and the shard processes (``optserve.server.compute.heap``) each
choose how far to go. Only glibc has these calls; elsewhere they do nothing and return False.
"""

from __future__ import annotations

import ctypes
import platform
import threading
from typing import Optional

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's maximum on 64-bit; chunks are at most contract.MAX_CHUNK_BYTES (4 MiB)
DEFAULT_KEEP_BYTES = 1 << 30

_lock = threading.Lock()
_applied = (0, False)  # (keep_bytes, no_mmap) applied so far; guarded by _lock


def keep_freed_memory(keep_bytes: int = DEFAULT_KEEP_BYTES, no_mmap: bool = False) -> bool:
    """Sets glibc malloc's mmap threshold to its maximum (32 MiB) and its trim threshold to
    ``keep_bytes`` (up to that much free heap stays resident); ``no_mmap``: malloc maps no memory
    of its own either, so freed buffers of every size are reused. True if applied (idempotent: a
    setting already applied, or a stronger one, is not applied again).

    Raises:
      ValueError: ``keep_bytes`` outside [32 MiB, 2**31) (mallopt takes an int).
    """
    global _applied
    if not MMAP_THRESHOLD_BYTES <= keep_bytes < 1 << 31:
        raise ValueError(f"keep_bytes must be in [{MMAP_THRESHOLD_BYTES}, 2**31) (mallopt takes an int), got {keep_bytes}")
    with _lock:
        if _applied[0] >= keep_bytes and (_applied[1] or not no_mmap):
            return True
        mallopt = glibc_function("mallopt", (ctypes.c_int, ctypes.c_int))
        if mallopt is None:
            return False
        if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(_M_TRIM_THRESHOLD, keep_bytes)):
            return False
        if no_mmap and not mallopt(_M_MMAP_MAX, 0):
            return False
        _applied = (max(keep_bytes, _applied[0]), no_mmap or _applied[1])
        return True


def trim_free_memory() -> bool:
    """Returns the heap's free pages to the kernel now (glibc ``malloc_trim(0)``). True if called."""
    trim = glibc_function("malloc_trim", (ctypes.c_size_t,))
    if trim is None:
        return False
    trim(0)
    return True


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_usage() -> Optional[tuple[int, int]]:
    """``(in_use_bytes, free_bytes)`` of malloc's heap in this process, over all its arenas (glibc
    ``mallinfo2``: allocated chunks plus allocations it mapped, and free chunks it keeps); None on
    another libc or a glibc older than 2.33. Resident memory counts both; only the first is what
    the process holds, the second what it keeps for reuse (see :func:`keep_freed_memory`)."""
    info = glibc_function("mallinfo2", (), restype=_MallInfo2)
    if info is None:
        return None
    reading = info()
    return int(reading.uordblks + reading.hblkhd), int(reading.fordblks)


def glibc_function(name: str, argtypes: tuple, restype=ctypes.c_int):
    """glibc's function ``name`` (returning ``restype``, a C int by default) with ``argtypes``, or
    None on another libc (or a glibc without it)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = argtypes
    function.restype = restype
    return function
