"""Adafactor in its three reference flavours, built from single-purpose optax links.

* :mod:`.kernel`: the named constructors (T5X :func:`adafactor`, HuggingFace :func:`adafactor_hf`,
  tensor2tensor :func:`adafactor_t2t`) and the cross-shard statistic of T5X's global-norm clip;
* :mod:`.links`: the links they chain (input checks, clipping, parameter scale, momentum, weight
  decay, NaN skipping); :mod:`.second_moment`: the factored second-moment link;
  :mod:`.param_dtype`: the last link, updates in each param's dtype (rounded once, or
  stochastically to bfloat16); :mod:`.tree_helpers`: the per-leaf helpers they share;
* :mod:`.factoring`: which axes of a parameter are factored (pure shape logic);
* :mod:`.schedules`: learning-rate and decay-rate schedules of the references;
* :mod:`.stochastic_rounding`: unbiased rounding of float32 results to bfloat16.
"""

from optserve.optim_kernels.adafactor.factoring import FactorDim, FactorSpec, standard_logical_factor_rules
from optserve.optim_kernels.adafactor.kernel import (
    adafactor,
    adafactor_hf,
    adafactor_partial_statistic,
    adafactor_t2t,
)
from optserve.optim_kernels.adafactor.links import MomentumState
from optserve.optim_kernels.adafactor.second_moment import FactoredRmsState

__all__ = [
    "FactorDim",
    "FactorSpec",
    "FactoredRmsState",
    "MomentumState",
    "adafactor",
    "adafactor_hf",
    "adafactor_partial_statistic",
    "adafactor_t2t",
    "standard_logical_factor_rules",
]
