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

from optserve.protos.malloc_settings import DEFAULT_KEEP_BYTES, MMAP_THRESHOLD_BYTES, keep_freed_memory

__all__ = ["DEFAULT_KEEP_BYTES", "MMAP_THRESHOLD_BYTES", "retain_freed_memory"]


def retain_freed_memory(keep_bytes: int = DEFAULT_KEEP_BYTES) -> bool:
    """Sets glibc malloc so that freed allocations below 32 MiB are not returned to the kernel
    while the free heap top stays below ``keep_bytes``; True if applied (idempotent).

    Raises:
      ValueError: ``keep_bytes`` outside [32 MiB, 2**31) (mallopt takes an int).
    """
    return keep_freed_memory(keep_bytes)
