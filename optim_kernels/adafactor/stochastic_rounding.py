"""Unbiased (stochastic) rounding of float32 to bfloat16.

A bfloat16 is the top 16 bits of a float32. For a finite x, let ``lo`` be x truncated toward
zero to bfloat16 and ``hi`` the next bfloat16 away from zero; with ``f = (|x| - |lo|) /
(|hi| - |lo|)`` (the low 16 bits of x over 2**16), x rounds to ``hi`` iff ``f > u`` for a noise
u in [0, 1). With u uniform, ``E[round(x)] = x``: no bias, where round-to-nearest always loses
the sub-ulp part. Noise is given as 16-bit integers ``floor(u * 2**16)`` (uint32 arrays
broadcastable to x).

Two noise sources:
* :func:`golden_ratio_noise` -- tensor2tensor's deterministic choice: one value per step,
  ``frac(phi * (count + 1))``, the same for every element (replicas stay in sync without RNG).
  Computed exactly in 32-bit fixed point, so it does not degrade at large step counts.
* :func:`random_noise` -- independent bits per element from a jax PRNG key.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# frac(golden ratio) in 64-bit fixed point, as two 32-bit words: frac(phi * n) * 2**32 is
# (n * HI + high32(n * LO)) mod 2**32, exact up to n * 2**-32 ulps (no float round-off).
_PHI_HI = 0x9E3779B9
_PHI_LO = 0x7F4A7C15


def _mul_high32(a: jnp.ndarray, b: int) -> jnp.ndarray:
    """High 32 bits of the 64-bit product of uint32 ``a`` and constant ``b`` (16-bit limbs)."""
    m16 = jnp.uint32(0xFFFF)
    a1, a0 = a >> 16, a & m16
    b1, b0 = jnp.uint32(b >> 16), jnp.uint32(b & 0xFFFF)
    mid1, mid2 = a1 * b0, a0 * b1
    low_carry = ((a0 * b0) >> 16) + (mid1 & m16) + (mid2 & m16)
    return a1 * b1 + (mid1 >> 16) + (mid2 >> 16) + (low_carry >> 16)


def golden_ratio_noise(count: jnp.ndarray) -> jnp.ndarray:
    """16-bit noise ``floor(frac(phi * (count + 1)) * 2**16)`` as a uint32 scalar."""
    n = jnp.asarray(count).astype(jnp.uint32) + jnp.uint32(1)
    frac32 = n * jnp.uint32(_PHI_HI) + _mul_high32(n, _PHI_LO)
    return frac32 >> jnp.uint32(16)


def random_noise(key: jax.Array, shape) -> jnp.ndarray:
    """Independent 16-bit noise per element (uint32 array of ``shape``)."""
    return jax.random.bits(key, shape, jnp.uint32) >> jnp.uint32(16)


def to_bfloat16_unbiased(x: jnp.ndarray, noise16: jnp.ndarray) -> jnp.ndarray:
    """Rounds float32 ``x`` to bfloat16, up (away from zero) iff its sub-bf16 fraction > noise.

    Args:
      x: float32 array (other float dtypes are cast to float32 first).
      noise16: uint32 values in [0, 2**16), broadcastable to ``x``.
    Returns:
      bfloat16 array of ``x``'s shape; each entry is one of the two bfloat16 neighbours of x
      (x itself when representable). Inf and NaN are converted as by ``astype``.
    """
    x = jnp.asarray(x, jnp.float32)
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    # Adding (0xFFFF - noise) carries into the kept bits exactly when low16 > noise.
    carry = jnp.uint32(0xFFFF) - jnp.asarray(noise16, jnp.uint32)
    rounded = (bits + carry) & jnp.uint32(0xFFFF0000)
    as_f32 = lax.bitcast_convert_type(rounded, jnp.float32)
    return jnp.where(jnp.isfinite(x), as_f32, x).astype(jnp.bfloat16)
