"""Delayed Nesterov's options as one validated, typed value, and their value rules.

:data:`DELAYED_NESTEROV_ARG_RULES` holds the rule of every option of
:func:`~optserve.optim_kernels.delayed_nesterov.kernel.delayed_nesterov`; the registry checks the
given ones before building. :class:`DelayedNesterovConfig` checks all of them (so the constructor
called directly refuses the same values) plus the one rule that joins two options: the momentum
activation ``c`` of Liu et al.'s Algorithm 3 lies in ``[0, 1/N]``, ``N`` being ``delay``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optax
from optserve.optim_kernels import arg_rules as rules

__all__ = ["DELAYED_NESTEROV_ARG_RULES", "DelayedNesterovConfig"]

NAME = "delayed_nesterov"

DELAYED_NESTEROV_ARG_RULES = rules.ArgRules(
    rules.non_negative("learning_rate", schedule=True),
    rules.unit_interval("momentum"),
    rules.integer("delay", 1),
    # The upper end is 1 / delay; DelayedNesterovConfig checks it against the delay given.
    rules.real("momentum_activation", 0, 1),
    rules.dtype("accumulator_dtype", none=True),
)


@dataclasses.dataclass(frozen=True)
class DelayedNesterovConfig:
    """Validated delayed Nesterov options (see
    :func:`~optserve.optim_kernels.delayed_nesterov.kernel.delayed_nesterov` for each).

    Raises:
      ArgumentRuleError: (a ``ValueError``) an option that breaks its own rule, naming it.
      ValueError: ``momentum_activation > 1 / delay``, naming ``momentum_activation``.
    """

    learning_rate: optax.ScalarOrSchedule
    delay: int
    momentum: float = 0.9
    momentum_activation: float = 0.0
    accumulator_dtype: Any | None = None

    def __post_init__(self):
        for rule in DELAYED_NESTEROV_ARG_RULES:
            error = rule.error(NAME, getattr(self, rule.name))
            if error is not None:
                raise error
        object.__setattr__(self, "delay", int(self.delay))
        object.__setattr__(self, "momentum", float(self.momentum))
        object.__setattr__(self, "momentum_activation", float(self.momentum_activation))
        if self.momentum_activation * self.delay > 1.0:
            raise ValueError(
                f"argument 'momentum_activation' = {self.momentum_activation!r} must satisfy "
                f"0 <= momentum_activation <= 1 / delay = {1.0 / self.delay:.6g} (delay = {self.delay}): "
                f"past it the momentum-update arrival would take a negative share of the momentum")
