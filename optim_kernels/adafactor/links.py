"""Adafactor's single-purpose links, each an optax transformation, chained by the variants.

Every link maps a pytree of updates (same structure and shapes as the params) to a new one.
Links that need per-parameter axes take a ``factoring(path, shape) -> FactorSpec`` callable
(see :mod:`optserve.optim_kernels.adafactor.factoring`); ``None`` means "one block per tensor, every
axis averaged". Math is float32 whatever the param/grad dtype; the updates leave every link in
float32, so ``optax.apply_updates`` adds them to bf16/f16 params in float32 and rounds once.

Public links (names are stable; other kernels import them):

* :func:`check_inputs` -- ValueError on trees/shapes that do not match the params.
* :func:`clip_by_global_norm` -- T5X global-norm clip; accepts ``global_grad_sq_norm``.
* :func:`scale_by_factored_rms` -- the factored (or full) second moment: g -> g / sqrt(v_hat),
  then (optionally) update clipping: u / max(1, rms(u) / threshold) per block.
* :func:`scale_by_param_block_rms` -- multiply by clip(rms(param), epsilon2, max_scale).
* :func:`momentum` -- m = beta1 m + (1 - beta1) u (undebiased EMA), stored in any dtype.
* :func:`add_decayed_weights` -- u + rate(count) [* param scale] * param.
* :func:`skip_nan_updates` -- wrapper: keeps params and state entries that would become NaN.
* :func:`cast_to_param_dtype` -- last link: updates in the param dtype, chosen so that
  ``optax.apply_updates`` lands on the float32 result rounded once.
* :func:`round_to_bfloat16_unbiased` -- last link for tensor2tensor: bf16 params land on a
  stochastically rounded value of their float32 result.
Helpers: :func:`grad_sq_norm`, :func:`param_block_rms`.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax
from jax import lax

from optserve.optim_kernels.adafactor import factoring as fct
from optserve.optim_kernels.adafactor import schedules
from optserve.optim_kernels.adafactor import stochastic_rounding as sr

PathPredicate = Callable[[str], bool]


# --------------------------------------------------------------------------- tree helpers


def _flat(tree):
    """(paths, leaves, treedef) of a pytree."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [fct.path_string(p) for p, _ in with_path], [x for _, x in with_path], treedef


def _up_to(treedef, tree, what: str) -> list:
    """Leaves of ``tree`` at ``treedef``'s leaf positions (``None`` entries allowed)."""
    try:
        return treedef.flatten_up_to(tree)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{what} does not have the structure of the params: {exc}") from None


def _spec(factoring: Optional[fct.Factoring], path: str, shape) -> fct.FactorSpec:
    return fct.unfactored(shape) if factoring is None else factoring(path, tuple(shape))


def _f32(x):
    return jnp.asarray(x).astype(jnp.float32)


def _mean_square(x, axes):
    """``mean(x * x)`` over ``axes``, keepdims (float32)."""
    return jnp.mean(x * x, axis=tuple(axes), keepdims=True)


# --------------------------------------------------------------------------- validation


