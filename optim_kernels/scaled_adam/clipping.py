"""ScaledAdam's gradient clipping: to ``clipping_scale`` times the median of recent norms.

The norm is taken over *RMS-weighted* gradients: each tensor's gradient times that tensor's
RMS (as last measured, every ``size_update_period`` steps), since ScaledAdam's step is scaled
by that RMS; scalars count with weight 1. Schedule, as in icefall's ``ScaledAdam``:

* step 0 records nothing and never clips;
* on step ``t >= 1`` the norm goes into slot ``t % clipping_update_period`` of a ring buffer;
* when ``t % clipping_update_period == 0`` the threshold becomes ``clipping_scale`` times the
  buffer's sorted entry at ``min(period - 1, 2 * (period // 4))`` (the median for periods
  that are multiples of 4) and the quartiles are logged;
* from ``t >= clipping_update_period`` on, gradients are scaled by
  ``min(1, threshold / (norm + 1e-20))``; below 0.1 a warning names the tensor that
  dominates the norm.

The factor scales the gradient that every later link sees (Adam step, scale gradients, scalar
step): the seed's docstring and later icefall (which scales ``p.grad`` in place) do this; the
seed's code scales a copy that only its scale gradients read, which we take for a bug.

Across shards, each shard's :func:`weighted_grad_sq_norm` is summed and passed to the update
as ``global_grad_sq_norm``; the ring buffer then holds the same history on every shard.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optserve.optim_kernels.scaled_adam.update import (
    initial_param_rms,
    is_scalar,
    measures_rms_at,
    tensor_rms,
)

logger = logging.getLogger(__name__)

_TINY = 1e-20


class ClipByMedianNormState(NamedTuple):
    """State of :func:`clip_by_median_norm`.

    Attributes:
      count: int32 scalar, steps taken so far.
      param_rms: f32 ``()`` per tensor (mirrors the params tree): the RMS each gradient is
        weighted by, re-measured on the same steps as the update's; ``1`` for scalars.
      norm_history: f32 ``(clipping_update_period,)``: ring buffer of recent weighted norms.
      threshold: f32 scalar: the current clipping threshold (meaningful once
        ``count >= clipping_update_period``).
      num_clipped: int32 scalar: clipped steps since the threshold was last set (logged).
    """

    count: jax.Array
    param_rms: Any
    norm_history: jax.Array
    threshold: jax.Array
    num_clipped: jax.Array


def median_index(period: int) -> int:
    """Index into the sorted history that the threshold is taken from."""
    return min(period - 1, 2 * (period // 4))


def quartile_indices(period: int) -> list[int]:
    """Indices into the sorted history of the five logged quartiles (min .. max)."""
    return [min(period - 1, n * (period // 4)) for n in range(5)]


def weighted_grad_sq_norm(grads: Any, param_rms: Any) -> jax.Array:
    """``sum over tensors of sum((grad * rms)**2)`` in f32; a partition's parts sum to it."""
    terms = jax.tree_util.tree_map(
        lambda g, r: jnp.sum(jnp.square(g.astype(jnp.float32) * r)), grads, param_rms
    )
    return sum(jax.tree_util.tree_leaves(terms), jnp.zeros((), jnp.float32))


def _log_quartiles(quartiles, threshold, percent_clipped, clipping_scale):
    text = " ".join(f"{float(q):.3e}" for q in quartiles)
    logger.info(
        "scaled_adam clipping_scale=%s, grad-norm quartiles %s, threshold=%.3e, "
        "percent-clipped=%.1f",
        clipping_scale,
        text,
        float(threshold),
        float(percent_clipped),
    )


def _warn_heavy_clip(factor, threshold):
    logger.warning("scaled_adam scaling gradients by %.3e, threshold=%.3e", factor, threshold)


def _log_dominant_tensor(names, tensor_sq, tot_sq, rms, grad_sq):
    tensor_sq = np.asarray(tensor_sq)
    top = int(np.argmax(tensor_sq))
    logger.info(
        "scaled_adam: tensor %s dominates the gradient norm with proportion %.2f "
        "(weighted sum of squares %.3e = grad sum of squares %.3e * rms^2 %.3e)",
        names[top],
        float(tensor_sq[top] / max(float(tot_sq), _TINY)),
        float(tensor_sq[top]),
        float(np.asarray(grad_sq)[top]),
        float(np.asarray(rms)[top]) ** 2,
    )


