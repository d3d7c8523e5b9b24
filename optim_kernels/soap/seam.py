"""SOAP's basis refresh seam: its eigenbases computed outside its update.

With ``inline_bases=False`` the update never refreshes a basis; it rotates with whatever the
state holds (the identity until the first install: plain Adam, SOAP's own fallback). Bases are
then produced outside with pure functions, through the same ``RootOffloadSeam`` Shampoo's
inverse roots use (``registry.py``):

* :func:`export_bases` ``(state, config, grads=None) -> BasisExport``: every statistic of the tree
  zero-padded to ``[B, n, n]`` in export order (see :mod:`~optserve.optim_kernels.soap.state`),
  the bases in use identity-padded the same way (``previous``), each block's refresh kind
  (``exponents``: ``REFRESH_EIGH`` for a block without a basis yet, else ``REFRESH_POWER``), real
  ``sizes [B]`` and ``step``, the last update whose gradient the statistics contain.
* :func:`~optserve.optim_kernels.soap.bases.compute_bases` ``(statistics, kinds, sizes, config,
  previous) -> (bases [B, n, n], errors [B])``: pure and jittable; what workers run.
* :func:`install_bases` ``(state, config, bases, errors, step) -> state``: per block, keeps the
  basis in use where ``error`` is not finite or above :data:`MAX_ORTHOGONALITY_ERROR` (and counts
  a failure), else installs the new one, re-projects the first moment into it
  (:func:`~optserve.optim_kernels.soap.projection.change_basis`, from the basis the state holds
  *now*, so a late install is as exact as a prompt one) and records ``step`` as its source. The
  second moment stays coordinate for coordinate, as in the paper (the new basis keeps the old
  one's column order, :mod:`~optserve.optim_kernels.soap.bases`).

Schedule: in process, update ``t`` rotates with the basis in the state, then folds its gradient
into the statistics and, when ``t % precondition_frequency == 0``, refreshes (export -> compute ->
install, :func:`refresh_bases`). So a basis of step ``s`` is first used by update ``s + 1``: the
seam's ``lag`` is 1 (Shampoo's is 0, its roots are used by the update that computed them).
Calling ``export(state) -> compute -> install`` right after update ``t`` (``t`` a refresh step)
and before update ``t + 1`` therefore gives exactly the in-process trajectory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from optserve.optim_kernels.shampoo.seam import BlockLabel
from optserve.optim_kernels.soap.bases import (
    REFRESH_EIGH,
    REFRESH_POWER,
    BasisConfig,
    compute_bases,
)
from optserve.optim_kernels.soap.config import SoapConfig
from optserve.optim_kernels.soap.layout import SoapLayout
from optserve.optim_kernels.soap.projection import change_basis, transition
from optserve.optim_kernels.soap.state import (
    BasisInfo,
    ParamState,
    SoapState,
    check_tree,
    fold_statistics,
    param_states,
    preconditioned_axes,
)

__all__ = [
    "LAG",
    "MAX_ORTHOGONALITY_ERROR",
    "BasisExport",
    "basis_age",
    "basis_config",
    "block_labels",
    "compute_steps",
    "export_bases",
    "install_bases",
    "progress",
    "refresh_bases",
    "without_inline_bases",
]

# A refreshed basis farther than this from orthogonal (its error from compute_bases) is refused.
MAX_ORTHOGONALITY_ERROR = 1e-3
# Updates between the last gradient of a refresh's statistics and the first update using it.
LAG = 1


class BasisExport(NamedTuple):
    """What a preconditioner worker receives (the seam's export, with its second stacked input).

    Attributes:
      statistics: f32 [B, n, n], each block's statistic in its top-left corner, zero below.
      exponents: int32 [B], the seam's per-block code: here each block's refresh kind.
      sizes: int32 [B], each block's real size.
      step: int32 scalar, the index of the last update whose gradient the statistics contain.
      previous: f32 [B, n, n], the bases in use, identity-padded.
    """

    statistics: jax.Array
    exponents: jax.Array
    sizes: jax.Array
    step: jax.Array
    previous: jax.Array


def block_labels(config: SoapConfig, shapes: Mapping[str, Sequence[int]]) -> list[BlockLabel]:
    """Labels in export order for the parameters ``shapes`` (name -> shape) of a dict pytree, whose
    tensors flatten in sorted-name order: ``BlockLabel(tensor, 0, working axis, size)``."""
    labels = []
    for name in sorted(shapes):
        layout = SoapLayout.create(tuple(shapes[name]), config)
        labels.extend(BlockLabel(name, 0, a, layout.working_shape[a]) for a in layout.axes)
    return labels


def export_bases(state: SoapState, config: SoapConfig, grads=None) -> BasisExport:
    """The padded stacks of all statistics and bases (see the module docstring).

    With ``grads`` (the pending gradients of the next update) the statistics are those after that
    update folds them in and ``step = state.count``; without, ``step = state.count - 1``.
    """
    if grads is None:
        return _stack(state, state.count - 1)
    check_tree(config, state, grads, "grads")
    return _stack(fold_statistics(config, state, grads), state.count)


def _stack(state: SoapState, step) -> BasisExport:
    pstates = param_states(state)
    stats = [s for ps in pstates for s in ps.statistics]
    bases = [q for ps in pstates for q in ps.bases]
    step = jnp.asarray(step, jnp.int32)
    if not stats:
        empty = jnp.zeros((0,), jnp.int32)
        nothing = jnp.zeros((0, 1, 1), jnp.float32)
        return BasisExport(nothing, empty, empty, step, nothing)
    n = max(s.shape[0] for s in stats)

    def pad(m, fill_identity: bool):
        d = m.shape[0]
        padded = jnp.pad(m, ((0, n - d),) * 2)
        return padded + jnp.diag((jnp.arange(n) >= d).astype(m.dtype)) if fill_identity else padded

    kinds = jnp.where(state.basis_info.source_step < 0, REFRESH_EIGH, REFRESH_POWER).astype(jnp.int32)
    sizes = jnp.asarray([s.shape[0] for s in stats], jnp.int32)
    return BasisExport(jnp.stack([pad(s, False) for s in stats]), kinds, sizes, step,
                       jnp.stack([pad(q, True) for q in bases]))


def install_bases(state: SoapState, config: SoapConfig, bases: jax.Array, errors: jax.Array, step) -> SoapState:
    """Installs bases computed from an export (see the module docstring).

    Args:
      state: the state to update (may have advanced since the export).
      config: the optimizer's config.
      bases: [B, n, n] as returned by :func:`~optserve.optim_kernels.soap.bases.compute_bases`.
      errors: [B] their errors.
      step: the export's ``step``.
    """
    info = state.basis_info
    count = info.source_step.shape[0]
    if bases.shape[0] != count or errors.shape != (count,):
        raise ValueError(f"soap bases: expected [{count}, n, n] bases and [{count}] errors for this state, "
                         f"got {bases.shape} and {errors.shape}")
    errors = errors.astype(jnp.float32)
    failed = jnp.logical_not(jnp.isfinite(errors)) | (errors > MAX_ORTHOGONALITY_ERROR)
    treedef = jax.tree.structure(state.params, is_leaf=lambda x: isinstance(x, ParamState))
    new_pstates, k = [], 0
    for ps in param_states(state):
        installed, transitions = [], []
        for old in ps.bases:
            d = old.shape[0]
            new = bases[k, :d, :d].astype(jnp.float32)
            installed.append(jnp.where(failed[k], old, new))
            transitions.append(jnp.where(failed[k], jnp.eye(d, dtype=jnp.float32), transition(old, new)))
            k += 1
        exp_avg = change_basis(ps.exp_avg, transitions, preconditioned_axes(config, ps))
        new_pstates.append(ps._replace(exp_avg=exp_avg, bases=tuple(installed)))
    new_info = BasisInfo(
        source_step=jnp.where(failed, info.source_step, jnp.asarray(step, jnp.int32)),
        failures=info.failures + failed.astype(jnp.int32),
        last_error=errors,
    )
    return state._replace(params=jax.tree.unflatten(treedef, new_pstates), basis_info=new_info)


def basis_age(state: SoapState) -> jax.Array:
    """int32 [B]: how many steps old each basis' statistics will be at the next update."""
    return state.count - state.basis_info.source_step


def refresh_bases(config: SoapConfig, state: SoapState) -> SoapState:
    """In-process mode: export -> compute -> install on refresh steps.

    Runs inside update ``state.count`` after its gradient is folded in, so the export's step is
    ``state.count`` (the same as ``export_bases`` called right after that update).
    """
    basis_settings = BasisConfig()

    def refresh(s):
        exported = _stack(s, s.count)
        new, errors = compute_bases(exported.statistics, exported.exponents, exported.sizes, basis_settings,
                                    exported.previous)
        return install_bases(s, config, new, errors, exported.step)

    if not state.basis_info.source_step.shape[0]:
        return state
    if config.precondition_frequency == 1:
        return refresh(state)
    return lax.cond(state.count % config.precondition_frequency == 0, refresh, lambda s: s, state)


# ------------------------------------------------------------- accessors for the registry's seam


def without_inline_bases(args: Mapping[str, Any]) -> dict:
    """The options of the same optimizer with bases left to :func:`install_bases`."""
    return dict(args, inline_bases=False)


def basis_config(config: SoapConfig) -> BasisConfig:
    """The typed, picklable description of the refresh computation."""
    del config
    return BasisConfig()


def compute_steps(config: SoapConfig) -> int:
    """Updates between two refreshes (``precondition_frequency``)."""
    return config.precondition_frequency


def progress(state: SoapState) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(count, source_step [B], failures [B], last_error [B])`` of a state, for status reports."""
    info = state.basis_info
    return state.count, info.source_step, info.failures, info.last_error
