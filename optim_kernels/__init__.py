"""Pure JAX optimizer math for optserve: each optimizer is an ``optax.GradientTransformation``.

No I/O, no Ray, no gRPC: the server imports this package, never the other way round.
The constructors are bound here after their modules load, so ``optim_kernels.adafactor`` is
the function even though a module of the same name defines it.
"""

from optserve.optim_kernels.registry import (
    GLOBAL_STATISTIC_ARG,
    OPTIMIZERS,
    BuiltOptimizer,
    build_optimizer,
    optimizer_names,
    optimizer_parameters,
)
from optserve.optim_kernels.adafactor import adafactor, adafactor_hf, adafactor_t2t
from optserve.optim_kernels.matrix_roots import matrix_inverse_pth_root
from optserve.optim_kernels.scaled_adam import scaled_adam
from optserve.optim_kernels.shampoo import compute_preconditioners, shampoo

__all__ = [
    "GLOBAL_STATISTIC_ARG",
    "OPTIMIZERS",
    "BuiltOptimizer",
    "build_optimizer",
    "optimizer_names",
    "optimizer_parameters",
    "adafactor",
    "adafactor_hf",
    "adafactor_t2t",
    "compute_preconditioners",
    "matrix_inverse_pth_root",
    "scaled_adam",
    "shampoo",
]
