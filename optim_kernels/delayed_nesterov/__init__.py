"""Delayed Nesterov momentum (DN), the outer optimizer of asynchronous DiLoCo (Liu et al., 2024).

* :mod:`.kernel`: the constructor :func:`delayed_nesterov` (learning rate included), the
  direction alone (:func:`scale_by_delayed_nesterov`) and their state;
* :mod:`.config`: :class:`DelayedNesterovConfig`, the validated options, and their value rules.
"""

from optserve.optim_kernels.delayed_nesterov.config import (
    DELAYED_NESTEROV_ARG_RULES,
    DelayedNesterovConfig,
)
from optserve.optim_kernels.delayed_nesterov.kernel import (
    DelayedNesterovState,
    delayed_nesterov,
    delayed_nesterov_from_config,
    scale_by_delayed_nesterov,
)

__all__ = [
    "DELAYED_NESTEROV_ARG_RULES",
    "DelayedNesterovConfig",
    "DelayedNesterovState",
    "delayed_nesterov",
    "delayed_nesterov_from_config",
    "scale_by_delayed_nesterov",
]
