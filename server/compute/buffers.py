"""Host buffers for received gradients: page aligned, pooled across steps."""

from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

_XLA_CPU_ALIGNMENT = 64  # bytes: host arrays aligned to this are used by XLA:CPU in place
IO_ALIGNMENT = 4096  # bytes: what direct I/O needs (a durable shard's step log writes gradients so)


def aligned_empty(shape: tuple[int, ...], dtype=np.float32, alignment: int = _XLA_CPU_ALIGNMENT) -> np.ndarray:
    """An uninitialized array whose data starts at a multiple of ``alignment`` bytes.

    ``jax.device_put(x, may_alias=True)`` on a CPU device aliases a 64-byte aligned NumPy array
    instead of copying it; ``np.empty`` gives large arrays 16-byte alignment only (malloc), which
    costs a full copy per gradient per step.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    offset = -raw.ctypes.data % alignment
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


class BufferPool:
    """Reusable float32 gradient buffers, one dict ``name -> array[shape]`` per push.

    Fresh allocations page-fault on every push; pooled ones are warm. Page aligned
    (:data:`IO_ALIGNMENT`): the jitted step reads them in place (:func:`aligned_empty`) and the
    step log can write them with direct I/O. Thread-safe.

    Args:
      shapes: ``(name, shape)`` of the shard's tensors.
      keep: most free sets kept (the rest are left to the garbage collector).
    """

    def __init__(self, shapes: Sequence[tuple[str, tuple[int, ...]]], keep: int = 4):
        self._shapes = list(shapes)
        self._free: list[dict[str, np.ndarray]] = []
        self._keep = keep
        self._lock = threading.Lock()

    def acquire(self) -> dict[str, np.ndarray]:
        with self._lock:
            if self._free:
                return self._free.pop()
        return {name: aligned_empty(shape, np.float32, IO_ALIGNMENT) for name, shape in self._shapes}

    @property
    def free_sets(self) -> int:
        """Sets kept for reuse now (at most ``keep``): a set given back is here until acquired."""
        with self._lock:
            return len(self._free)

    def release(self, buffers: dict[str, np.ndarray]) -> None:
        """Takes back a set from :meth:`acquire` (or gradients assembled into one: their
        ``pooled`` set)."""
        buffers = getattr(buffers, "pooled", buffers)
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(buffers)