def check_inputs(name: str) -> optax.GradientTransformation:
    """Rejects updates whose tree or shapes differ from the params, naming the path.

    Also requires ``params`` (every Adafactor variant needs them) and float leaves.
    Stateless; all checks happen at trace time, so they cost nothing inside jit.
    """

    def init(params):
        paths, leaves, _ = _flat(params)
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
        p_paths, p_leaves, p_def = _flat(params)
        u_paths, u_leaves, u_def = _flat(updates)
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
        g = _f32(leaf)
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
        sq = grad_sq_norm(updates) if global_grad_sq_norm is None else _f32(global_grad_sq_norm)
        norm = jnp.sqrt(sq)
        scale = threshold * jnp.minimum(1.0 / threshold, 1.0 / norm)
        return jax.tree.map(lambda g: _f32(g) * scale, updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


# --------------------------------------------------------------------------- second moment


class FactoredRmsState(NamedTuple):
    """State of :func:`scale_by_factored_rms`.

    Attributes:
      count: int32 scalar, updates applied so far (drives the decay schedule).
      v_row: per param, float32 of the param shape without its column axes; ``None`` when
        the param is not factored.
      v_col: per param, float32 of the param shape without its row axes; or ``None``.
      v: per param, float32 of the param shape when not factored; ``None`` when factored.
    A factored m x n matrix thus holds m + n floats.
    """

    count: jnp.ndarray
    v_row: Any
    v_col: Any
    v: Any


def scale_by_factored_rms(
    factoring: Optional[fct.Factoring] = None,
    decay_rate: schedules.ScalarOrSchedule = schedules.decay_rate_pow(0.8),
    epsilon1: float = 1e-30,
    clipping_threshold: Optional[float] = None,
) -> optax.GradientTransformation:
    """Divides the gradient by the root of Adafactor's second-moment estimate, then clips it.

    With ``d = decay_rate(count)`` and ``g2 = g*g + epsilon1``:
    factored: ``v_row = d v_row + (1-d) mean(g2 over col axes)``, likewise ``v_col`` over the
    row axes, and ``u = g * rsqrt(v_row / mean(v_row over row axes)) * rsqrt(v_col)``
    (broadcast back over the removed axes; axes in neither set are handled slice by slice).
    Unfactored: ``v = d v + (1-d) g2``, ``u = g * rsqrt(v)``.

    Update clipping (``clipping_threshold`` not None): ``u / max(1, rms(u) / threshold)``, the
    RMS over each block's averaging axes (the whole tensor, or each BATCH slice). It lives in this
    link because a factored block's ``rms(u)`` follows from ``g`` and the two factors
    (:func:`_factored_update_mean_square`) without a full-size ``u``: XLA:CPU writes out ``u``
    when a reduction and the final update both read it, a 4096 x 4096 matrix costing more than
    the whole rest of the step.

    The row and column means are kept in separate passes (``lax.optimization_barrier``):
    XLA:CPU otherwise fuses both reductions into one slow loop.
    """
    decay_fn = schedules.as_schedule(decay_rate)
    threshold = None if clipping_threshold is None else float(clipping_threshold)

    def init(params):
        paths, leaves, treedef = _flat(params)
        rows, cols, fulls = [], [], []
        for path, p in zip(paths, leaves):
            shape = jnp.shape(p)
            spec = _spec(factoring, path, shape)
            if spec.factored:
                rows.append(jnp.zeros(spec.v_row_shape(shape), jnp.float32))
                cols.append(jnp.zeros(spec.v_col_shape(shape), jnp.float32))
                fulls.append(None)
            else:
                rows.append(None)
                cols.append(None)
                fulls.append(jnp.zeros(shape, jnp.float32))
        return FactoredRmsState(
            count=jnp.zeros([], jnp.int32),
            v_row=treedef.unflatten(rows),
            v_col=treedef.unflatten(cols),
            v=treedef.unflatten(fulls),
        )

    def update(updates, state, params=None):
        del params
        paths, leaves, treedef = _flat(updates)
        rows = _up_to(treedef, state.v_row, "Adafactor state v_row")
        cols = _up_to(treedef, state.v_col, "Adafactor state v_col")
        fulls = _up_to(treedef, state.v, "Adafactor state v")
        decay = _f32(decay_fn(state.count))
        mix = 1.0 - decay
        out, new_rows, new_cols, new_fulls = [], [], [], []
        for path, g_in, vr, vc, v in zip(paths, leaves, rows, cols, fulls):
            shape = jnp.shape(g_in)
            spec = _spec(factoring, path, shape)
            if spec.factored:
                _check_state(path, shape, "v_row", vr, spec.v_row_shape(shape))
                _check_state(path, shape, "v_col", vc, spec.v_col_shape(shape))
                g = _f32(g_in)
                # mean(g^2 + eps) written as mean(g^2) + eps: XLA:CPU would otherwise
                # materialize a full-size broadcast of eps.
                new_vr = decay * vr + mix * (jnp.mean(g * g, axis=spec.col_axes) + epsilon1)
                new_vr, g_in = lax.optimization_barrier((new_vr, g_in))
                g = _f32(g_in)
                new_vc = decay * vc + mix * (jnp.mean(g * g, axis=spec.row_axes) + epsilon1)
                row_mean = jnp.mean(new_vr, axis=spec.row_axes_in_v_row(), keepdims=True)
                row_factor = lax.rsqrt(new_vr / row_mean)
                col_factor = lax.rsqrt(new_vc)
                u = (
                    g
                    * jnp.expand_dims(row_factor, spec.col_axes)
                    * jnp.expand_dims(col_factor, spec.row_axes)
                )
                if threshold is not None:
                    mean_square = _factored_update_mean_square(g, row_factor, col_factor, spec)
                    u = u / jnp.maximum(1.0, jnp.sqrt(mean_square) / threshold)
                new_rows.append(new_vr)
                new_cols.append(new_vc)
                new_fulls.append(None)
            else:
                _check_state(path, shape, "v", v, tuple(shape))
                g = _f32(g_in)
                new_v = decay * v + mix * (g * g + epsilon1)
                u = g * lax.rsqrt(new_v)
                if threshold is not None:
                    u = u / jnp.maximum(1.0, jnp.sqrt(_mean_square(u, spec.averaging_axes)) / threshold)
                new_rows.append(None)
                new_cols.append(None)
                new_fulls.append(new_v)
            out.append(u)
        new_state = FactoredRmsState(
            count=state.count + 1,
            v_row=treedef.unflatten(new_rows),
            v_col=treedef.unflatten(new_cols),
            v=treedef.unflatten(new_fulls),
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformation(init, update)


def _factored_update_mean_square(g, row_factor, col_factor, spec: fct.FactorSpec):
    """``mean(u * u)`` over ``spec.averaging_axes`` (keepdims) for the factored update
    ``u = g * row_factor * col_factor`` (broadcast as in :func:`scale_by_factored_rms`), read
    from ``g`` and the factors: per row, the sum over the column axes of ``(g col_factor)^2``,
    then weighted by ``row_factor^2``. One read of ``g``; no full-size temporary. The inputs
    pass an optimization barrier so that XLA shares no subexpression (``g * g``, the broadcast
    column factor) between this reduction and the others: a full-size value read by two
    consumers is written out.
    """
    g, row_factor, col_factor = lax.optimization_barrier((g, row_factor, col_factor))
    per_row = jnp.sum(jnp.square(g * jnp.expand_dims(col_factor, spec.row_axes)), axis=spec.col_axes)
    # per_row has v_row's axes (g's without the column axes); the rest of the averaging axes:
    rest = tuple(a - sum(c < a for c in spec.col_axes) for a in spec.averaging_axes if a not in spec.col_axes)
    total = jnp.sum(per_row * jnp.square(row_factor), axis=rest, keepdims=True)
    count = 1
    for a in spec.averaging_axes:
        count *= jnp.shape(g)[a]
    return jnp.expand_dims(total / count, spec.col_axes)


def _check_state(path, shape, field, value, expected):
    if value is None or tuple(jnp.shape(value)) != tuple(expected):
        got = None if value is None else tuple(jnp.shape(value))
        raise ValueError(
            f"parameter {path!r} of shape {tuple(shape)}: Adafactor state {field} has shape "
            f"{got}, expected {tuple(expected)} (state built for other params or options?)"
        )


# --------------------------------------------------------------------------- clipping / scale


def param_block_rms(
    param, axes, epsilon2: float = 1e-3, max_scale: Optional[float] = None
) -> jnp.ndarray:
    """``clip(sqrt(mean(param**2 over axes)), epsilon2, max_scale)`` in float32, keepdims."""
    p = _f32(param)
    axes = tuple(range(p.ndim)) if axes is None else axes
    scale = jnp.maximum(jnp.sqrt(_mean_square(p, axes)), epsilon2)
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
        paths, leaves, treedef = _flat(updates)
        out = []
        for path, u, p in zip(paths, leaves, treedef.flatten_up_to(params)):
            u = _f32(u)
            if is_on(path):
                axes = _spec(factoring, path, jnp.shape(p)).averaging_axes
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
        new_m = jax.tree.map(lambda u, m: beta1 * _f32(m) + (1.0 - beta1) * _f32(u), updates, state.m)
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
        r = _f32(rate_fn(state.count))

        def one(u, p):
            coef = r
            if param_rms_epsilon is not None:
                coef = coef * param_block_rms(p, None, param_rms_epsilon)
            return _f32(u) + coef * _f32(p)

        return jax.tree.map(one, updates, params), ScheduleCountState(state.count + 1)

    return optax.GradientTransformation(init, update)


# --------------------------------------------------------------------------- wrappers / rounding


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
            lambda u, p: jnp.where(jnp.isnan(_f32(p) + u), jnp.zeros_like(u), u),
            new_updates,
            params,
        )

        def keep(new, old):
            if jnp.issubdtype(jnp.asarray(new).dtype, jnp.inexact):
                return jnp.where(jnp.isnan(new), old, new)
            return new

        return safe_updates, jax.tree.map(keep, new_state, state)

    return optax.GradientTransformationExtraArgs(inner.init, update)


def _delta_in_dtype(new_value, param):
    """``new_value - param`` in the param dtype. For ``new_value`` already in that dtype and
    within a factor 2 of ``param`` the difference is exact (Sterbenz), so ``param + delta``
    in that dtype gives back exactly ``new_value``."""
    return (_f32(new_value) - _f32(param)).astype(jnp.asarray(param).dtype)


def cast_to_param_dtype() -> optax.GradientTransformation:
    """Returns each update in its param's dtype. For params narrower than float32 the update
    is ``round(param + u) - param`` (round-to-nearest of the float32 result, then the
    difference), so the param is rounded once, not once for the update and again on add.
    Needs params."""

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("cast_to_param_dtype: update needs params")

        def one(u, p):
            dtype = jnp.asarray(p).dtype
            if jnp.dtype(dtype).itemsize >= 4:
                return jnp.asarray(u).astype(dtype)
            return _delta_in_dtype((_f32(p) + _f32(u)).astype(dtype), p)

        return jax.tree.map(one, updates, params), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def round_to_bfloat16_unbiased(seed: Optional[int] = None) -> optax.GradientTransformation:
    """For bfloat16 params, replaces the update so that ``param + update`` is the unbiased
    stochastic rounding of the exact float32 result (tensor2tensor); other params untouched.

    ``seed=None`` uses tensor2tensor's per-step golden-ratio noise (one value per step for
    every element); an int seed draws independent noise per element from
    ``fold_in(fold_in(key(seed), count), crc32(path))``: a tensor's noise follows its path, so it
    is the same whichever other tensors share the update (a shard holds a subset of them).
    bf16 updates are returned in bfloat16 (see :func:`cast_to_param_dtype` for why
    ``optax.apply_updates`` then lands on the rounded value).
    """

    def init(params):
        return ScheduleCountState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("round_to_bfloat16_unbiased: update needs params")
        paths, leaves, treedef = _flat(updates)
        p_leaves = treedef.flatten_up_to(params)
        out = []
        step_key = None if seed is None else jax.random.fold_in(jax.random.key(seed), state.count)
        for path, u, p in zip(paths, leaves, p_leaves):
            if jnp.asarray(p).dtype != jnp.bfloat16:
                out.append(u)
                continue
            if seed is None:
                noise = sr.golden_ratio_noise(state.count)
            else:
                key = jax.random.fold_in(step_key, zlib.crc32(path.encode()) & 0x7FFFFFFF)
                noise = sr.random_noise(key, jnp.shape(p))
            rounded = sr.to_bfloat16_unbiased(_f32(p) + _f32(u), noise)
            out.append(_delta_in_dtype(rounded, p))
        return treedef.unflatten(out), ScheduleCountState(state.count + 1)

    return optax.GradientTransformation(init, update)
