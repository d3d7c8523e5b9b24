"""Layer-wise grafting for Shampoo: a first-order direction whose norm Shampoo's step borrows.

Each graft type maps a gradient ``g`` (and a per-parameter diagonal accumulator ``v``) to a
direction ``u`` of the same shape:

* ``SGD`` / ``NONE``: ``u = g``.
* ``ADAGRAD``: ``v += g^2``, ``u = g / (sqrt(v) + diagonal_epsilon)``.
* ``RMSPROP``: ``v = beta2 v + (1 - beta2) g^2``, same ``u``; optional clipping of ``u`` so its
  RMS is at most ``clip_by_scaled_gradient_norm``.
* ``*_NORMALIZED``: as above with ``g / ||g||`` in place of ``g``.
* ``SQRT_N``: ``u = sign(g)`` (norm ``sqrt`` of the number of non-zeros).

The numeric values match the seed's ``GraftingType`` so specs may name a graft by int or string.
"""

from __future__ import annotations

import enum
from typing import Optional, Union

import jax
import jax.numpy as jnp

# Guards the normalization of an all-zero gradient.
_TINY = 1e-25


class GraftingType(enum.IntEnum):
    NONE = 0
    SGD = 1
    ADAGRAD = 2
    RMSPROP = 3
    RMSPROP_NORMALIZED = 4
    SQRT_N = 5
    ADAGRAD_NORMALIZED = 6


def parse_graft_type(value: Union[GraftingType, int, str], path: str = "graft_type") -> GraftingType:
    """Accepts the enum, its int value or its (case-insensitive) name."""
    try:
        if isinstance(value, str):
            return GraftingType[value.strip().upper()]
        return GraftingType(int(value))
    except (KeyError, ValueError, TypeError):
        raise ValueError(
            f"{path}: unknown graft type {value!r}; expected one of {[g.name for g in GraftingType]}"
        ) from None


def has_diagonal_statistics(graft_type: GraftingType) -> bool:
    return graft_type in (
        GraftingType.ADAGRAD,
        GraftingType.ADAGRAD_NORMALIZED,
        GraftingType.RMSPROP,
        GraftingType.RMSPROP_NORMALIZED,
    )


def graft_direction(
    grad: jax.Array,
    diagonal: Optional[jax.Array],
    graft_type: GraftingType,
    *,
    beta2: float,
    diagonal_epsilon: float,
    clip_by_scaled_gradient_norm: Optional[float] = None,
) -> tuple[jax.Array, Optional[jax.Array]]:
    """One grafting step: ``(direction, new_diagonal)``; ``diagonal`` is ``None`` for SGD-like types."""
    if graft_type in (GraftingType.SGD, GraftingType.NONE):
        return grad, diagonal
    if graft_type == GraftingType.SQRT_N:
        return jnp.sign(grad), diagonal
    scaled = grad
    if graft_type in (GraftingType.ADAGRAD_NORMALIZED, GraftingType.RMSPROP_NORMALIZED):
        scaled = grad / (jnp.linalg.norm(grad) + _TINY)
    if graft_type in (GraftingType.ADAGRAD, GraftingType.ADAGRAD_NORMALIZED):
        new_diagonal = diagonal + jnp.square(scaled)
    else:
        w2 = 1.0 if beta2 == 1.0 else 1.0 - beta2
        new_diagonal = beta2 * diagonal + w2 * jnp.square(scaled)
    direction = scaled / (jnp.sqrt(new_diagonal) + diagonal_epsilon)
    if clip_by_scaled_gradient_norm and graft_type in (GraftingType.RMSPROP, GraftingType.RMSPROP_NORMALIZED):
        rms = jnp.linalg.norm(direction) / jnp.sqrt(float(direction.size))
        direction = direction / jnp.maximum(1.0, rms / clip_by_scaled_gradient_norm)
    return direction, new_diagonal
