"""Device arrays to host memory at the speed of the link.

On a CPU device ``np.asarray`` of a device array is a view of its buffer (no copy). On an
accelerator it lands in freshly allocated pageable memory, which XLA fills through a bounce buffer
at a fraction of the link's bandwidth; :func:`to_host` instead copies the arrays in one batch into
the device's pinned host memory (direct DMA) and returns read-only views of it.
"""

from __future__ import annotations

import functools

import numpy as np

@functools.lru_cache(maxsize=None)
def _pinned_sharding(device):
    """The sharding of ``device``'s pinned host memory, or None (a CPU device, or none offered)."""
    from jax.sharding import SingleDeviceSharding

    if device.platform == "cpu":
        return None
    try:
        kinds = {memory.kind for memory in device.addressable_memories()}
    except Exception:  # a backend without memory kinds
        return None
    return SingleDeviceSharding(device, memory_kind="pinned_host") if "pinned_host" in kinds else None


def _pinned_target(leaf):
    import jax

    if not isinstance(leaf, jax.Array) or len(leaf.devices()) != 1:
        return None
    if getattr(leaf.sharding, "memory_kind", None) == "pinned_host":
        return None
    return _pinned_sharding(next(iter(leaf.devices())))


def to_host(tree):
    """``tree`` with every leaf a NumPy array (0-d for scalars): views of CPU device buffers;
    read-only views of pinned host copies for arrays on an accelerator (copied in one batch)."""
    import jax

    leaves, structure = jax.tree.flatten(tree)
    targets = [_pinned_target(leaf) for leaf in leaves]
    moving = [i for i, target in enumerate(targets) if target is not None]
    if moving:
        moved = jax.device_put([leaves[i] for i in moving], [targets[i] for i in moving])
        for i, value in zip(moving, moved):
            leaves[i] = value
    return jax.tree.unflatten(structure, [np.asarray(leaf) for leaf in leaves])
