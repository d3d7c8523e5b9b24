"""SOAP (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using Adam") with a separable
basis refresh.

* :mod:`.config`: :class:`SoapConfig`, the validated options (pytorch_optimizer's names and defaults);
* :mod:`.kernel`: :func:`soap`, the optax transformation;
* :mod:`.layout`: which axes of a parameter get an eigenbasis (merging, one-sided, vectors);
* :mod:`.projection`: rotations into and out of the eigenbases, the per-axis statistics;
* :mod:`.bases`: the refresh itself (eigendecomposition, QR power iteration), pure;
* :mod:`.state`: the state and the statistics update;
* :mod:`.seam`: the refresh as the root offload seam (export, compute anywhere, install).
"""

from optserve.optim_kernels.soap.bases import (
    REFRESH_EIGH,
    REFRESH_POWER,
    BasisConfig,
    compute_bases,
)
from optserve.optim_kernels.soap.config import SOAP_ARG_RULES, SoapConfig, soap_config
from optserve.optim_kernels.soap.kernel import soap
from optserve.optim_kernels.soap.layout import SoapLayout
from optserve.optim_kernels.soap.seam import (
    BasisExport,
    basis_age,
    block_labels,
    export_bases,
    install_bases,
)
from optserve.optim_kernels.soap.state import BasisInfo, ParamState, SoapState

__all__ = [
    "REFRESH_EIGH",
    "REFRESH_POWER",
    "SOAP_ARG_RULES",
    "BasisConfig",
    "BasisExport",
    "BasisInfo",
    "ParamState",
    "SoapConfig",
    "SoapLayout",
    "SoapState",
    "basis_age",
    "block_labels",
    "compute_bases",
    "export_bases",
    "install_bases",
    "soap",
    "soap_config",
]
