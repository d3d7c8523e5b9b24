"""SOAP (Vyas et al. 2024): Adam run in the eigenbases of Shampoo's preconditioner, as an optax
transformation.

One update at step ``t = state.count``, per parameter (viewed in its working shape,
:mod:`~optserve.optim_kernels.soap.layout`):

1. rotate the gradient into the eigenbases, ``G' = rotate(G)``
   (:mod:`~optserve.optim_kernels.soap.projection`);
2. Adam in those coordinates: ``m <- b1 m + (1 - b1) G'``, ``v <- b2 v + (1 - b2) G'^2``,
   direction ``N = unrotate(m / (sqrt(v) + eps))``; with ``normalize_gradient``, ``N / rms(N)``;
3. ``p <- p - lr sqrt(1 - b2^t) / (1 - b1^t) N`` (the factor only with ``correct_bias``), then
   ``p <- p (1 - lr weight_decay)``: returned as the update ``-step N - lr wd (p - step N)``;
4. fold ``G`` into each axis' statistic, ``S_a <- shampoo_beta S_a + (1 - shampoo_beta) G_a G_a^T``;
5. with ``inline_bases`` (the default), when ``t % precondition_frequency == 0``: refresh every
   basis from the statistics (eigendecomposition the first time, one QR power-iteration step
   after) and re-project ``m`` into the new bases (:mod:`~optserve.optim_kernels.soap.seam`).

Update 0 only folds its gradient and computes the first bases; its update is zero and the moments
stay zero (the paper never rotates a gradient with a basis built from that same gradient).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax
from optserve.optim_kernels.soap.config import ScalarOrSchedule, SoapConfig
from optserve.optim_kernels.soap.layout import SoapLayout
from optserve.optim_kernels.soap.projection import rotate, unrotate
from optserve.optim_kernels.soap.seam import refresh_bases
from optserve.optim_kernels.soap.state import (
    ParamState,
    SoapState,
    check_tree,
    fold_statistics,
    init_state,
    param_states,
)

__all__ = ["soap"]

# Guards the RMS normalisation of a zero direction (the paper's reference; pytorch_optimizer adds eps).
_NORMALIZE_GUARD = 1e-30


def _adam_in_eigenbasis(config: SoapConfig, layout: SoapLayout, grad, ps: ParamState) -> tuple[jax.Array, ParamState]:
    """The direction ``N`` (parameter shape, f32) and the moments after this gradient."""
    b1, b2 = config.beta1, config.beta2
    rotated = rotate(layout.to_working(grad.astype(jnp.float32)), ps.bases, layout.axes)
    exp_avg = ps.exp_avg + (1.0 - b1) * (rotated - ps.exp_avg)
    exp_avg_sq = ps.exp_avg_sq + (1.0 - b2) * (jnp.square(rotated) - ps.exp_avg_sq)
    direction = layout.from_working(unrotate(exp_avg / (jnp.sqrt(exp_avg_sq) + config.eps), ps.bases, layout.axes))
    if config.normalize_gradient:
        direction = direction / (jnp.sqrt(jnp.mean(jnp.square(direction))) + _NORMALIZE_GUARD)
    return direction, ps._replace(exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)


def _step_size(config: SoapConfig, lr, count) -> jax.Array:
    if not config.correct_bias:
        return jnp.asarray(lr, jnp.float32)
    t = jnp.maximum(count, 1).astype(jnp.float32)
    return lr * jnp.sqrt(1.0 - config.beta2 ** t) / (1.0 - config.beta1 ** t)


def _param_step(config: SoapConfig, grad, ps: ParamState, param, lr, step_size, first) -> tuple[jax.Array, ParamState]:
    """One parameter's update (in the gradient's dtype; zero on update 0, ``first``) and its
    moments after this gradient (unchanged on update 0)."""
    layout = SoapLayout.create(grad.shape, config)
    direction, moved = _adam_in_eigenbasis(config, layout, grad, ps)
    update = -step_size * direction
    if config.weight_decay:
        update = update - lr * config.weight_decay * (param.astype(jnp.float32) + update)
    new_ps = moved._replace(exp_avg=jnp.where(first, ps.exp_avg, moved.exp_avg),
                            exp_avg_sq=jnp.where(first, ps.exp_avg_sq, moved.exp_avg_sq))
    return jnp.where(first, 0.0, update).astype(grad.dtype), new_ps


def soap(
    learning_rate: ScalarOrSchedule = 3e-3,
    betas: Sequence[float] = (0.95, 0.95),
    shampoo_beta: float | None = None,
    weight_decay: float = 1e-2,
    precondition_frequency: int = 10,
    max_precondition_dim: int = 10000,
    merge_dims: bool = False,
    precondition_1d: bool = False,
    correct_bias: bool = True,
    normalize_gradient: bool = False,
    data_format: str = "channels_first",
    eps: float = 1e-8,
    inline_bases: bool = True,
) -> optax.GradientTransformation:
    """SOAP as an optax transformation (the returned updates already include ``-lr``).

    Args:
      learning_rate: step size, or a schedule of the step (``lr`` in pytorch_optimizer).
      betas: ``(b1, b2)``, the decay rates of Adam's moments.
      shampoo_beta: decay rate of the statistics ``L``, ``R``; ``None``: ``b2``.
      weight_decay: decoupled, ``p <- p (1 - lr weight_decay)`` after the step (``lr`` without
        bias correction).
      precondition_frequency: updates between two basis refreshes.
      max_precondition_dim: an axis longer than this has no basis (identity: one-sided SOAP);
        also the bound of ``merge_dims``.
      merge_dims: view each rank >= 2 parameter with small adjacent axes merged (see
        :mod:`~optserve.optim_kernels.soap.layout`).
      precondition_1d: give vectors a basis too (else they get plain Adam).
      correct_bias: Adam's bias correction, applied to the step size.
      normalize_gradient: divide the direction by its RMS (plus ``1e-30``).
      data_format: ``"channels_first"`` or ``"channels_last"`` (rank-4 NHWC tensors are merged
        as NCHW under ``merge_dims``).
      eps: added to ``sqrt(v)``.
      inline_bases: refresh the bases inside the update (else they come from outside, see
        :mod:`~optserve.optim_kernels.soap.seam`).

    Shapes: every state tensor is f32; moments in each parameter's working shape, one ``[d, d]``
    statistic and basis per preconditioned axis (:class:`~optserve.optim_kernels.soap.state.SoapState`).
    Updates come back in each parameter's dtype.

    Differences from ``pytorch_optimizer.SOAP`` 4.1.0 (the first moment kept in the eigenbasis,
    a refreshed basis' column order, ``normalize_gradient``'s guard, ``merge_dims``, no
    ``maximize``): ``docs/optimizers/soap.md``.

    Raises:
      ValueError: an option out of range, naming it; ``update`` without ``params`` when
        ``weight_decay`` is set.
    """
    config = SoapConfig(**locals())

    def init_fn(params):
        return init_state(config, params)

    def update_fn(updates, state, params=None):
        check_tree(config, state, updates, "updates")
        if params is None:
            if config.weight_decay:
                raise ValueError("soap: weight_decay needs params in update()")
            params = updates
        count = state.count
        lr = config.learning_rate(count) if callable(config.learning_rate) else config.learning_rate
        step_size = _step_size(config, lr, count)
        first = count == 0
        treedef = jax.tree.structure(updates)
        new_updates, new_pstates = [], []
        for g, ps, p in zip(jax.tree.leaves(updates), param_states(state), jax.tree.leaves(params)):
            update, new_ps = _param_step(config, g, ps, p, lr, step_size, first)
            new_updates.append(update)
            new_pstates.append(new_ps)
        state = state._replace(params=jax.tree.unflatten(treedef, new_pstates))
        state = fold_statistics(config, state, updates)
        if config.inline_bases:
            state = refresh_bases(config, state)
        return jax.tree.unflatten(treedef, new_updates), SoapState(count + 1, state.params, state.basis_info)

    return optax.GradientTransformation(init_fn, update_fn)
