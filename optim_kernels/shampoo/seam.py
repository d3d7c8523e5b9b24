"""Shampoo's root offload seam: its inverse roots computed outside its update.

With ``inline_preconditioners=False`` the update never computes roots; it preconditions with
whatever the state holds (identity until the first install, which with the default grafting
reproduces the grafted step's norm). Roots are then produced outside with pure functions:

* :func:`export_statistics` ``(state, config, grads=None) -> StatisticsExport``: every statistic
  of the whole tree, identity-padded to ``[B, n, n]`` in export order (see
  :mod:`~optserve.optim_kernels.shampoo.state`), with ``exponents [B]``, real ``sizes [B]`` and
  ``step``: the index of the last update whose gradient the statistics contain. Given the pending
  ``grads`` of the next update it returns the statistics that update will hold
  (``step = state.count``).
* :func:`~optserve.optim_kernels.linalg.matrix_roots.inverse_pth_roots` ``(statistics, exponents,
  sizes, root_config) -> (roots [B, n, n], errors [B])`` with ``root_config = config.root_config``
  (:class:`~optserve.optim_kernels.linalg.root_config.RootConfig`): pure and jittable; what
  workers run. Identity padding (inside a matrix when ``sizes`` is given, or extra identity
  blocks) does not change the real blocks' results. float64 when ``jax_enable_x64`` is on.
  :func:`compute_preconditioners` is the same with keyword options.
* :func:`install_preconditioners` ``(state, config, roots, errors, step) -> state``: per block,
  keeps the previous preconditioner where ``error >= inverse_failure_threshold`` or is NaN (and
  counts a failure), else installs the new one and records ``step`` as its source;
  :func:`preconditioner_age` is then ``state.count - source_step`` (the age at the next update).

Age-0 equivalence: calling ``export(state, config, grads) -> compute -> install`` right before
``update(grads, ...)`` on the steps where ``count % preconditioning_compute_steps == 0`` gives
exactly the in-process trajectory (the in-process update runs the same functions,
:func:`refresh_preconditioners`). Calling them right after an update gives age-1 preconditioners,
the natural asynchronous mode.

:func:`block_labels` names each position of an export (which tensor, block and dimension), and
the small accessors at the end (:func:`without_inline_roots`, :func:`root_config`,
:func:`compute_steps`, :func:`progress`) are what the registry's ``RootOffloadSeam`` hands to a
server, so that it never needs to know it is running Shampoo.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from optserve.optim_kernels.linalg.matrix_roots import inverse_pth_roots
from optserve.optim_kernels.linalg.root_config import RootConfig, root_method_config
from optserve.optim_kernels.shampoo.config import ShampooConfig
from optserve.optim_kernels.shampoo.quantization import decode, encode_matrix
from optserve.optim_kernels.shampoo.state import (
    ParamState,
    PreconditionerInfo,
    ShampooState,
    check_tree,
    param_states,
    update_statistics,
)

__all__ = [
    "BlockLabel",
    "StatisticsExport",
    "block_labels",
    "compute_preconditioners",
    "compute_steps",
    "export_statistics",
    "install_preconditioners",
    "preconditioner_age",
    "progress",
    "refresh_preconditioners",
    "root_config",
    "without_inline_roots",
]


class StatisticsExport(NamedTuple):
    """What a preconditioner worker receives.

    Attributes:
      statistics: f32 [B, n, n], each block's statistic in its top-left corner, identity below.
      exponents: int32 [B], the root ``p`` of each block.
      sizes: int32 [B], each block's real size.
      step: int32 scalar, the index of the last update whose gradient the statistics contain.
    """

    statistics: jax.Array
    exponents: jax.Array
    sizes: jax.Array
    step: jax.Array


@dataclasses.dataclass(frozen=True)
class BlockLabel:
    """Which statistic one position of an export is.

    Attributes:
      tensor: the parameter's name.
      block: the block's index, row-major over the parameter's block grid.
      dim: the block dimension the statistic belongs to.
      size: the statistic is a ``size x size`` matrix.
    """

    tensor: str
    block: int
    dim: int
    size: int


def block_labels(config: ShampooConfig, shapes: Mapping[str, Sequence[int]]) -> list[BlockLabel]:
    """Labels in export order for the parameters ``shapes`` (name -> shape) of a dict pytree,
    whose tensors flatten in sorted-name order; parameters that are not preconditioned have none."""
    labels = []
    for name in sorted(shapes):
        layout = config.layout(tuple(shapes[name]))
        if layout is None:
            continue
        for b, block in enumerate(layout.block_shapes):
            labels.extend(BlockLabel(name, b, k, d) for k, d in enumerate(block))
    return labels


def export_statistics(state: ShampooState, config: ShampooConfig, grads=None) -> StatisticsExport:
    """The identity-padded stack of all statistics (see the module docstring).

    With ``grads`` (the pending gradients of the next update) the statistics are those the next
    update will hold and ``step = state.count``; without, ``step = state.count - 1``.
    """
    if grads is None:
        return _stack_statistics(state, state.count - 1)
    check_tree(state, grads, "grads")
    return _stack_statistics(update_statistics(config, state, grads), state.count)


def _stack_statistics(state: ShampooState, step) -> StatisticsExport:
    mats = [decode(s) for ps in param_states(state) for s in ps.statistics]
    step = jnp.asarray(step, jnp.int32)
    if not mats:
        empty = jnp.zeros((0,), jnp.int32)
        return StatisticsExport(jnp.zeros((0, 1, 1), jnp.float32), empty, empty, step)
    n = max(m.shape[0] for m in mats)
    padded = [jnp.pad(m, ((0, n - m.shape[0]),) * 2) + jnp.diag((jnp.arange(n) >= m.shape[0]).astype(m.dtype))
              for m in mats]
    sizes = jnp.asarray([m.shape[0] for m in mats], jnp.int32)
    return StatisticsExport(jnp.stack(padded), state.preconditioner_info.exponents, sizes, step)


def compute_preconditioners(
    stacked_statistics: jax.Array,
    exponents: jax.Array,
    *,
    sizes: Optional[jax.Array] = None,
    matrix_epsilon: float = 1e-6,
    method: Any = "coupled_newton",
    relative_matrix_epsilon: bool = True,
    error_tolerance: Optional[float] = None,
    num_iters: int = 100,
    precision=lax.Precision.HIGHEST,
) -> tuple[jax.Array, jax.Array]:
    """Inverse p-th roots of a stack of statistics, with the root options as keywords.

    The keyword form of :func:`~optserve.optim_kernels.linalg.matrix_roots.inverse_pth_roots`:
    ``method`` is a name (``"coupled_newton"``, ``"eigh"``, ``"auto"``) or a typed root method,
    ``error_tolerance`` and ``num_iters`` configure coupled Newton, ``matrix_epsilon`` and
    ``relative_matrix_epsilon`` the ridge.

    Returns:
      ``(preconditioners, errors)``: [B, n, n] in the input dtype (zero past each size) and
      f32 [B] errors (``inf`` for non-finite input).
    """
    config = RootConfig(root_method_config(method, num_iters, error_tolerance), matrix_epsilon,
                        relative_matrix_epsilon)
    return inverse_pth_roots(stacked_statistics, exponents, sizes, config, precision=precision)


def install_preconditioners(
    state: ShampooState, config: ShampooConfig, preconditioners: jax.Array, errors: jax.Array, step
) -> ShampooState:
    """Installs roots computed from an export (see the module docstring).

    Args:
      state: the state to update (may have advanced since the export).
      config: the optimizer's config (for ``inverse_failure_threshold`` and quantization).
      preconditioners: [B, n, n] as returned by the root computation.
      errors: [B] their errors.
      step: the export's ``step``.
    """
    info = state.preconditioner_info
    count = info.source_step.shape[0]
    if preconditioners.shape[0] != count or errors.shape != (count,):
        raise ValueError(
            f"preconditioners: expected [{count}, n, n] roots and [{count}] errors for this state, "
            f"got {preconditioners.shape} and {errors.shape}")
    errors = errors.astype(jnp.float32)
    failed = jnp.logical_or(jnp.isnan(errors), errors >= config.inverse_failure_threshold)
    q = config.best_effort_memory_usage_reduction
    treedef = jax.tree.structure(state.params, is_leaf=lambda x: isinstance(x, ParamState))
    new_pstates, k = [], 0
    for ps in param_states(state):
        new_p = []
        for old in ps.preconditioners:
            d = decode(old).shape[0]
            root = preconditioners[k, :d, :d].astype(jnp.float32)
            new_p.append(encode_matrix(jnp.where(failed[k], decode(old), root), q))
            k += 1
        new_pstates.append(ps._replace(preconditioners=tuple(new_p)))
    new_info = PreconditionerInfo(
        exponents=info.exponents,
        source_step=jnp.where(failed, info.source_step, jnp.asarray(step, jnp.int32)),
        failures=info.failures + failed.astype(jnp.int32),
        last_error=errors,
    )
    return state._replace(params=jax.tree.unflatten(treedef, new_pstates), preconditioner_info=new_info)


def preconditioner_age(state: ShampooState) -> jax.Array:
    """int32 [B]: how many steps old each preconditioner will be at the next update."""
    return state.count - state.preconditioner_info.source_step


def refresh_preconditioners(config: ShampooConfig, state: ShampooState) -> ShampooState:
    """In-process mode: export -> compute -> install, on preconditioning steps.

    Runs inside update ``state.count`` after its gradient is folded in, so the export's step is
    ``state.count`` (the same as ``export_statistics(state_before_update, config, grads)``).
    """
    roots_config = config.root_config

    def refresh(s):
        exported = _stack_statistics(s, s.count)
        roots, errors = inverse_pth_roots(exported.statistics, exported.exponents, exported.sizes, roots_config)
        return install_preconditioners(s, config, roots, errors, exported.step)

    if config.preconditioning_compute_steps == 1:
        return refresh(state)
    due = state.count % config.preconditioning_compute_steps == 0
    return lax.cond(due, refresh, lambda s: s, state)


# ------------------------------------------------------------- accessors for the registry's seam


def without_inline_roots(args: Mapping[str, Any]) -> dict:
    """The options of the same optimizer with roots left to :func:`install_preconditioners`."""
    return dict(args, inline_preconditioners=False)


def root_config(config: ShampooConfig) -> RootConfig:
    """The typed, picklable description of the root computation (``config.root_config``)."""
    return config.root_config


def compute_steps(config: ShampooConfig) -> int:
    """Updates between two root computations (``preconditioning_compute_steps``)."""
    return config.preconditioning_compute_steps


def progress(state: ShampooState) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(count, source_step [B], failures [B], last_error [B])`` of a state, for status reports."""
    info = state.preconditioner_info
    return state.count, info.source_step, info.failures, info.last_error
