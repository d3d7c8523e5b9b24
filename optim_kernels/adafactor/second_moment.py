"""Adafactor's second-moment link: the factored (or full) RMS scaling of the gradient, with its
update clipping (:func:`scale_by_factored_rms`).

A param of shape ``shape`` whose :class:`.factoring.FactorSpec` is factored keeps ``v_row``
(``shape`` without its column axes) and ``v_col`` (``shape`` without its row axes), m + n floats
for an m x n matrix; an unfactored one keeps ``v`` of its own shape. All float32.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax.numpy as jnp
import optax
from jax import lax

from optserve.optim_kernels.adafactor import factoring as fct
from optserve.optim_kernels.adafactor import schedules
from optserve.optim_kernels.adafactor.tree_helpers import f32, factor_spec, flat, leaves_up_to, mean_square


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
        return _zero_state(factoring, params)

    def update(updates, state, params=None):
        del params
        paths, leaves, treedef = flat(updates)
        rows = leaves_up_to(treedef, state.v_row, "Adafactor state v_row")
        cols = leaves_up_to(treedef, state.v_col, "Adafactor state v_col")
        fulls = leaves_up_to(treedef, state.v, "Adafactor state v")
        decay = f32(decay_fn(state.count))
        mix = 1.0 - decay
        out, new_rows, new_cols, new_fulls = [], [], [], []
        for path, g_in, vr, vc, v in zip(paths, leaves, rows, cols, fulls):
            shape = jnp.shape(g_in)
            spec = factor_spec(factoring, path, shape)
            if spec.factored:
                _check_state(path, shape, "v_row", vr, spec.v_row_shape(shape))
                _check_state(path, shape, "v_col", vc, spec.v_col_shape(shape))
                u, new_vr, new_vc = _factored_step(g_in, vr, vc, spec, decay, mix, epsilon1, threshold)
                new_v = None
            else:
                _check_state(path, shape, "v", v, tuple(shape))
                u, new_v = _full_step(g_in, v, spec, decay, mix, epsilon1, threshold)
                new_vr = new_vc = None
            out.append(u)
            new_rows.append(new_vr)
            new_cols.append(new_vc)
            new_fulls.append(new_v)
        new_state = FactoredRmsState(
            count=state.count + 1,
            v_row=treedef.unflatten(new_rows),
            v_col=treedef.unflatten(new_cols),
            v=treedef.unflatten(new_fulls),
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformation(init, update)


def _factored_step(g_in, vr, vc, spec: fct.FactorSpec, decay, mix, epsilon1: float, threshold: Optional[float]):
    """One factored param: ``(u, new v_row, new v_col)``, all float32 (``mix = 1 - decay``)."""
    g = f32(g_in)
    # mean(g^2 + eps) written as mean(g^2) + eps: XLA:CPU would otherwise
    # materialize a full-size broadcast of eps.
    new_vr = decay * vr + mix * (jnp.mean(g * g, axis=spec.col_axes) + epsilon1)
    new_vr, g_in = lax.optimization_barrier((new_vr, g_in))
    g = f32(g_in)
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
        mean_sq = _factored_update_mean_square(g, row_factor, col_factor, spec)
        u = u / jnp.maximum(1.0, jnp.sqrt(mean_sq) / threshold)
    return u, new_vr, new_vc


def _full_step(g_in, v, spec: fct.FactorSpec, decay, mix, epsilon1: float, threshold: Optional[float]):
    """One unfactored param: ``(u, new v)``, float32 of the param's shape (``mix = 1 - decay``)."""
    g = f32(g_in)
    new_v = decay * v + mix * (g * g + epsilon1)
    u = g * lax.rsqrt(new_v)
    if threshold is not None:
        u = u / jnp.maximum(1.0, jnp.sqrt(mean_square(u, spec.averaging_axes)) / threshold)
    return u, new_v


def _zero_state(factoring: Optional[fct.Factoring], params) -> FactoredRmsState:
    """The initial :class:`FactoredRmsState` of ``params``: count 0, every buffer zero."""
    paths, leaves, treedef = flat(params)
    rows, cols, fulls = [], [], []
    for path, p in zip(paths, leaves):
        shape = jnp.shape(p)
        spec = factor_spec(factoring, path, shape)
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
    """ValueError naming the param when its state ``field`` is missing or not ``expected``'s shape."""
    if value is None or tuple(jnp.shape(value)) != tuple(expected):
        got = None if value is None else tuple(jnp.shape(value))
        raise ValueError(
            f"parameter {path!r} of shape {tuple(shape)}: Adafactor state {field} has shape "
            f"{got}, expected {tuple(expected)} (state built for other params or options?)"
        )
