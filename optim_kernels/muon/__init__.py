"""Muon (momentum orthogonalised by Newton–Schulz) for matrices, AdamW for the other tensors.

* :mod:`.kernel`: the flat constructor :func:`muon` (optax.contrib.muon's options, as JSON)
  and the same from a config;
* :mod:`.config`: :class:`MuonConfig`, the validated options, and their value rules;
* :mod:`.links`: the Muon path's own links (orthogonalised momentum, shape scaling);
* :mod:`.newton_schulz`: the orthogonalisation itself (pure matrix function, coefficients);
* :mod:`.axes`: which axes of a tensor form its matrix (pure shape logic);
* :mod:`.selection`: which tensors take which path, by name and shape.
"""

from optserve.optim_kernels.muon.axes import DEFAULT_AXES, MatrixAxes
from optserve.optim_kernels.muon.config import MUON_ARG_RULES, MuonConfig
from optserve.optim_kernels.muon.kernel import muon, muon_from_config
from optserve.optim_kernels.muon.links import (
    OrthogonalizedMomentumState,
    scale_by_matrix_shape,
    scale_by_orthogonalized_momentum,
)
from optserve.optim_kernels.muon.newton_schulz import (
    STANDARD_COEFFS,
    coefficient_schedule,
    orthogonalize,
)
from optserve.optim_kernels.muon.selection import TensorSelection

__all__ = [
    "DEFAULT_AXES",
    "MUON_ARG_RULES",
    "STANDARD_COEFFS",
    "MatrixAxes",
    "MuonConfig",
    "OrthogonalizedMomentumState",
    "TensorSelection",
    "coefficient_schedule",
    "muon",
    "muon_from_config",
    "orthogonalize",
    "scale_by_matrix_shape",
    "scale_by_orthogonalized_momentum",
]
