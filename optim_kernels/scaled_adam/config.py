"""ScaledAdam's options as one validated, typed value (icefall's names and defaults).

:class:`ScaledAdamConfig` is the single definition of the options: the flat constructor
:func:`~optserve.optim_kernels.scaled_adam.kernel.scaled_adam` and the cross-shard statistic
factory both build one, so the checks and their messages exist once.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional, Sequence

from optserve.optim_kernels.scaled_adam.update import ScalarOrSchedule

__all__ = ["ScaledAdamConfig"]


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
        if not callable(self.lr) and _real("lr", self.lr) < 0:
            _fail("lr", "must be >= 0", self.lr)
        if self.clipping_scale is not None and _real("clipping_scale", self.clipping_scale) <= 0:
            _fail("clipping_scale", "must be > 0 or None", self.clipping_scale)
        betas = self.betas
        if isinstance(betas, (str, bytes)) or not isinstance(betas, Sequence) or len(betas) != 2:
            _fail("betas", "must be a pair (beta1, beta2)", betas)
        b1, b2 = _real("betas", betas[0]), _real("betas", betas[1])
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            _fail("betas", "must lie in [0, 1)", tuple(betas))
        object.__setattr__(self, "betas", (b1, b2))
        if _real("scalar_lr_scale", self.scalar_lr_scale) < 0:
            _fail("scalar_lr_scale", "must be >= 0", self.scalar_lr_scale)
        if _real("eps", self.eps) <= 0:
            _fail("eps", "must be > 0", self.eps)
        if _real("param_min_rms", self.param_min_rms) < 0:
            _fail("param_min_rms", "must be >= 0", self.param_min_rms)
        if _real("param_max_rms", self.param_max_rms) < self.param_min_rms:
            _fail("param_max_rms", f"must be >= param_min_rms ({self.param_min_rms!r})", self.param_max_rms)
        if _real("scalar_max", self.scalar_max) <= 0:
            _fail("scalar_max", "must be > 0", self.scalar_max)
        _period("size_update_period", self.size_update_period)
        _period("clipping_update_period", self.clipping_update_period)
        if not isinstance(self.show_dominant_parameters, bool):
            _fail("show_dominant_parameters", "must be a bool", self.show_dominant_parameters)

    @property
    def beta1(self) -> float:
        return self.betas[0]

    @property
    def beta2(self) -> float:
        return self.betas[1]


def _fail(name: str, rule: str, value) -> None:
    raise ValueError(f"scaled_adam option {name!r} {rule}, got {value!r}")


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        _fail(name, "must be a finite number", value)
    return float(value)


def _period(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        _fail(name, "must be an integer >= 1", value)
