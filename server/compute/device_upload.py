"""A push's gradients onto an accelerator as the push arrives, checked finite there.

On a GPU, checking a push's gradients on the host reads every byte on the CPU, which takes longer
than moving them over the link. :func:`upload_checked` moves them to the device when the push is
received (one batch; at the link's speed from a region mapped for the device) and checks them
there, so a non-finite push is still refused before it is staged, with nothing applied anywhere,
and its step finds the gradients already on the device.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import numpy as np


@functools.lru_cache(maxsize=None)
def _finite_flags():
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda values: jnp.stack([jnp.all(jnp.isfinite(v)) for v in values]))


def upload_checked(device, arrays: Mapping[str, np.ndarray], check_finite: bool) -> tuple[dict[str, Any], list[str]]:
    """``arrays`` (name -> float32 host array) copied to ``device`` in one batch, and the names of
    those holding a NaN or an Inf, in ``arrays``' order (none looked for without ``check_finite``).
    Returns once the copies landed (and the check ran): the host arrays may change afterwards."""
    import jax

    names = list(arrays)
    on_device = jax.device_put([arrays[name] for name in names], device)
    if not check_finite or not names:
        jax.block_until_ready(on_device)
        return dict(zip(names, on_device)), []
    flags = np.asarray(_finite_flags()(on_device))
    return dict(zip(names, on_device)), [name for name, finite in zip(names, flags) if not finite]
