"""ScaledAdam's core link: Adam steps scaled by each tensor's RMS, plus a learned tensor scale.

For a tensor ``p`` with more than one element, the step is Adam's normalised gradient times
``lr * max(rms(p), param_min_rms)``, so a tensor moves by a fixed fraction of its own size
whatever its scale. Every ``size_update_period`` steps ``rms(p)`` is re-measured and the
tensor's overall size is moved as if ``p = u * exp(s)`` with ``s`` learned by its own Adam
(gradient ``sum(p * grad)``), within ``[param_min_rms, param_max_rms]``. Tensors with one
element ("scalars") get plain Adam with ``lr * scalar_lr_scale``. All contributions go into
one momentum buffer ``delta`` (decayed by ``beta1`` each step; each term enters with weight
``1 - beta1``), and ``delta`` is the update. Semantics follow icefall's ``ScaledAdam``;
clipping lives in :mod:`.clipping` and the clamp of scalars in :mod:`.kernel`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Union

import jax
import jax.numpy as jnp
import optax

from optserve.optim_kernels.scaled_adam import batching

ScalarOrSchedule = Union[float, Callable[[jax.Array], jax.Array]]


class ScaleByScaledAdamState(NamedTuple):
    """State of :func:`scale_by_scaled_adam`; every field but ``count`` mirrors the params tree.

    Attributes:
      count: int32 scalar, steps taken so far.
      delta: f32, like each param: the momentum buffer, also the last update.
      exp_avg_sq: f32, like each param: moving average of squared gradients.
      param_rms: f32 ``()`` per tensor: RMS of the tensor when last measured (every
        ``size_update_period`` steps); ``1`` for scalars, which have no measured RMS.
      scale_exp_avg_sq: f32 ``()`` per tensor: moving average of the squared scale gradient
        (unused for scalars).
      scale_grads: f32 ``(size_update_period,)`` per tensor: the scale gradients
        ``sum(p * grad)`` of the current period (unused for scalars).
    """

    count: jax.Array
    delta: Any
    exp_avg_sq: Any
    param_rms: Any
    scale_exp_avg_sq: Any
    scale_grads: Any


def is_scalar(shape: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` takes the scalar path (at most one element)."""
    size = 1
    for dim in shape:
        size *= dim
    return size <= 1


def tensor_rms(x: jax.Array, batched: bool = False) -> jax.Array:
    """Root mean square in f32, over all axes, or all but the leading one if ``batched``."""
    x = x.astype(jnp.float32)
    axes = tuple(range(1, x.ndim)) if batched else None
    return jnp.sqrt(jnp.mean(jnp.square(x), axis=axes))


def measures_rms_at(count: jax.Array, size_update_period: int) -> jax.Array:
    """True on the steps (0-based) where a tensor's RMS is re-measured: the period's last."""
    return count % size_update_period == size_update_period - 1


def initial_param_rms(param: jax.Array) -> jax.Array:
    """The RMS recorded at init: the tensor's RMS, or ``1`` for a scalar."""
    if is_scalar(param.shape):
        return jnp.ones((), jnp.float32)
    return tensor_rms(param)


def check_tree_matches(updates: Any, params: Any, optimizer: str) -> None:
    """Raises ValueError naming the path and shapes if ``updates`` and ``params`` differ."""
    if params is None:
        raise ValueError(f"{optimizer}: update needs params (the step is scaled by their RMS)")
    p_paths, p_def = jax.tree_util.tree_flatten_with_path(params)
    u_leaves, u_def = jax.tree_util.tree_flatten(updates)
    if p_def != u_def:
        raise ValueError(f"{optimizer}: gradient tree {u_def} does not match params tree {p_def}")
    for (path, p), g in zip(p_paths, u_leaves):
        if tuple(g.shape) != tuple(p.shape):
            raise ValueError(
                f"{optimizer}: gradient for {jax.tree_util.keystr(path)} has shape "
                f"{tuple(g.shape)}, the parameter has shape {tuple(p.shape)}"
            )
        if not jnp.issubdtype(p.dtype, jnp.floating):
            raise ValueError(
                f"{optimizer}: parameter {jax.tree_util.keystr(path)} of shape "
                f"{tuple(p.shape)} has dtype {p.dtype}; only floating point is supported"
            )