def clip_by_median_norm(
    clipping_scale: float,
    clipping_update_period: int,
    size_update_period: int,
    show_dominant_parameters: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """Scales gradients so their RMS-weighted norm is at most ``clipping_scale`` x median.

    Args:
      clipping_scale: multiple of the median recent norm that gradients are clipped to.
      clipping_update_period: length of the norm history and period of threshold updates.
      size_update_period: period of the RMS re-measurement (the same as the update link's).
      show_dominant_parameters: when a step is scaled by less than 0.1, log the tensor with
        the largest share of the squared norm (a ``jax.debug.callback``, only on such steps).

    Returns:
      A transformation whose ``update(grads, state, params, global_grad_sq_norm=None)``
      returns the clipped gradients; ``global_grad_sq_norm`` (f32 scalar), when given,
      replaces the weighted squared norm of this tree (the sum over all shards).
    """
    period = clipping_update_period
    mid = median_index(period)
    quartiles_at = jnp.asarray(quartile_indices(period))

    def init_fn(params):
        return _initial_state(params, period)

    def update_fn(updates, state, params=None, global_grad_sq_norm=None, **extra_args):
        del extra_args
        if params is None:
            raise ValueError("scaled_adam: clipping needs params (gradients are RMS-weighted)")
        count = state.count
        if global_grad_sq_norm is None:
            tot_sq = weighted_grad_sq_norm(updates, state.param_rms)
        else:
            tot_sq = jnp.asarray(global_grad_sq_norm, jnp.float32).reshape(())
        norm = jnp.sqrt(tot_sq)

        recorded = count > 0
        slot = count % period
        history = jnp.where(recorded, state.norm_history.at[slot].set(norm), state.norm_history)
        new_window = recorded & (slot == 0)
        ordered = jnp.sort(history)
        threshold = jnp.where(new_window, clipping_scale * ordered[mid], state.threshold)
        active = count >= period
        factor = jnp.where(active, jnp.minimum(1.0, threshold / (norm + _TINY)), 1.0)
        num_clipped = jnp.where(new_window, 0, state.num_clipped) + (factor < 1.0).astype(
            jnp.int32
        )

        percent = state.num_clipped.astype(jnp.float32) * (100.0 / period)
        jax.lax.cond(
            new_window,
            lambda: jax.debug.callback(
                _log_quartiles, ordered[quartiles_at], threshold, percent, clipping_scale
            ),
            lambda: None,
        )
        jax.lax.cond(
            factor < 0.1,
            lambda: _report_heavy_clip(updates, state.param_rms, factor, threshold, tot_sq, show_dominant_parameters),
            lambda: None,
        )

        clipped = jax.tree_util.tree_map(lambda g: (g * factor).astype(g.dtype), updates)
        new_state = ClipByMedianNormState(
            count=optax.safe_int32_increment(count),
            param_rms=_remeasured_rms(params, state.param_rms, count, size_update_period),
            norm_history=history,
            threshold=threshold,
            num_clipped=num_clipped,
        )
        return clipped, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _report_heavy_clip(updates, param_rms, factor, threshold, tot_sq, show_dominant_parameters: bool) -> None:
    """Inside a ``lax.cond`` taken only on steps scaled below 0.1: warns with ``factor`` and
    ``threshold`` and, with ``show_dominant_parameters``, logs the tensor with the largest share
    of ``tot_sq`` (the per-tensor sums are computed here, on those steps only)."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(updates)
    names = [jax.tree_util.keystr(path) for path, _ in paths]
    grads = [g for _, g in paths]
    rms = treedef.flatten_up_to(param_rms)
    jax.debug.callback(_warn_heavy_clip, factor, threshold)
    if show_dominant_parameters and grads:
        grad_sq = jnp.stack([jnp.sum(jnp.square(g.astype(jnp.float32))) for g in grads])
        rms_vec = jnp.stack(rms)
        jax.debug.callback(
            lambda *a: _log_dominant_tensor(names, *a),
            grad_sq * jnp.square(rms_vec),
            tot_sq,
            rms_vec,
            grad_sq,
        )


def _initial_state(params, period: int) -> ClipByMedianNormState:
    """Count 0, an all-zero norm history and threshold, each tensor's RMS as measured now."""
    return ClipByMedianNormState(
        count=jnp.zeros((), jnp.int32),
        param_rms=jax.tree_util.tree_map(initial_param_rms, params),
        norm_history=jnp.zeros((period,), jnp.float32),
        threshold=jnp.zeros((), jnp.float32),
        num_clipped=jnp.zeros((), jnp.int32),
    )


def _remeasured_rms(params, param_rms, count, size_update_period: int):
    """``param_rms`` after step ``count``: each tensor's RMS re-measured on the steps
    :func:`~.update.measures_rms_at` names; scalars keep theirs (1)."""
    measure = measures_rms_at(count, size_update_period)
    return jax.tree_util.tree_map(
        lambda p, r: r if is_scalar(p.shape) else jnp.where(measure, tensor_rms(p), r),
        params,
        param_rms,
    )
