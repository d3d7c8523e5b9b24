"""Schedules given by spec: a hyperparameter that changes with the step, in plain JSON.

A schedulable argument (one whose rule admits a schedule: ``learning_rate``, adamw's
``weight_decay``, ...) may be given as ``{"schedule": NAME, **keyword arguments}``, where NAME is
a schedule constructor of ``optax.schedules``::

    {"schedule": "warmup_cosine_decay_schedule", "init_value": 0.0, "peak_value": 1e-3,
     "warmup_steps": 100, "decay_steps": 1000}

A keyword argument may itself be a spec, or a list of specs (``join_schedules``' ``schedules``),
and ``piecewise_constant_schedule``'s ``boundaries_and_scales`` may name its steps as strings
(JSON object keys). The schedule is evaluated inside the update at the optimizer's own step count
(part of its state), so it is checkpointed, replayed and restored with the state: a session picks
up its schedule where it was.

:func:`resolve_schedules` turns every spec of an argument map into the optax schedule it names; a
spec that names no schedule, or a keyword the constructor does not take, is refused with a
``ValueError`` naming the optimizer, the argument, the schedule and the keyword.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Mapping

import optax

SCHEDULE_KEY = "schedule"

# The schedule constructors of optax.schedules (each returns ``step -> value``); the other names
# there (inject_hyperparams, the state classes) are not schedules.
SCHEDULES: dict[str, Callable[..., Callable]] = {
    name: getattr(optax.schedules, name)
    for name in sorted(dir(optax.schedules))
    if (name.endswith("_schedule") or name.endswith("_decay") or name == "join_schedules")
    and callable(getattr(optax.schedules, name))
}

_STEP_KEYED = {"boundaries_and_scales"}  # {step: value} maps (JSON object keys are strings)


def is_schedule_spec(value: Any) -> bool:
    """``value`` is a schedule spec (a map with a ``"schedule"`` key)."""
    return isinstance(value, Mapping) and SCHEDULE_KEY in value


def resolve_schedules(optimizer: str, args: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` with every schedule spec replaced by the schedule it names (other values as given).

    Raises:
      ValueError: naming the optimizer, the argument, the schedule and what is wrong.
    """
    return {name: build_schedule(value, f"optimizer {optimizer!r}: argument {name!r}")
            if is_schedule_spec(value) else value for name, value in args.items()}


def build_schedule(spec: Mapping[str, Any], where: str) -> Callable:
    """The optax schedule ``spec`` names (see the module docstring); ``where`` prefixes errors."""
    name = spec[SCHEDULE_KEY]
    constructor = SCHEDULES.get(name) if isinstance(name, str) else None
    if constructor is None:
        raise ValueError(f"{where}: unknown schedule {name!r}; the schedules are {sorted(SCHEDULES)}")
    where = f"{where}: schedule {name!r}"
    kwargs = {key: _nested(value, f"{where}, {key!r}") for key, value in spec.items() if key != SCHEDULE_KEY}
    parameters = inspect.signature(constructor).parameters
    unknown = sorted(set(kwargs) - set(parameters))
    if unknown:
        raise ValueError(f"{where} has no keyword {unknown[0]!r}; its keywords are {sorted(parameters)}")
    missing = [p for p, info in parameters.items() if info.default is info.empty and p not in kwargs]
    if missing:
        raise ValueError(f"{where}: keyword {missing[0]!r} is required")
    for key in _STEP_KEYED & set(kwargs):
        kwargs[key] = _step_keyed(kwargs[key], f"{where}, {key!r}")
    try:
        schedule = constructor(**kwargs)
        first = float(schedule(0))
    except (TypeError, ValueError, KeyError, ZeroDivisionError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    if not math.isfinite(first):
        raise ValueError(f"{where}: its value at step 0 is {first}, not a finite number")
    return schedule


def _nested(value: Any, where: str) -> Any:
    """A keyword's value with nested specs built (a spec, or a list holding specs)."""
    if is_schedule_spec(value):
        return build_schedule(value, where)
    if isinstance(value, (list, tuple)) and any(is_schedule_spec(item) for item in value):
        return [build_schedule(item, f"{where}[{i}]") if is_schedule_spec(item) else item
                for i, item in enumerate(value)]
    return value


def _step_keyed(value: Any, where: str) -> Any:
    """A ``{step: value}`` map with its steps as ints (given as JSON, they are strings)."""
    if not isinstance(value, Mapping):
        return value
    try:
        return {int(step): scale for step, scale in value.items()}
    except (TypeError, ValueError):
        raise ValueError(f"{where}: its keys must be integer steps, got {sorted(map(str, value))}") from None
