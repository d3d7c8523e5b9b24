"""Dense linear algebra for the kernels: inverse p-th roots of symmetric PSD matrices.

* :mod:`.root_config`: the typed root methods (:class:`EigenConfig`, :class:`CoupledNewtonConfig`,
  the opt-in :class:`AutoRootConfig`) and :class:`RootConfig` (method + ridge), the frozen,
  picklable value that selects the computation;
* :mod:`.matrix_roots`: the pure functions (one matrix, a padded stack, matrix power, power
  iteration).
"""

from optserve.optim_kernels.linalg.matrix_roots import (
    inverse_pth_root,
    inverse_pth_roots,
    matrix_inverse_pth_root,
    matrix_power,
    power_iteration,
)
from optserve.optim_kernels.linalg.root_config import (
    ROOT_METHOD_NAMES,
    AutoRootConfig,
    CoupledNewtonConfig,
    EigenConfig,
    RootConfig,
    RootMethodConfig,
    default_root_method,
    root_method_config,
)

__all__ = [
    "ROOT_METHOD_NAMES",
    "AutoRootConfig",
    "CoupledNewtonConfig",
    "EigenConfig",
    "RootConfig",
    "RootMethodConfig",
    "default_root_method",
    "inverse_pth_root",
    "inverse_pth_roots",
    "matrix_inverse_pth_root",
    "matrix_power",
    "power_iteration",
    "root_method_config",
]
