"""ScaledAdam's options as one validated, typed value (icefall's names and defaults).

:class:`ScaledAdamConfig` is the single definition of the options: the flat constructor
:func:`~optserve.optim_kernels.scaled_adam.kernel.scaled_adam` and the cross-shard statistic
factory both build one, so the checks and their messages exist once.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from optserve.optim_kernels import arg_rules as rules
from optserve.optim_kernels.scaled_adam.update import ScalarOrSchedule

__all__ = ["SCALED_ADAM_ARG_RULES", "ScaledAdamConfig"]

# The value of each option (each field of ScaledAdamConfig, each keyword of ``scaled_adam``): the
# registry checks the given ones, ScaledAdamConfig all of them (and param_max_rms >= param_min_rms).
SCALED_ADAM_ARG_RULES = rules.ArgRules(
    rules.non_negative("lr", schedule=True),
    rules.positive("clipping_scale", none=True),
    rules.pair("betas", rules.unit_interval("betas[0]"), rules.unit_interval("betas[1]")),
    rules.non_negative("scalar_lr_scale"),
    rules.positive("eps"),
    rules.non_negative("param_min_rms"),
    rules.non_negative("param_max_rms"),
    rules.positive("scalar_max"),
    rules.integer("size_update_period", 1),
    rules.integer("clipping_update_period", 1),
    rules.flag("show_dominant_parameters"),
)


@dataclasses.dataclass(frozen=True)
class ScaledAdamConfig:
    """Validated ScaledAdam options (see :func:`~optserve.optim_kernels.scaled_adam.kernel.scaled_adam`
    for what each one does).

    ``betas`` is stored as a tuple of two floats whatever sequence was given, so a config is
    hashable whenever ``lr`` is.

    Raises:
      ValueError: an option out of range or of the wrong type; the message names it.
    """

    lr: ScalarOrSchedule = 0.03
    clipping_scale: Optional[float] = None
    betas: Sequence[float] = (0.9, 0.98)
    scalar_lr_scale: float = 0.1
    eps: float = 1.0e-8
    param_min_rms: float = 1.0e-5
    param_max_rms: float = 3.0
    scalar_max: float = 10.0
    size_update_period: int = 4
    clipping_update_period: int = 100
    show_dominant_parameters: bool = True

    def __post_init__(self):
        for rule in SCALED_ADAM_ARG_RULES:
            value = getattr(self, rule.name)
            if rule.violation(value) is not None:
                _fail(rule.name, f"must satisfy {rule.describe()}", value)
        if self.param_max_rms < self.param_min_rms:
            _fail("param_max_rms", f"must be >= param_min_rms ({self.param_min_rms!r})", self.param_max_rms)
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))

    @property
    def beta1(self) -> float:
        return self.betas[0]

    @property
    def beta2(self) -> float:
        return self.betas[1]


def _fail(name: str, rule: str, value) -> None:
    raise ValueError(f"scaled_adam option {name!r} {rule}, got {value!r}")
