"""Compact storage for Shampoo's state (``best_effort_memory_usage_reduction``).

* Momentum of tensors with rank > 1: int8 with one f32 scale per column (max |x| over axis 0
  maps to 127).
* Statistics and preconditioners: int16 off-diagonal part with one f32 scale per column, and the
  diagonal kept apart in f32 (these matrices are diagonally dominant; the diagonal would otherwise
  eat the int16 range).
* Grafting's diagonal statistics: bfloat16.

Values are rounded to nearest. Plain arrays pass through :func:`decode` unchanged, so code reads
state the same way whether or not it is quantized.
"""

from __future__ import annotations

from typing import NamedTuple, Union

import jax
import jax.numpy as jnp


class QuantizedTensor(NamedTuple):
    """``values * scale``; ``values`` int8/int16 [..., n], ``scale`` f32 broadcastable over axis 0."""

    values: jax.Array
    scale: jax.Array


class QuantizedMatrix(NamedTuple):
    """Square matrix ``values * scale + diag(diagonal)``; ``values`` int16 [n, n] off-diagonal."""

    values: jax.Array
    scale: jax.Array
    diagonal: jax.Array


Stored = Union[jax.Array, QuantizedTensor, QuantizedMatrix]


def _quantize(x: jax.Array, dtype) -> QuantizedTensor:
    levels = float(jnp.iinfo(dtype).max)
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=0, keepdims=True) / levels
    safe = jnp.where(scale > 0, scale, 1.0)
    return QuantizedTensor(jnp.round(x / safe).astype(dtype), scale)


def encode_momentum(x: jax.Array, enabled: bool) -> Stored:
    """int8 per-column quantization for rank > 1 tensors when ``enabled``; else f32 as is."""
    if enabled and x.ndim > 1:
        return _quantize(x, jnp.int8)
    return x


def encode_matrix(x: jax.Array, enabled: bool) -> Stored:
    """int16 off-diagonal + f32 diagonal when ``enabled``; else f32 as is."""
    if not enabled:
        return x
    diagonal = jnp.diag(x).astype(jnp.float32)
    q = _quantize(x - jnp.diag(diagonal), jnp.int16)
    return QuantizedMatrix(q.values, q.scale, diagonal)


def encode_diagonal(x: jax.Array, enabled: bool) -> Stored:
    """bfloat16 when ``enabled``; else as is."""
    return x.astype(jnp.bfloat16) if enabled else x


def decode(x: Stored) -> jax.Array:
    """f32 value of any stored form (plain arrays are returned as f32)."""
    if isinstance(x, QuantizedMatrix):
        return x.values.astype(jnp.float32) * x.scale + jnp.diag(x.diagonal)
    if isinstance(x, QuantizedTensor):
        return x.values.astype(jnp.float32) * x.scale
    return x.astype(jnp.float32)