def scale_by_scaled_adam(
    learning_rate: ScalarOrSchedule,
    b1: float,
    b2: float,
    scalar_lr_scale: float,
    eps: float,
    param_min_rms: float,
    param_max_rms: float,
    size_update_period: int,
) -> optax.GradientTransformation:
    """ScaledAdam's update without clipping and without the clamp of scalars.

    Args:
      learning_rate: ``lr`` as a float or a schedule ``count -> lr``; the momentum buffer
        accumulates each step's learning rate as icefall does with its schedulers.
      b1: momentum decay of ``delta``.
      b2: decay of the squared-gradient averages (``b2 ** size_update_period`` for the scale).
      scalar_lr_scale: factor on ``lr`` for scalars and for the learned tensor scale.
      eps: added to square roots of second moments.
      param_min_rms: below this RMS a tensor's scale stops shrinking; also the floor of the
        RMS that multiplies the step.
      param_max_rms: above this RMS a tensor's scale shrinks at the fixed rate
        ``lr * scalar_lr_scale * size_update_period`` per scale update.
      size_update_period: steps between RMS measurements and scale updates.

    Returns:
      A transformation whose ``update(grads, state, params)`` returns the new ``delta`` in
      each param's dtype (``new_params = params + updates``); ``params`` are required.
    """
    hyper = _Hyper(b1, b2, scalar_lr_scale, eps, param_min_rms, param_max_rms, size_update_period)

    def init_fn(params):
        return _initial_state(params, size_update_period)

    def update_fn(updates, state, params=None):
        check_tree_matches(updates, params, "scaled_adam")
        count = state.count
        lr = learning_rate(count) if callable(learning_rate) else learning_rate
        lr = jnp.asarray(lr, jnp.float32)
        step_f = count.astype(jnp.float32)
        bias_correction2 = 1.0 - jnp.power(jnp.float32(b2), step_f + 1.0)
        step = functools.partial(_group_step, hyper, _Step(count, lr, bias_correction2))
        delta, exp_avg_sq, rms, scale_sq, scale_grads = _map_shape_groups(step, updates, state, params)
        new_updates = jax.tree_util.tree_map(lambda d, p: d.astype(p.dtype), delta, params)
        new_state = ScaleByScaledAdamState(
            count=optax.safe_int32_increment(count),
            delta=delta,
            exp_avg_sq=exp_avg_sq,
            param_rms=rms,
            scale_exp_avg_sq=scale_sq,
            scale_grads=scale_grads,
        )
        return new_updates, new_state

    return optax.GradientTransformation(init_fn, update_fn)


class _Hyper(NamedTuple):
    """The constants of :func:`scale_by_scaled_adam` (``period``: ``size_update_period``)."""

    b1: float
    b2: float
    scalar_lr_scale: float
    eps: float
    param_min_rms: float
    param_max_rms: float
    period: int


class _Step(NamedTuple):
    """What one step's kernels share: ``count`` (int32 scalar, 0-based), ``lr`` (f32 scalar) and
    Adam's ``bias_correction2 = 1 - b2 ** (count + 1)`` (f32 scalar)."""

    count: jax.Array
    lr: jax.Array
    bias_correction2: jax.Array


def _group_step(hyper: _Hyper, step: _Step, p, *rest):
    """One group of same-shape tensors stacked on a leading axis, ``p`` of shape
    ``(B, *tensor_shape)``: the tensor or the scalar step, decided statically by the shape."""
    if is_scalar(p.shape[1:]):
        return _scalar_step(hyper, step, p, *rest)
    return _tensor_step(hyper, step, p, *rest)


