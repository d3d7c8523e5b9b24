"""ScaledAdam (icefall's Zipformer optimizer) as a chain of optax links.

* :mod:`.config`: :class:`ScaledAdamConfig`, the validated options;
* :mod:`.kernel`: the flat constructor :func:`scaled_adam`, the same from a config, and the
  cross-shard clipping statistic;
* :mod:`.update`: the core link (Adam scaled by each tensor's RMS, learned tensor scale);
* :mod:`.clipping`: clipping to a multiple of the median recent gradient norm;
* :mod:`.batching`: stacking of same-shape tensors so one computation serves a group.
"""

from optserve.optim_kernels.scaled_adam.clipping import ClipByMedianNormState, clip_by_median_norm
from optserve.optim_kernels.scaled_adam.config import ScaledAdamConfig
from optserve.optim_kernels.scaled_adam.kernel import (
    clamp_scalar_params,
    scaled_adam,
    scaled_adam_from_config,
    scaled_adam_partial_statistic,
)
from optserve.optim_kernels.scaled_adam.update import ScaleByScaledAdamState, scale_by_scaled_adam

__all__ = [
    "ClipByMedianNormState",
    "ScaleByScaledAdamState",
    "ScaledAdamConfig",
    "clamp_scalar_params",
    "clip_by_median_norm",
    "scale_by_scaled_adam",
    "scaled_adam",
    "scaled_adam_from_config",
    "scaled_adam_partial_statistic",
]
