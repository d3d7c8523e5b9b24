"""Shampoo's state and the tree-level bookkeeping shared by the update and the offload seam.

The state holds one :class:`ParamState` per parameter (same tree as the params) and one
:class:`PreconditionerInfo` over every statistic of the tree, in *export order*: parameters in
tree-flatten order (sorted names for a dict), then blocks row-major over each parameter's block
grid, then the dimensions of each block.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from optserve.optim_kernels.shampoo.blocking import BlockLayout
from optserve.optim_kernels.shampoo.config import ShampooConfig
from optserve.optim_kernels.shampoo.grafting import has_diagonal_statistics
from optserve.optim_kernels.shampoo.quantization import decode, encode_diagonal, encode_matrix, encode_momentum
from optserve.optim_kernels.shampoo.statistics import init_statistics, update_block_statistics

__all__ = [
    "ParamState",
    "PreconditionerInfo",
    "ShampooState",
    "check_tree",
    "init_state",
    "param_states",
    "update_statistics",
]


class ParamState(NamedTuple):
    """Shampoo state of one parameter.

    Attributes:
      diagonal_statistics: grafting accumulator (shape of the parameter) or ``None``.
      statistics: one [d, d] matrix per block dimension (blocks row-major), maybe quantized.
      preconditioners: same shapes as ``statistics``; identity at init.
      diagonal_momentum: momentum of the grafted direction (shape of the parameter).
      momentum: momentum of the Shampoo direction (shape of the parameter).
    """

    diagonal_statistics: Any
    statistics: tuple
    preconditioners: tuple
    diagonal_momentum: Any
    momentum: Any


class PreconditionerInfo(NamedTuple):
    """Per-statistic bookkeeping over the whole tree, in export order ([B] each).

    Attributes:
      exponents: the root ``p`` of each statistic (constant).
      source_step: step of the statistics each preconditioner was computed from (-1: identity
        from init).
      failures: number of rejected roots (error above the threshold or NaN).
      last_error: error of the latest root offered for the block.
    """

    exponents: jax.Array
    source_step: jax.Array
    failures: jax.Array
    last_error: jax.Array


class ShampooState(NamedTuple):
    """``count``: int32 updates taken; ``params``: a :class:`ParamState` per parameter;
    ``preconditioner_info``: see :class:`PreconditionerInfo`."""

    count: jax.Array
    params: Any
    preconditioner_info: PreconditionerInfo


def init_state(config: ShampooConfig, params) -> ShampooState:
    """Statistics at ``matrix_epsilon * I``, identity preconditioners, zero momenta."""
    q = config.best_effort_memory_usage_reduction
    exponents = []

    def init_one(p):
        layout = config.layout(p.shape)
        stats: tuple = ()
        precs: tuple = ()
        if layout is not None:
            sizes = layout.statistic_sizes
            stats = tuple(encode_matrix(s, q) for s in init_statistics(sizes, config.matrix_epsilon))
            precs = tuple(encode_matrix(jnp.eye(d, dtype=jnp.float32), q) for d in sizes)
            exponents.extend([config.exponent(layout)] * len(sizes))
        zeros = jnp.zeros(p.shape, jnp.float32)
        diag = encode_diagonal(zeros, q) if has_diagonal_statistics(config.graft_type) else None
        return ParamState(diag, stats, precs, encode_momentum(zeros, q), encode_momentum(zeros, q))

    pstates = jax.tree.map(init_one, params)
    b = len(exponents)
    info = PreconditionerInfo(
        exponents=jnp.asarray(exponents, jnp.int32),
        source_step=jnp.full((b,), -1, jnp.int32),
        failures=jnp.zeros((b,), jnp.int32),
        last_error=jnp.zeros((b,), jnp.float32),
    )
    return ShampooState(jnp.zeros([], jnp.int32), pstates, info)


def param_states(state: ShampooState) -> list[ParamState]:
    """The per-parameter states in tree-flatten order."""
    return jax.tree.leaves(state.params, is_leaf=lambda x: isinstance(x, ParamState))


def check_tree(state: ShampooState, tree, what: str) -> None:
    """Raises ValueError naming the tensor when ``tree`` does not match the state's parameters."""
    pstates = param_states(state)
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    if len(leaves) != len(pstates):
        raise ValueError(f"shampoo: {what} has {len(leaves)} tensors but the state was built for {len(pstates)}")
    for (path, leaf), ps in zip(leaves, pstates):
        expected = decode(ps.diagonal_momentum).shape
        if tuple(leaf.shape) != tuple(expected):
            raise ValueError(f"shampoo: {what} at {jax.tree_util.keystr(path)!r} has shape {tuple(leaf.shape)}, "
                             f"the state was built for {tuple(expected)}")


def _fold_statistics(config: ShampooConfig, param_state: ParamState, layout: BlockLayout, grad) -> tuple:
    rank = len(layout.working_shape)
    blocks = layout.split(grad.astype(jnp.float32))
    stats = [decode(s) for s in param_state.statistics]
    new = []
    for j, block in enumerate(blocks):
        new += update_block_statistics(stats[j * rank:(j + 1) * rank], block, config.beta2)
    q = config.best_effort_memory_usage_reduction
    return tuple(encode_matrix(s, q) for s in new)


def update_statistics(config: ShampooConfig, state: ShampooState, grads) -> ShampooState:
    """Folds ``grads`` into the statistics if ``state.count`` is a statistics step."""
    treedef = jax.tree.structure(grads)
    new_pstates = []
    for g, ps in zip(jax.tree.leaves(grads), param_states(state)):
        layout = config.layout(g.shape)
        if layout is None or not ps.statistics:
            new_pstates.append(ps)
            continue
        if config.statistics_compute_steps == 1:
            stats = _fold_statistics(config, ps, layout, g)
        else:
            stats = lax.cond(state.count % config.statistics_compute_steps == 0,
                             lambda: _fold_statistics(config, ps, layout, g), lambda: ps.statistics)
        new_pstates.append(ps._replace(statistics=stats))
    return state._replace(params=jax.tree.unflatten(treedef, new_pstates))