def _tensor_step(hyper: _Hyper, step: _Step, p, g, delta, exp_avg_sq, rms, scale_sq, scale_grads):
    """A group of B tensors: ``p``, ``g`` (f32), ``delta``, ``exp_avg_sq`` of shape
    ``(B, *tensor_shape)``; ``rms``, ``scale_sq`` ``(B,)``; ``scale_grads`` ``(B, period)``.
    Returns the new ``(delta, exp_avg_sq, rms, scale_sq, scale_grads)``."""
    b1, b2, scalar_lr_scale, eps, param_min_rms, param_max_rms, P = hyper
    count, lr, bias_correction2 = step
    p = p.astype(jnp.float32)
    bshape = (-1,) + (1,) * (p.ndim - 1)
    delta = b1 * delta
    scale_grads = scale_grads.at[:, count % P].set(
        jnp.sum(p * g, axis=tuple(range(1, p.ndim)))
    )
    measure = measures_rms_at(count, P)
    rms = jnp.where(measure, tensor_rms(p, batched=True), rms)

    # Learned scale, on the last step of each period after the very first step.
    beta2_period = b2**P
    new_scale_sq = beta2_period * scale_sq + (1.0 - beta2_period) * jnp.mean(
        jnp.square(scale_grads), axis=1
    )
    scale_updates_done = ((count + 1) // P).astype(jnp.float32)
    scale_correction = 1.0 - jnp.power(jnp.float32(beta2_period), scale_updates_done)
    size_lr = lr * scalar_lr_scale
    scale_step = (
        -size_lr
        * jnp.sqrt(scale_correction)
        * jnp.sum(scale_grads, axis=1)
        / (jnp.sqrt(new_scale_sq) + eps)
    )
    scale_step = jnp.where(rms < param_min_rms, 0.0, scale_step)
    scale_step = jnp.where(rms > param_max_rms, -size_lr * P, scale_step)
    resize = measure & (count > 0)
    delta = delta + jnp.where(resize, (1.0 - b1) * scale_step, 0.0).reshape(bshape) * p
    scale_sq = jnp.where(resize, new_scale_sq, scale_sq)

    # Adam on the tensor, scaled by its RMS; no bias correction once it exceeds 0.99.
    exp_avg_sq = b2 * exp_avg_sq + (1.0 - b2) * jnp.square(g)
    correction = jnp.where(bias_correction2 < 0.99, bias_correction2, 1.0)
    denom = jnp.sqrt(exp_avg_sq / correction) + eps
    step_size = -lr * (1.0 - b1) * jnp.maximum(rms, param_min_rms)
    delta = delta + step_size.reshape(bshape) * (g / denom)
    return delta, exp_avg_sq, rms, scale_sq, scale_grads


def _scalar_step(hyper: _Hyper, step: _Step, p, g, delta, exp_avg_sq, rms, scale_sq, scale_grads):
    """A group of B one-element tensors: plain Adam with ``lr * scalar_lr_scale``; ``rms``,
    ``scale_sq`` and ``scale_grads`` pass through unchanged."""
    del p
    b1, b2, eps = hyper.b1, hyper.b2, hyper.eps
    delta = b1 * delta
    exp_avg_sq = b2 * exp_avg_sq + (1.0 - b2) * jnp.square(g)
    denom = jnp.sqrt(exp_avg_sq / step.bias_correction2) + eps
    delta = delta - step.lr * hyper.scalar_lr_scale * (1.0 - b1) * (g / denom)
    return delta, exp_avg_sq, rms, scale_sq, scale_grads


def _initial_state(params, period: int) -> ScaleByScaledAdamState:
    """Count 0, zero moments and scale statistics, each tensor's RMS as measured now."""
    f32_zeros = lambda p: jnp.zeros(p.shape, jnp.float32)  # noqa: E731
    return ScaleByScaledAdamState(
        count=jnp.zeros((), jnp.int32),
        delta=jax.tree_util.tree_map(f32_zeros, params),
        exp_avg_sq=jax.tree_util.tree_map(f32_zeros, params),
        param_rms=jax.tree_util.tree_map(initial_param_rms, params),
        scale_exp_avg_sq=jax.tree_util.tree_map(lambda p: jnp.zeros((), jnp.float32), params),
        scale_grads=jax.tree_util.tree_map(lambda p: jnp.zeros((period,), jnp.float32), params),
    )


def _map_shape_groups(step, updates, state: ScaleByScaledAdamState, params) -> tuple:
    """Runs ``step(p, g, delta, exp_avg_sq, rms, scale_sq, scale_grads)`` once per group of
    same-shape params (stacked, :mod:`.batching`) with the gradients in f32; returns the new
    ``(delta, exp_avg_sq, param_rms, scale_exp_avg_sq, scale_grads)`` trees."""
    treedef = jax.tree_util.tree_structure(params)
    p_leaves = treedef.flatten_up_to(params)
    g_leaves = [g.astype(jnp.float32) for g in treedef.flatten_up_to(updates)]
    state_leaves = [
        treedef.flatten_up_to(tree)
        for tree in (
            state.delta,
            state.exp_avg_sq,
            state.param_rms,
            state.scale_exp_avg_sq,
            state.scale_grads,
        )
    ]
    groups = batching.shape_groups(p_leaves)
    outs = batching.map_batched(step, 5, groups, p_leaves, g_leaves, *state_leaves)
    return tuple(treedef.unflatten(leaves) for leaves in outs)
