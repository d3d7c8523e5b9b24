"""Tensors in and out of SOAP's eigenbases, and the per-axis Kronecker statistics.

For a working tensor ``x`` and one orthogonal basis ``Q_a`` (``[d_a, d_a]``, columns = basis
vectors) per preconditioned axis ``a``:

* :func:`rotate`: ``x`` in the eigenbasis, ``x ×_a Q_a^T`` over the axes (for a matrix
  ``Q_L^T X Q_R``);
* :func:`unrotate`: the inverse, ``y ×_a Q_a`` (``Q_L Y Q_R^T``);
* :func:`change_basis`: coordinates in bases ``Q_a`` -> coordinates in ``P_a``, ``y ×_a T_a`` with
  ``T_a = Q_a^T P_a`` (:func:`transition`);
* :func:`axis_statistic`: ``x``'s outer product along axis ``a``, the contraction of ``x`` with
  itself over every other axis (``X X^T`` and ``X^T X`` for a matrix).

Axes without a basis are left as they are. Products run at ``Precision.HIGHEST`` (no TF32 on GPUs).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["axis_statistic", "change_basis", "rotate", "transition", "unrotate"]

_HIGHEST = lax.Precision.HIGHEST


def _apply(x: jax.Array, matrix: jax.Array, axis: int, contract: int) -> jax.Array:
    """Contracts ``x``'s ``axis`` with ``matrix``'s axis ``contract``; the result keeps ``x``'s axis order."""
    return jnp.moveaxis(jnp.tensordot(x, matrix, axes=(axis, contract), precision=_HIGHEST), -1, axis)


def rotate(x: jax.Array, bases: Sequence[jax.Array], axes: Sequence[int]) -> jax.Array:
    """``x`` in the eigenbasis: coordinate ``k`` along axis ``a`` is ``<Q_a[:, k], x>``."""
    for axis, basis in zip(axes, bases):
        x = _apply(x, basis, axis, 0)
    return x


def unrotate(y: jax.Array, bases: Sequence[jax.Array], axes: Sequence[int]) -> jax.Array:
    """Eigenbasis coordinates ``y`` back in the parameter's basis (inverse of :func:`rotate`)."""
    for axis, basis in zip(axes, bases):
        y = _apply(y, basis, axis, 1)
    return y


def transition(old: jax.Array, new: jax.Array) -> jax.Array:
    """``old^T new``: the matrix that takes coordinates in basis ``old`` to coordinates in ``new``."""
    return jnp.matmul(old.T, new, precision=_HIGHEST)


def change_basis(y: jax.Array, transitions: Sequence[jax.Array], axes: Sequence[int]) -> jax.Array:
    """Eigenbasis coordinates ``y`` moved to new bases, one :func:`transition` per axis."""
    for axis, matrix in zip(axes, transitions):
        y = _apply(y, matrix, axis, 0)
    return y


def axis_statistic(x: jax.Array, axis: int) -> jax.Array:
    """``[d, d]``: the sum over every other axis of ``x[.., i, ..] x[.., j, ..]`` (``d = x.shape[axis]``)."""
    others = [a for a in range(x.ndim) if a != axis]
    return jnp.tensordot(x, x, axes=(others, others), precision=_HIGHEST)
