"""Pure JAX optimizer math for optserve: each optimizer is an ``optax.GradientTransformation``.

No I/O, no Ray, no gRPC: the server imports this package, never the other way round.

Families live in subpackages (:mod:`.adafactor`, :mod:`.shampoo`, :mod:`.scaled_adam`), the
dense linear algebra they share in :mod:`.linalg`, and :mod:`.registry` maps names to them; each
family declares the value rules of its options (:mod:`.arg_rules`) next to its constructors;
:mod:`.schedules` turns schedule specs (``{"schedule": NAME, ...}``) into optax schedules. The
constructors are bound here after the subpackages load, so ``optim_kernels.shampoo`` is the
function even though a subpackage of the same name defines it (import the subpackage's other
names with ``from optserve.optim_kernels.shampoo import ...``).
"""

from optserve.optim_kernels.registry import (
    GLOBAL_STATISTIC_ARG,
    OPTIMIZERS,
    BuiltOptimizer,
    args_for_tensors,
    build_optimizer,
    optimizer_names,
    optimizer_parameters,
)
from optserve.optim_kernels.schedules import SCHEDULES, resolve_schedules  # noqa: E402
from optserve.optim_kernels.adafactor import adafactor, adafactor_hf, adafactor_t2t  # noqa: E402
from optserve.optim_kernels.linalg import matrix_inverse_pth_root  # noqa: E402
from optserve.optim_kernels.muon import muon  # noqa: E402
from optserve.optim_kernels.scaled_adam import scaled_adam  # noqa: E402
from optserve.optim_kernels.shampoo import compute_preconditioners, shampoo  # noqa: E402
from optserve.optim_kernels.soap import soap  # noqa: E402

__all__ = [
    "GLOBAL_STATISTIC_ARG",
    "OPTIMIZERS",
    "BuiltOptimizer",
    "args_for_tensors",
    "build_optimizer",
    "optimizer_names",
    "optimizer_parameters",
    "SCHEDULES",
    "resolve_schedules",
    "adafactor",
    "adafactor_hf",
    "adafactor_t2t",
    "compute_preconditioners",
    "matrix_inverse_pth_root",
    "muon",
    "scaled_adam",
    "shampoo",
    "soap",
]
