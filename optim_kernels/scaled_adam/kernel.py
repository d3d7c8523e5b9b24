"""ScaledAdam (icefall's Zipformer optimizer) as a chain of optax links.

``scaled_adam(...)`` = ``chain(clip_by_median_norm, scale_by_scaled_adam, clamp_scalar_params)``,
the first only when ``clipping_scale`` is set:

* :func:`~optserve.optim_kernels.scaled_adam.clipping.clip_by_median_norm`: clip RMS-weighted
  gradients to ``clipping_scale`` x the median recent norm;
* :func:`~optserve.optim_kernels.scaled_adam.update.scale_by_scaled_adam`: Adam scaled by each
  tensor's RMS, the learned tensor scale, Adam for scalars, one momentum buffer;
* :func:`clamp_scalar_params`: scalars are clamped to ``[-scalar_max, scalar_max]`` *before*
  the step is added, as icefall does (so a scalar may sit just outside after a step).

Option names and defaults are icefall's. For sharded models, :func:`scaled_adam_partial_statistic`
gives each shard's part of the clipping norm (see ``registry.py``). The options are validated in
one place, :class:`~optserve.optim_kernels.scaled_adam.config.ScaledAdamConfig`, whose fields the
flat keywords of :func:`scaled_adam` mirror (tests/test_kernel_package.py keeps them equal).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import optax

from optserve.optim_kernels.scaled_adam.clipping import (
    ClipByMedianNormState,
    clip_by_median_norm,
    weighted_grad_sq_norm,
)
from optserve.optim_kernels.scaled_adam.config import ScaledAdamConfig
from optserve.optim_kernels.scaled_adam.update import (
    ScalarOrSchedule,
    is_scalar,
    scale_by_scaled_adam,
)

__all__ = [
    "clamp_scalar_params",
    "scaled_adam",
    "scaled_adam_from_config",
    "scaled_adam_partial_statistic",
]


def clamp_scalar_params(scalar_max: float) -> optax.GradientTransformation:
    """Adds ``clip(p, -scalar_max, scalar_max) - p`` to the update of each one-element param.

    Stateless. Other tensors pass through unchanged. The result is in each param's dtype.
    """

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("scaled_adam: clamping scalars needs params")

        def clamp(u, p):
            if not is_scalar(p.shape):
                return u
            return (u + (jnp.clip(p, -scalar_max, scalar_max) - p)).astype(p.dtype)

        return jax.tree_util.tree_map(clamp, updates, params), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def scaled_adam(
    lr: ScalarOrSchedule = 0.03,
    clipping_scale: Optional[float] = None,
    betas: Sequence[float] = (0.9, 0.98),
    scalar_lr_scale: float = 0.1,
    eps: float = 1.0e-8,
    param_min_rms: float = 1.0e-5,
    param_max_rms: float = 3.0,
    scalar_max: float = 10.0,
    size_update_period: int = 4,
    clipping_update_period: int = 100,
    show_dominant_parameters: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """icefall's ScaledAdam.

    Args:
      lr: learning rate (float, or schedule ``count -> lr``); icefall starts near 0.03.
      clipping_scale: ``None`` for no clipping, else clip the RMS-weighted gradient norm to
        this multiple of the median norm of the last ``clipping_update_period`` steps.
      betas: ``(beta1, beta2)``: momentum decay and squared-gradient decay, each in [0, 1).
      scalar_lr_scale: learning-rate factor for scalars and for the learned tensor scales.
      eps: added to square roots of second moments (> 0).
      param_min_rms: a tensor's scale is not shrunk below this RMS; floor of the RMS that
        multiplies its step.
      param_max_rms: a tensor whose RMS exceeds this is shrunk.
      scalar_max: one-element params are clamped to ``[-scalar_max, scalar_max]``.
      size_update_period: steps between RMS measurements / scale updates (int >= 1).
      clipping_update_period: length of the norm history and steps between threshold
        updates; clipping starts at this step (int >= 1).
      show_dominant_parameters: on steps scaled by less than 0.1, log the tensor that
        dominates the gradient norm.

    Returns:
      An ``optax.GradientTransformationExtraArgs``. ``update(grads, state, params,
      global_grad_sq_norm=None)`` needs ``params``; state is f32 whatever the param dtype,
      updates come back in each param's dtype. All params must be floating point.

    Raises:
      ValueError: an option out of range; the message names it.
    """
    return scaled_adam_from_config(ScaledAdamConfig(**locals()))


def scaled_adam_from_config(config: ScaledAdamConfig) -> optax.GradientTransformationExtraArgs:
    """The transformation of :func:`scaled_adam` for an already validated config."""
    links = []
    if config.clipping_scale is not None:
        links.append(
            clip_by_median_norm(
                float(config.clipping_scale),
                int(config.clipping_update_period),
                int(config.size_update_period),
                config.show_dominant_parameters,
            )
        )
    links.append(
        scale_by_scaled_adam(
            learning_rate=config.lr if callable(config.lr) else float(config.lr),
            b1=config.beta1,
            b2=config.beta2,
            scalar_lr_scale=float(config.scalar_lr_scale),
            eps=float(config.eps),
            param_min_rms=float(config.param_min_rms),
            param_max_rms=float(config.param_max_rms),
            size_update_period=int(config.size_update_period),
        )
    )
    links.append(clamp_scalar_params(float(config.scalar_max)))
    return optax.chain(*links)


def scaled_adam_partial_statistic(**options) -> Optional[Callable[[Any, Any, Any], jax.Array]]:
    """This shard's part of the squared clipping norm, for the registry's cross-shard contract.

    Takes the same keyword options as :func:`scaled_adam`. Returns ``None`` when
    ``clipping_scale`` is ``None``; else ``partial(grads, state, params) -> f32 scalar``:
    ``sum(grad**2)`` for scalars plus ``sum((grad * param_rms)**2)`` for other tensors, with
    ``param_rms`` from ``state`` (a state of :func:`scaled_adam` built with the same options over
    the same tree). Summed over a partition of a model's tensors and passed as
    ``global_grad_sq_norm`` to every shard's update, it reproduces the unsharded update.

    Raises:
      ValueError: an unknown option or one out of range, naming it.
    """
    unknown = sorted(set(options) - {f.name for f in dataclasses.fields(ScaledAdamConfig)})
    if unknown:
        raise ValueError(f"scaled_adam has no option {unknown[0]!r}")
    config = ScaledAdamConfig(**options)
    if config.clipping_scale is None:
        return None

    def partial(grads, state, params=None):
        del params
        return weighted_grad_sq_norm(grads, _clip_state(state).param_rms)

    return partial


def _clip_state(state: Any) -> ClipByMedianNormState:
    for part in state:
        if isinstance(part, ClipByMedianNormState):
            return part
    raise ValueError(
        "scaled_adam partial statistic: state has no clipping state; build it with the "
        "same options (clipping_scale set) as the statistic"
    )
