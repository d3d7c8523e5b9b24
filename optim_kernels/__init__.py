"""Pure JAX optimizer math for optserve: each optimizer is an ``optax.GradientTransformation``.

No I/O, no Ray, no gRPC: the server imports this package, never the other way round.
Constructors are imported lazily so that importing the registry stays cheap.
"""

from optserve.optim_kernels.registry import (
    GLOBAL_STATISTIC_ARG,
    OPTIMIZERS,
    BuiltOptimizer,
    build_optimizer,
    optimizer_names,
    optimizer_parameters,
)

_LAZY = {
    "adafactor": "optserve.optim_kernels.adafactor",
    "adafactor_hf": "optserve.optim_kernels.adafactor",
    "adafactor_t2t": "optserve.optim_kernels.adafactor",
    "shampoo": "optserve.optim_kernels.shampoo",
    "compute_preconditioners": "optserve.optim_kernels.shampoo",
    "matrix_inverse_pth_root": "optserve.optim_kernels.matrix_roots",
    "scaled_adam": "optserve.optim_kernels.scaled_adam",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'optserve.optim_kernels' has no attribute {name!r}")


__all__ = [
    "GLOBAL_STATISTIC_ARG",
    "OPTIMIZERS",
    "BuiltOptimizer",
    "build_optimizer",
    "optimizer_names",
    "optimizer_parameters",
    *_LAZY,
]
