"""Adafactor's single-purpose links, each an optax transformation, chained by the variants.

Every link maps a pytree of updates (same structure and shapes as the params) to a new one.
Links that need per-parameter axes take a ``factoring(path, shape) -> FactorSpec`` callable
(see :mod:`optserve.optim_kernels.adafactor.factoring`); ``None`` means "one block per tensor, every
axis averaged". Math is float32 whatever the param/grad dtype; the updates leave every link in
float32, so ``optax.apply_updates`` adds them to bf16/f16 params in float32 and rounds once.

The links, by module (names are stable; other kernels import them):

* here: :func:`check_inputs` -- ValueError on trees/shapes that do not match the params;
  :func:`clip_by_global_norm` -- T5X global-norm clip, accepts ``global_grad_sq_norm``;
  :func:`scale_by_param_block_rms` -- multiply by clip(rms(param), epsilon2, max_scale);
  :func:`momentum` -- m = beta1 m + (1 - beta1) u (undebiased EMA), stored in any dtype;
  :func:`add_decayed_weights` -- u + rate(count) [* param scale] * param;
  :func:`skip_nan_updates` -- wrapper: keeps params and state entries that would become NaN.
  Helpers: :func:`grad_sq_norm`, :func:`param_block_rms`.
* :mod:`.second_moment`: :func:`~.second_moment.scale_by_factored_rms` -- the factored (or
  full) second moment: g -> g / sqrt(v_hat), then (optionally) update clipping:
  u / max(1, rms(u) / threshold) per block.
* :mod:`.param_dtype`: the last link, :func:`~.param_dtype.cast_to_param_dtype` (updates in
  the param dtype, chosen so that ``optax.apply_updates`` lands on the float32 result rounded
  once) or, for tensor2tensor, :func:`~.param_dtype.round_to_bfloat16_unbiased` (bf16 params
  land on a stochastically rounded value of their float32 result).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from optserve.optim_kernels.adafactor import factoring as fct
from optserve.optim_kernels.adafactor import schedules
from optserve.optim_kernels.adafactor.tree_helpers import f32, factor_spec, flat, mean_square

PathPredicate = Callable[[str], bool]


# --------------------------------------------------------------------------- validation


def check_inputs(name: str) -> optax.GradientTransformation:
    """Rejects updates whose tree or shapes differ from the params, naming the path.

    Also requires ``params`` (every Adafactor variant needs them) and float leaves.
    Stateless; all checks happen at trace time, so they cost nothing inside jit.
    """

    def init(params):
        paths, leaves, _ = flat(params)
        for path, leaf in zip(paths, leaves):
            if not jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.floating):
                raise ValueError(
                    f"{name}: parameter {path!r} of shape {jnp.shape(leaf)} has dtype "
                    f"{jnp.asarray(leaf).dtype}; only floating parameters can be optimized"
                )
        return optax.EmptyState()

    def update(updates, state, params=None):
        if params is None:
            raise ValueError(f"{name}: update(grads, state, params) needs params")
        p_paths, p_leaves, p_def = flat(params)
        u_paths, u_leaves, u_def = flat(updates)
        if u_def != p_def:
            missing = sorted(set(p_paths) - set(u_paths))
            extra = sorted(set(u_paths) - set(p_paths))
            raise ValueError(
                f"{name}: gradient tree does not match the params: missing paths {missing[:5]}, "
                f"unexpected paths {extra[:5]} (gradient structure {u_def}, params {p_def})"
            )
        for path, g, p in zip(p_paths, u_leaves, p_leaves):
            if jnp.shape(g) != jnp.shape(p):
                raise ValueError(
                    f"{name}: gradient for parameter {path!r} has shape {jnp.shape(g)}, "
                    f"the parameter has shape {jnp.shape(p)}"
                )
            if not jnp.issubdtype(jnp.asarray(g).dtype, jnp.floating):
                raise ValueError(
                    f"{name}: gradient for parameter {path!r} of shape {jnp.shape(g)} has "
                    f"non-float dtype {jnp.asarray(g).dtype}"
                )
        return updates, state

    return optax.GradientTransformation(init, update)


# --------------------------------------------------------------------------- global norm


def grad_sq_norm(tree) -> jnp.ndarray:
    """Sum of squared entries over every leaf (float32 scalar): the cross-shard partial."""
    total = jnp.float32(0.0)
    for leaf in jax.tree.leaves(tree):
        g = f32(leaf)
        total = total + jnp.sum(g * g)
    return total


def clip_by_global_norm(threshold: float) -> optax.GradientTransformationExtraArgs:
    """T5X global-norm clip: ``g * min(1, threshold / ||g||)`` over the whole model.

    ``update(..., global_grad_sq_norm=s)`` uses ``s`` (the sum over all shards of
    :func:`grad_sq_norm` of each shard's gradients) instead of this tree's own squared norm,
    so a model split across shards is clipped exactly as in one process. Output is float32.
    """
    threshold = float(threshold)

    def update(updates, state, params=None, *, global_grad_sq_norm=None, **extra):
        del params, extra
        sq = grad_sq_norm(updates) if global_grad_sq_norm is None else f32(global_grad_sq_norm)
        norm = jnp.sqrt(sq)
        scale = threshold * jnp.minimum(1.0 / threshold, 1.0 / norm)
        return jax.tree.map(lambda g: f32(g) * scale, updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


# --------------------------------------------------------------------------- parameter scale


def param_block_rms(
    param, axes, epsilon2: float = 1e-3, max_scale: Optional[float] = None
) -> jnp.ndarray:
    """``clip(sqrt(mean(param**2 over axes)), epsilon2, max_scale)`` in float32, keepdims."""
    p = f32(param)
    axes = tuple(range(p.ndim)) if axes is None else axes
    scale = jnp.maximum(jnp.sqrt(mean_square(p, axes)), epsilon2)
    if max_scale is not None:
        scale = jnp.minimum(scale, max_scale)
    return scale


def scale_by_param_block_rms(
    epsilon2: float = 1e-3,
    max_scale: Optional[float] = None,
    factoring: Optional[fct.Factoring] = None,
    enabled: Union[bool, PathPredicate] = True,
) -> optax.GradientTransformation:
    """Multiplies each update by :func:`param_block_rms` of its parameter (relative steps).

    ``enabled(path)`` turns it off per parameter (T5X's per-path
    ``multiply_by_parameter_scale``). Needs params.
    """
    is_on = enabled if callable(enabled) else (lambda path: bool(enabled))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("scale_by_param_block_rms: update needs params")
        paths, leaves, treedef = flat(updates)
        out = []
        for path, u, p in zip(paths, leaves, treedef.flatten_up_to(params)):
            u = f32(u)
            if is_on(path):
                axes = factor_spec(factoring, path, jnp.shape(p)).averaging_axes
                u = u * param_block_rms(p, axes, epsilon2, max_scale)
            out.append(u)
        return treedef.unflatten(out), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


# --------------------------------------------------------------------------- momentum / decay


class MomentumState(NamedTuple):
    """State of :func:`momentum`: ``m``, one buffer per param in the chosen dtype."""

    m: Any


def momentum(beta1: float, dtype: Any = jnp.float32) -> optax.GradientTransformation:
    """``m = beta1 m + (1 - beta1) u``; outputs the float32 ``m`` and stores it in ``dtype``.

    ``dtype=None`` stores each buffer in its parameter's dtype (tensor2tensor).
    """
    beta1 = float(beta1)

    def init(params):
        return MomentumState(
            m=jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), dtype or jnp.asarray(p).dtype), params)
        )

    def update(updates, state, params=None):
        del params
        new_m = jax.tree.map(lambda u, m: beta1 * f32(m) + (1.0 - beta1) * f32(u), updates, state.m)
        stored = jax.tree.map(lambda n, m: n.astype(m.dtype), new_m, state.m)
        return new_m, MomentumState(m=stored)

    return optax.GradientTransformation(init, update)


class ScheduleCountState(NamedTuple):
    """Step counter of links whose coefficient follows a schedule."""

    count: jnp.ndarray


def add_decayed_weights(
    rate: schedules.ScalarOrSchedule, param_rms_epsilon: Optional[float] = None
) -> optax.GradientTransformation:
    """``u + rate(count) * param``; with ``param_rms_epsilon`` the rate is also multiplied by
    ``max(rms(param), param_rms_epsilon)`` (HuggingFace decays by the effective lr, which
    includes the parameter scale). Needs params."""
    rate_fn = schedules.as_schedule(rate)

    def init(params):
        return ScheduleCountState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("add_decayed_weights: update needs params")
        r = f32(rate_fn(state.count))

        def one(u, p):
            coef = r
            if param_rms_epsilon is not None:
                coef = coef * param_block_rms(p, None, param_rms_epsilon)
            return f32(u) + coef * f32(p)

        return jax.tree.map(one, updates, params), ScheduleCountState(state.count + 1)

    return optax.GradientTransformation(init, update)


# --------------------------------------------------------------------------- wrappers


def skip_nan_updates(
    inner: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
    """Runs ``inner``; a param whose new value (params + update, float32) is NaN keeps its old
    value (its update becomes 0), and every float state entry that became NaN keeps its old
    value (T5X ``skip_nan_updates``)."""
    inner = optax.with_extra_args_support(inner)

    def update(updates, state, params=None, **extra):
        if params is None:
            raise ValueError("skip_nan_updates: update needs params")
        new_updates, new_state = inner.update(updates, state, params, **extra)
        safe_updates = jax.tree.map(
            lambda u, p: jnp.where(jnp.isnan(f32(p) + u), jnp.zeros_like(u), u),
            new_updates,
            params,
        )

        def keep(new, old):
            if jnp.issubdtype(jnp.asarray(new).dtype, jnp.inexact):
                return jnp.where(jnp.isnan(new), old, new)
            return new

        return safe_updates, jax.tree.map(keep, new_state, state)

    return optax.GradientTransformationExtraArgs(inner.init, update)
