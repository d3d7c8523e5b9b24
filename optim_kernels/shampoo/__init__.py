"""Shampoo (google-research distributed Shampoo semantics) with a separable root computation.

* :mod:`.config`: :class:`ShampooConfig`, the validated options (seed names and defaults);
* :mod:`.kernel`: :func:`shampoo`, the optax transformation;
* :mod:`.state`: its state and the tree-level statistics update;
* :mod:`.seam`: the root offload seam (export statistics, compute roots anywhere, install them)
  and :class:`BlockLabel`, which names each exported statistic;
* :mod:`.blocking`, :mod:`.statistics`, :mod:`.grafting`, :mod:`.quantization`: the pieces.
"""

from optserve.optim_kernels.linalg.root_config import default_root_method
from optserve.optim_kernels.shampoo.blocking import BlockLayout, merge_small_dims
from optserve.optim_kernels.shampoo.config import ShampooConfig, shampoo_config
from optserve.optim_kernels.shampoo.grafting import GraftingType
from optserve.optim_kernels.shampoo.kernel import shampoo
from optserve.optim_kernels.shampoo.seam import (
    BlockLabel,
    StatisticsExport,
    block_labels,
    compute_preconditioners,
    export_statistics,
    install_preconditioners,
    preconditioner_age,
)
from optserve.optim_kernels.shampoo.state import ParamState, PreconditionerInfo, ShampooState

__all__ = [
    "BlockLabel",
    "BlockLayout",
    "GraftingType",
    "ParamState",
    "PreconditionerInfo",
    "ShampooConfig",
    "ShampooState",
    "StatisticsExport",
    "block_labels",
    "compute_preconditioners",
    "default_root_method",
    "export_statistics",
    "install_preconditioners",
    "merge_small_dims",
    "preconditioner_age",
    "shampoo",
    "shampoo_config",
]
