"""SOAP's state and the tree-level bookkeeping shared by the update and the offload seam.

The state holds one :class:`ParamState` per parameter (same tree as the params) and one
:class:`BasisInfo` over every statistic of the tree, in *export order*: parameters in
tree-flatten order (sorted names for a dict), then each parameter's preconditioned working axes.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from optserve.optim_kernels.soap.config import SoapConfig
from optserve.optim_kernels.soap.layout import SoapLayout
from optserve.optim_kernels.soap.projection import axis_statistic

__all__ = [
    "BasisInfo",
    "ParamState",
    "SoapState",
    "check_tree",
    "fold_statistics",
    "init_state",
    "param_states",
    "preconditioned_axes",
]


class ParamState(NamedTuple):
    """SOAP state of one parameter (all f32, in its layout's working shape).

    Attributes:
      exp_avg: Adam's first moment, in the eigenbasis (coordinates of :func:`~.projection.rotate`).
      exp_avg_sq: Adam's second moment, in the eigenbasis.
      statistics: one ``[d, d]`` EMA of the gradient's outer products per preconditioned axis.
      bases: one orthogonal ``[d, d]`` per preconditioned axis (columns = basis vectors); the
        identity until the first refresh.
    """

    exp_avg: jax.Array
    exp_avg_sq: jax.Array
    statistics: tuple
    bases: tuple


class BasisInfo(NamedTuple):
    """Per-statistic bookkeeping over the whole tree, in export order ([B] each).

    Attributes:
      source_step: the last step whose gradient the basis' statistics contain (-1: identity from init).
      failures: refreshes refused (non-finite, or not orthogonal).
      last_error: orthogonality error of the latest basis offered (``inf``: not finite).
    """

    source_step: jax.Array
    failures: jax.Array
    last_error: jax.Array


class SoapState(NamedTuple):
    """``count``: int32 updates taken; ``params``: a :class:`ParamState` per parameter;
    ``basis_info``: see :class:`BasisInfo`."""

    count: jax.Array
    params: Any
    basis_info: BasisInfo


def init_state(config: SoapConfig, params) -> SoapState:
    """Zero moments and statistics, identity bases."""
    blocks = 0

    def init_one(p):
        nonlocal blocks
        layout = SoapLayout.create(p.shape, config)
        sizes = layout.statistic_sizes
        blocks += len(sizes)
        # distinct arrays, never one buffer twice: a jitted step donates the state
        return ParamState(jnp.zeros(layout.working_shape, jnp.float32), jnp.zeros(layout.working_shape, jnp.float32),
                          tuple(jnp.zeros((d, d), jnp.float32) for d in sizes),
                          tuple(jnp.eye(d, dtype=jnp.float32) for d in sizes))

    pstates = jax.tree.map(init_one, params)
    info = BasisInfo(jnp.full((blocks,), -1, jnp.int32), jnp.zeros((blocks,), jnp.int32),
                     jnp.zeros((blocks,), jnp.float32))
    return SoapState(jnp.zeros([], jnp.int32), pstates, info)


def param_states(state: SoapState) -> list[ParamState]:
    """The per-parameter states in tree-flatten order."""
    return jax.tree.leaves(state.params, is_leaf=lambda x: isinstance(x, ParamState))


def check_tree(config: SoapConfig, state: SoapState, tree, what: str) -> None:
    """Raises ValueError naming the tensor when ``tree`` does not match the state's parameters."""
    pstates = param_states(state)
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    if len(leaves) != len(pstates):
        raise ValueError(f"soap: {what} has {len(leaves)} tensors but the state was built for {len(pstates)}")
    for (path, leaf), ps in zip(leaves, pstates):
        layout = SoapLayout.create(leaf.shape, config)
        if layout.working_shape != tuple(ps.exp_avg.shape) or len(layout.axes) != len(ps.bases):
            raise ValueError(f"soap: {what} at {jax.tree_util.keystr(path)!r} has shape {tuple(leaf.shape)}, "
                             f"which does not match the state (working shape {tuple(ps.exp_avg.shape)})")


def fold_statistics(config: SoapConfig, state: SoapState, grads) -> SoapState:
    """Folds ``grads`` into each statistic: ``S <- S + (1 - shampoo_beta) (G_a G_a^T - S)``."""
    weight = 1.0 - config.statistics_beta
    treedef = jax.tree.structure(grads)
    new = []
    for g, ps in zip(jax.tree.leaves(grads), param_states(state)):
        layout = SoapLayout.create(g.shape, config)
        if not layout.axes:
            new.append(ps)
            continue
        x = layout.to_working(g.astype(jnp.float32))
        stats = tuple(s + weight * (axis_statistic(x, a) - s) for s, a in zip(ps.statistics, layout.axes))
        new.append(ps._replace(statistics=stats))
    return state._replace(params=jax.tree.unflatten(treedef, new))


def preconditioned_axes(config: SoapConfig, ps: ParamState) -> tuple[int, ...]:
    """The working axes ``ps.bases`` belong to (what :attr:`SoapLayout.axes` gave at init)."""
    working = ps.exp_avg.shape
    if len(working) == 1:
        return (0,) if ps.bases else ()
    return tuple(a for a, d in enumerate(working) if d <= config.max_precondition_dim)
