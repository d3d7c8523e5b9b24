"""Shampoo (google-research distributed Shampoo semantics) as an optax transformation.

``shampoo(learning_rate, block_size, ...)`` takes the seed's option names and defaults (see
:mod:`~optserve.optim_kernels.shampoo.config` for optserve's additions). One update at step
``t = state.count``:

1. every ``statistics_compute_steps``: fold the gradient into each block's statistics
   (:mod:`~optserve.optim_kernels.shampoo.statistics`, blocks from
   :mod:`~optserve.optim_kernels.shampoo.blocking`);
2. with ``inline_preconditioners`` (the default), every ``preconditioning_compute_steps``: export
   the statistics, compute their inverse roots and install them, exactly as the offload seam
   does (:mod:`~optserve.optim_kernels.shampoo.seam`); without, the state's roots are used as
   they are and come from outside;
3. graft (:mod:`~optserve.optim_kernels.shampoo.grafting`), precondition, rescale to the graft's
   norm, weight decay, momentum / nesterov; before ``start_preconditioning_step`` the grafted
   direction is used.
"""

from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp
import optax

from optserve.optim_kernels.linalg.root_config import RootMethodConfig
from optserve.optim_kernels.shampoo.config import ScalarOrSchedule, ShampooConfig
from optserve.optim_kernels.shampoo.grafting import GraftingType, graft_direction
from optserve.optim_kernels.shampoo.quantization import decode, encode_diagonal, encode_momentum
from optserve.optim_kernels.shampoo.seam import refresh_preconditioners
from optserve.optim_kernels.shampoo.state import (
    ParamState,
    ShampooState,
    check_tree,
    init_state,
    param_states,
    update_statistics,
)
from optserve.optim_kernels.shampoo.statistics import precondition_block

__all__ = ["shampoo"]

# Guards the norm ratio of grafting when the preconditioned direction is zero.
_TINY = 1e-25


def _transform(config: ShampooConfig, grad, ps: ParamState, param, count, lr) -> tuple[jax.Array, ParamState]:
    """The per-parameter step (grafting, preconditioning, weight decay, momentum)."""
    q = config.best_effort_memory_usage_reduction
    grad = grad.astype(jnp.float32)
    diag = None if ps.diagonal_statistics is None else decode(ps.diagonal_statistics)
    graft, new_diag = graft_direction(
        grad, diag, config.graft_type, beta2=config.beta2, diagonal_epsilon=config.diagonal_epsilon,
        clip_by_scaled_gradient_norm=config.clip_by_scaled_gradient_norm)
    if not config.decoupled_learning_rate:
        graft = graft * lr
    layout = config.layout(grad.shape)
    if layout is None:
        precond = graft
    else:
        rank = len(layout.working_shape)
        preconditioners = [decode(p) for p in ps.preconditioners]
        blocks = [precondition_block(b, preconditioners[j * rank:(j + 1) * rank])
                  for j, b in enumerate(layout.split(grad))]
        precond = layout.merge(blocks)
    if config.graft_type != GraftingType.NONE:
        precond = precond * (jnp.linalg.norm(graft) / (jnp.linalg.norm(precond) + _TINY))
    shampoo_dir, graft_dir = precond, graft
    if config.weight_decay and not config.decoupled_weight_decay:
        shampoo_dir = shampoo_dir + config.weight_decay * param
        graft_dir = graft_dir + config.weight_decay * param
    w = (1.0 - config.beta1) if config.moving_average_for_momentum else 1.0
    shampoo_mom = config.beta1 * decode(ps.momentum) + w * shampoo_dir
    graft_mom = config.beta1 * decode(ps.diagonal_momentum) + w * graft_dir
    run_shampoo = count >= config.start_preconditioning_step
    direction = jnp.where(run_shampoo, shampoo_mom, graft_mom)
    if config.nesterov:
        direction = w * jnp.where(run_shampoo, shampoo_dir, graft_dir) + config.beta1 * direction
    if config.weight_decay and config.decoupled_weight_decay:
        direction = direction + lr * config.weight_decay * param
    scale = lr if config.decoupled_learning_rate else 1.0
    update = -scale * direction
    new_ps = ParamState(
        diagonal_statistics=None if new_diag is None else encode_diagonal(new_diag, q),
        statistics=ps.statistics,
        preconditioners=ps.preconditioners,
        diagonal_momentum=encode_momentum(graft_mom, q),
        momentum=encode_momentum(shampoo_mom, q),
    )
    return update, new_ps


def shampoo(
    learning_rate: ScalarOrSchedule,
    block_size: int = 128,
    beta1: float = 0.9,
    beta2: float = 0.999,
    diagonal_epsilon: float = 1e-10,
    matrix_epsilon: float = 1e-6,
    weight_decay: float = 0.0,
    start_preconditioning_step: int = 5,
    preconditioning_compute_steps: int = 1,
    statistics_compute_steps: int = 1,
    best_effort_shape_interpretation: bool = True,
    graft_type: Union[GraftingType, int, str] = GraftingType.SGD,
    nesterov: bool = True,
    exponent_override: int = 0,
    best_effort_memory_usage_reduction: bool = False,
    inverse_failure_threshold: float = 0.1,
    moving_average_for_momentum: bool = False,
    skip_preconditioning_dim_size_gt: int = 4096,
    clip_by_scaled_gradient_norm: Optional[float] = None,
    relative_matrix_epsilon: bool = True,
    merge_small_dims_block_size: Optional[int] = None,
    decoupled_learning_rate: bool = True,
    decoupled_weight_decay: bool = False,
    root_method: Union[str, RootMethodConfig] = "coupled_newton",
    root_num_iters: int = 100,
    inline_preconditioners: bool = True,
) -> optax.GradientTransformation:
    """Shampoo as an optax transformation (the returned updates already include ``-lr``).

    Args are the fields of :class:`~optserve.optim_kernels.shampoo.config.ShampooConfig`, with
    the seed's names and defaults: ``graft_type`` may be a :class:`GraftingType`, its int value
    or its name; ``block_size`` defaults to 128 (the seed's recommendation; it has no default
    there); ``merge_small_dims_block_size=None`` merges small dimensions up to ``block_size`` (the
    seed's behaviour); ``root_method`` is ``"coupled_newton"`` (the seed's), ``"eigh"``, the
    opt-in ``"auto"`` (eigh on CPU, coupled Newton elsewhere) or a typed root method.

    Raises:
      ValueError: an option out of range, naming it.
    """
    config = ShampooConfig(**locals())

    def init_fn(params):
        return init_state(config, params)

    def update_fn(updates, state, params=None):
        check_tree(state, updates, "updates")
        if params is None:
            if config.weight_decay:
                raise ValueError("shampoo: weight_decay needs params in update()")
            params = updates
        state = update_statistics(config, state, updates)
        if config.inline_preconditioners:
            state = refresh_preconditioners(config, state)
        lr = config.learning_rate(state.count) if callable(config.learning_rate) else config.learning_rate
        treedef = jax.tree.structure(updates)
        outs = [
            _transform(config, g, ps, p, state.count, lr)
            for g, ps, p in zip(jax.tree.leaves(updates), param_states(state), jax.tree.leaves(params))
        ]
        new_updates = jax.tree.unflatten(treedef, [u.astype(g.dtype) for (u, _), g in
                                                   zip(outs, jax.tree.leaves(updates))])
        new_params_state = jax.tree.unflatten(treedef, [ps for _, ps in outs])
        return new_updates, ShampooState(state.count + 1, new_params_state, state.preconditioner_info)

    return optax.GradientTransformation(init_fn, update_fn)
