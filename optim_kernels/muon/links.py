"""Muon's own links, each an optax transformation over the Muon-path tensors.

* :func:`scale_by_orthogonalized_momentum`: momentum (optionally Nesterov, bias-corrected),
  then each tensor's matrices replaced by their Newton–Schulz orthogonalisation;
* :func:`scale_by_matrix_shape`: a per-tensor factor from the matrix's fan-in and fan-out.

Both take ``axes_of(key_path, shape) -> MatrixAxes`` (see
:meth:`~optserve.optim_kernels.muon.selection.TensorSelection.axes_of`), a static per-tensor
lookup, so they work on the masked trees ``optax.partition`` hands them (the other path's
tensors are empty nodes without leaves, skipped by the tree maps).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optserve.optim_kernels.muon.axes import MatrixAxes, matrix_view
from optserve.optim_kernels.muon.newton_schulz import Coefficients, orthogonalize

AxesOf = Callable[[Any, Sequence[int]], MatrixAxes]

__all__ = ["OrthogonalizedMomentumState", "scale_by_matrix_shape", "scale_by_orthogonalized_momentum", "shape_factor"]


class OrthogonalizedMomentumState(NamedTuple):
    """State of :func:`scale_by_orthogonalized_momentum`.

    Attributes:
      count: int32 ``()``, updates taken so far.
      mu: like the params (each tensor's shape), in ``mu_dtype`` or else the param dtype: the
        exponential moving average ``beta mu + (1 - beta) g`` of the gradients, not bias-corrected.
    """

    count: jax.Array
    mu: Any


def scale_by_orthogonalized_momentum(
    axes_of: AxesOf,
    schedule: Sequence[Coefficients],
    beta: float = 0.95,
    nesterov: bool = True,
    preconditioning: str = "frobenius",
    eps: float = 1e-8,
    adaptive: bool = False,
    mu_dtype: Any | None = None,
) -> optax.GradientTransformation:
    """Momentum, then Newton–Schulz orthogonalisation of every matrix of every tensor.

    At step ``t`` (1-based) with gradient ``g``: ``mu <- beta mu + (1 - beta) g``; the direction
    is ``d = beta mu / (1 - beta^(t+1)) + (1 - beta) g / (1 - beta^t)`` with ``nesterov``, else
    ``d = mu / (1 - beta^t)``. Each tensor's ``d`` is seen as a stack of matrices
    (``axes_of``), each matrix orthogonalised by :func:`~.newton_schulz.orthogonalize` in
    float32; with ``adaptive`` the result ``O`` becomes ``<d, O> O`` (the dual-norm scaling of
    Bernstein & Newhouse, 2024, over the whole tensor).

    Args:
      axes_of: ``(key_path, shape) -> MatrixAxes`` of each tensor this link sees.
      schedule: ``(a, b, c)`` per Newton–Schulz iteration.
      beta: momentum decay in ``[0, 1)``.
      nesterov: use the Nesterov mix above.
      preconditioning: scaling before the iteration (see ``newton_schulz.PRECONDITIONINGS``).
      eps: floor of the orthogonalisation's scaling denominators.
      adaptive: scale by the dual norm as above.
      mu_dtype: dtype of ``mu``; ``None``: the dtype the momentum update gives (the param dtype
        for float gradients of the param dtype).

    Returns:
      A transformation whose updates have each gradient's shape and dtype.
    """
    mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)
    schedule = tuple(tuple(float(c) for c in row) for row in schedule)

    def init_fn(params):
        return OrthogonalizedMomentumState(
            count=jnp.zeros((), jnp.int32),
            mu=jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype if mu_dtype is None else mu_dtype), params),
        )

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_int32_increment(state.count)
        mu = jax.tree.map(lambda g, m: (1 - beta) * g + beta * m, updates, state.mu)
        correction = 1 - beta**count
        if nesterov:
            next_correction = 1 - beta ** optax.safe_int32_increment(count)
            direction = jax.tree.map(
                lambda m, g: beta * (_f32(m) / next_correction) + (1 - beta) * (_f32(g) / correction), mu, updates)
        else:
            direction = jax.tree.map(lambda m: _f32(m) / correction, mu)

        def orthogonal(path, d, g):
            view = matrix_view(d.shape, axes_of(path, d.shape))
            o = view.from_stack(orthogonalize(view.to_stack(d), schedule, preconditioning, eps))
            if adaptive:
                o = jnp.sum(d * o) * o
            return o.astype(g.dtype)

        new_updates = jax.tree_util.tree_map_with_path(orthogonal, direction, updates)
        if mu_dtype is not None:
            mu = jax.tree.map(lambda m: m.astype(mu_dtype), mu)
        return new_updates, OrthogonalizedMomentumState(count=count, mu=mu)

    return optax.GradientTransformation(init_fn, update_fn)


def shape_factor(fan_in: int, fan_out: int, consistent_rms: float | None = None) -> float:
    """``sqrt(max(1, fan_out / fan_in))``, or ``consistent_rms * sqrt(max(fan_in, fan_out))``."""
    if consistent_rms is None:
        return math.sqrt(max(1.0, fan_out / fan_in))
    return float(consistent_rms) * math.sqrt(max(fan_in, fan_out))


def scale_by_matrix_shape(axes_of: AxesOf, consistent_rms: float | None = None) -> optax.GradientTransformation:
    """Multiplies each tensor's update by :func:`shape_factor` of its matrix (stateless).

    The default factor ``sqrt(max(1, fan_out / fan_in))`` is Keller Jordan's: an orthogonal
    ``fan_in x fan_out`` update with more outputs than inputs gets the same RMS change of the
    layer's outputs as a square one. ``consistent_rms`` instead gives every matrix update the
    RMS ``consistent_rms`` (Liu et al., 2025, "Muon is Scalable for LLM Training"; 0.2 matches
    AdamW's typical update RMS).

    Args:
      axes_of: ``(key_path, shape) -> MatrixAxes`` of each tensor.
      consistent_rms: ``None`` or a positive target RMS.
    """

    def update_fn(updates, state, params=None):
        del params

        def scale(path, u):
            view = matrix_view(u.shape, axes_of(path, u.shape))
            return u * jnp.asarray(shape_factor(view.fan_in, view.fan_out, consistent_rms), u.dtype)

        return jax.tree_util.tree_map_with_path(scale, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def _f32(x: jax.Array) -> jax.Array:
    return x.astype(jnp.float32)
