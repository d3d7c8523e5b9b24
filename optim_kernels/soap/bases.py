"""SOAP's eigenbases from its statistics: what a refresh computes, on a shard or on a worker.

A refresh turns each statistic ``S`` (``[d, d]``, symmetric positive semi-definite) and the
basis ``Q`` currently used with it into a new orthogonal basis, as the paper does:

* ``REFRESH_EIGH`` (a block without a basis yet): the eigenvectors of ``S``, eigenvalues in
  descending order (``jnp.linalg.eigh``, reversed);
* ``REFRESH_POWER`` (afterwards): one step of power iteration with a QR decomposition. The
  columns of ``Q`` are ordered by their Rayleigh quotients ``diag(Q^T S Q)``, descending, the
  product ``S Q`` is taken in that order and orthonormalised (``jnp.linalg.qr``), and the result
  is put back in ``Q``'s column order.

That last step is ours: the reference keeps the sorted order and permutes Adam's second moment to
match it, which needs the sort of *this* refresh at install time. A basis that keeps its previous
column order gives the same trajectory (the update is unchanged under a common permutation of a
basis' columns and the moment coordinates along that axis, and the next refresh sorts again) and
lets the second moment stay where it is, whenever the new basis arrives.

:func:`compute_bases` works on a stack of identity-padded blocks of different sizes, the form the
root offload seam ships to preconditioner workers (``registry.RootOffloadSeam``); everything past
a block's size is ignored and comes back as identity.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["REFRESH_EIGH", "REFRESH_POWER", "BasisConfig", "compute_bases", "eigenbasis", "power_iteration_basis"]

REFRESH_EIGH = 0
REFRESH_POWER = 1

_HIGHEST = lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class BasisConfig:
    """How a refresh is computed: typed, hashable and picklable (the seam's ``root_config``).

    SOAP has no option that changes a refresh today; the type is what a worker compiles for,
    once per batch shape.
    """


def eigenbasis(statistic: jax.Array, valid: jax.Array) -> jax.Array:
    """``[n, n]``: the eigenvectors of the ``valid`` block of ``statistic``, eigenvalues descending.

    Padding rows and columns are replaced by ``-c I`` with ``c`` above the block's spectral radius,
    so their eigenvalues sort last and never mix with the block's.
    """
    inside = valid[:, None] & valid[None, :]
    s = jnp.where(inside, statistic, 0.0)
    c = 1.0 + jnp.sum(jnp.abs(s))
    s = s - jnp.diag(jnp.where(valid, 0.0, c).astype(s.dtype))
    _, vectors = jnp.linalg.eigh(s)
    return jnp.flip(vectors, axis=-1)


def power_iteration_basis(statistic: jax.Array, basis: jax.Array, valid: jax.Array) -> jax.Array:
    """``[n, n]``: one QR power-iteration step from ``basis``, in ``basis``' column order (module docstring)."""
    inside = valid[:, None] & valid[None, :]
    s = jnp.where(inside, statistic, 0.0)
    q = jnp.where(inside, basis, jnp.eye(basis.shape[0], dtype=basis.dtype))
    product = jnp.matmul(s, q, precision=_HIGHEST)
    rayleigh = jnp.where(valid, jnp.sum(q * product, axis=0), -jnp.inf)
    order = jnp.argsort(-rayleigh, stable=True)
    sorted_basis, _ = jnp.linalg.qr(product[:, order])
    return sorted_basis[:, jnp.argsort(order)]


def compute_bases(statistics: jax.Array, kinds: jax.Array, sizes: jax.Array, root_config: BasisConfig,
                  previous: jax.Array) -> tuple[jax.Array, jax.Array]:
    """New eigenbases of a stack of statistics (pure; what workers run).

    Args:
      statistics: [B, n, n], each block's statistic in its top-left ``sizes[i]`` corner.
      kinds: int32 [B], ``REFRESH_EIGH`` or ``REFRESH_POWER`` per block (any other value counts
        as ``REFRESH_POWER``); the seam ships it as the export's ``exponents``.
      sizes: int32 [B], each block's real size.
      root_config: :class:`BasisConfig` (static; the seam's name for it).
      previous: [B, n, n], the bases in use, same layout (read by ``REFRESH_POWER`` only).

    Returns:
      ``(bases [B, n, n], errors [B])``: bases in the input dtype, identity past each size; errors
      in f32, how far ``Q^T Q`` moves two fixed unit probes (:func:`_orthogonality_error`), ``inf``
      when the input or the result is not finite. float64
      inside when ``jax_enable_x64`` is on.
    """
    del root_config
    dtype = statistics.dtype
    work = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
    statistics, previous = statistics.astype(work), previous.astype(work)
    n = statistics.shape[-1]
    valid = jnp.arange(n)[None, :] < sizes[:, None]
    by_power = jax.vmap(power_iteration_basis)(statistics, previous, valid)
    if statistics.shape[0]:
        eigh = kinds == REFRESH_EIGH
        bases = lax.cond(jnp.any(eigh),
                         lambda: jnp.where(eigh[:, None, None], jax.vmap(eigenbasis)(statistics, valid), by_power),
                         lambda: by_power)
    else:
        bases = by_power
    inside = valid[:, :, None] & valid[:, None, :]
    bases = jnp.where(inside, bases, jnp.eye(n, dtype=work))
    errors = _orthogonality_error(bases, valid)
    finite = jnp.all(jnp.isfinite(statistics), axis=(-2, -1)) & jnp.isfinite(errors)
    return bases.astype(dtype), jnp.where(finite, errors, jnp.inf)


def _orthogonality_error(bases: jax.Array, valid: jax.Array) -> jax.Array:
    """f32 [B]: ``max |Q^T Q p - p|`` over two fixed unit probes ``p`` of each block (a constant
    and an alternating ramp), O(n^2) per block where the whole Gram matrix would cost a product."""
    n = bases.shape[-1]
    index = jnp.arange(n, dtype=bases.dtype)
    probes = jnp.stack([jnp.ones((n,), bases.dtype), (index + 1.0) * (1.0 - 2.0 * (index % 2))], axis=-1)
    probes = jnp.where(valid[:, :, None], probes[None], 0.0)
    probes = probes / jnp.linalg.norm(probes, axis=1, keepdims=True)
    image = jnp.matmul(bases, probes, precision=_HIGHEST)
    back = jnp.matmul(jnp.swapaxes(bases, -1, -2), image, precision=_HIGHEST)
    return jnp.max(jnp.abs(back - probes), axis=(-2, -1)).astype(jnp.float32)
