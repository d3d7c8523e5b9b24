"""Step schedules used by the Adafactor variants: second-moment decay and relative step size.

Every schedule maps the optimizer's 0-based step ``count`` (an int32 scalar, the number of
updates already applied) to a float32 scalar, and is jit-safe. ``t = count + 1`` below.
"""

from __future__ import annotations

from typing import Callable, Union

import jax.numpy as jnp

Schedule = Callable[[jnp.ndarray], jnp.ndarray]
ScalarOrSchedule = Union[float, Schedule]


def _t(count, offset=0):
    return jnp.asarray(count, jnp.float32) - jnp.float32(offset) + 1.0


def decay_rate_pow(exponent: float = 0.8, offset: int = 0) -> Schedule:
    """``1 - (count - offset + 1) ** -exponent``: memory grows as t**exponent.

    T5X's and tensor2tensor's default (exponent 0.8); HuggingFace's ``decay_rate=-0.8`` is
    ``exponent=0.8``. ``offset`` is T5X's ``step_offset`` (restarts the schedule for
    fine-tuning; steps before it are undefined, as in T5X). The first step has decay 0.
    """
    return lambda count: 1.0 - _t(count, offset) ** jnp.float32(-exponent)


def decay_rate_adam(beta2: float = 0.999) -> Schedule:
    """tensor2tensor's "adam" schedule: ``beta2 (1 - beta2**(t-1)) / (1 - beta2**t)``.

    Equal to Adam with bias correction folded into the decay (0 on the first step).
    """
    b = jnp.float32(beta2)
    return lambda count: b * (1.0 - b ** (_t(count) - 1.0)) / (1.0 - b ** _t(count))


def relative_step_hf(warmup_init: bool = False) -> Schedule:
    """HuggingFace/fairseq ``relative_step``: ``min(1e-6 t if warmup_init else 1e-2, t**-0.5)``."""

    def schedule(count):
        t = _t(count)
        ceiling = 1e-6 * t if warmup_init else jnp.float32(1e-2)
        return jnp.minimum(ceiling, 1.0 / jnp.sqrt(t))

    return schedule


def relative_step_t2t(multiply_by_parameter_scale: bool = True) -> Schedule:
    """tensor2tensor's default learning rate: ``min(rsqrt(count + 1), 0.01)``, x0.05 when the
    update is not multiplied by the parameter scale."""
    factor = 1.0 if multiply_by_parameter_scale else 0.05

    def schedule(count):
        return jnp.minimum(1.0 / jnp.sqrt(_t(count)), jnp.float32(0.01)) * jnp.float32(factor)

    return schedule


def as_schedule(value: ScalarOrSchedule) -> Schedule:
    """A float becomes a constant schedule; a callable is returned as is."""
    if callable(value):
        return value
    constant = jnp.float32(value)
    return lambda count: constant


def power_of(value: ScalarOrSchedule, exponent: float, factor: float = 1.0) -> Schedule:
    """``factor * value(count) ** exponent`` (T5X's ``weight_decay_rate_lr_exponent``)."""
    base = as_schedule(value)
    return lambda count: jnp.float32(factor) * jnp.asarray(base(count), jnp.float32) ** exponent


def product(value: ScalarOrSchedule, other: ScalarOrSchedule) -> Schedule:
    """``value(count) * other(count)``."""
    a, b = as_schedule(value), as_schedule(other)
    return lambda count: jnp.asarray(a(count), jnp.float32) * jnp.asarray(b(count), jnp.float32)
