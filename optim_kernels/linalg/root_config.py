"""Typed choices of how an inverse p-th root is computed, and the full root configuration.

A root method is a small frozen dataclass, not a string, so that the options that belong to one
method travel with it and nothing else:

* :class:`EigenConfig`: one symmetric eigendecomposition (exact for every ``p``);
* :class:`CoupledNewtonConfig`: the coupled Newton iteration (matrix products only), with its
  iteration cap and stopping residual;
* :class:`AutoRootConfig`: an explicit opt-in that picks one of two concrete methods by the JAX
  backend of the process that *computes* the root (see :func:`default_root_method`).

:class:`RootConfig` adds the ridge (``matrix_epsilon``, relative or absolute) to the method. It
is frozen, hashable and picklable: a kernel builds it once from its options, and it crosses
process boundaries unchanged (to preconditioner workers), where it selects the pure matrix
function (:func:`optserve.optim_kernels.linalg.matrix_roots.inverse_pth_roots`) and is a
static argument of its jitted computation.

String names (the wire's ``root_method`` option) map onto these types with
:func:`root_method_config`.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import ClassVar, Optional, Union

import jax

__all__ = [
    "ROOT_METHOD_NAMES",
    "AutoRootConfig",
    "ConcreteRootMethod",
    "CoupledNewtonConfig",
    "EigenConfig",
    "RootConfig",
    "RootMethodConfig",
    "default_root_method",
    "root_method_config",
]


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class EigenConfig:
    """Root from one symmetric eigendecomposition ``A = U diag(e) U^T``.

    Exact for every integer ``p`` up to the decomposition's accuracy; on CPU the faster method,
    on accelerators slower than coupled Newton from blocks of ~512 and less accurate in float32
    (see :func:`default_root_method`).
    """

    name: ClassVar[str] = "eigh"


@dataclasses.dataclass(frozen=True)
class CoupledNewtonConfig:
    """Root by the coupled Newton iteration (the seed's method).

    Attributes:
      num_iters: iteration cap (>= 1).
      error_tolerance: stopping residual ``max|M - I|``; ``None`` picks it by the dtype the root
        is computed in (1e-6 in float32, as the seed; 1e-13 in float64), i.e. on the process
        that computes it.
    """

    num_iters: int = 100
    error_tolerance: Optional[float] = None

    name: ClassVar[str] = "coupled_newton"

    def __post_init__(self):
        if not _is_int(self.num_iters) or self.num_iters < 1:
            raise ValueError(f"coupled Newton option 'num_iters' must be an integer >= 1, got {self.num_iters!r}")
        tol = self.error_tolerance
        if tol is not None and (not _is_real(tol) or not tol > 0):
            raise ValueError(f"coupled Newton option 'error_tolerance' must be None or > 0, got {tol!r}")


ConcreteRootMethod = Union[EigenConfig, CoupledNewtonConfig]


@dataclasses.dataclass(frozen=True)
class AutoRootConfig:
    """Opt-in: ``cpu`` on a CPU backend, ``accelerator`` on any other.

    Resolved where the root is computed (a preconditioner worker on a GPU resolves it to
    ``accelerator`` even when the session was configured on a CPU-only server).
    """

    cpu: ConcreteRootMethod = EigenConfig()
    accelerator: ConcreteRootMethod = CoupledNewtonConfig()

    name: ClassVar[str] = "auto"

    def __post_init__(self):
        for field in ("cpu", "accelerator"):
            if not isinstance(getattr(self, field), (EigenConfig, CoupledNewtonConfig)):
                raise ValueError(f"auto root method: {field!r} must be EigenConfig or CoupledNewtonConfig, "
                                 f"got {getattr(self, field)!r}")

    def resolve(self, backend: Optional[str] = None) -> ConcreteRootMethod:
        """The concrete method for ``backend`` (default: this process's JAX backend)."""
        return self.cpu if default_root_method(backend) == EigenConfig.name else self.accelerator


RootMethodConfig = Union[EigenConfig, CoupledNewtonConfig, AutoRootConfig]
ROOT_METHOD_NAMES: tuple[str, ...] = (CoupledNewtonConfig.name, EigenConfig.name, AutoRootConfig.name)


def default_root_method(backend: Optional[str] = None) -> str:
    """What ``"auto"`` picks on ``backend`` (default: this process's): eigh on CPU, coupled Newton
    elsewhere.

    On CPU (bench/shampoo.py) a Shampoo step with roots for 52 blocks of 128 took 0.11 s with
    eigh and 0.28 s with coupled Newton, and eigh reaches ~1e-15 residuals in f64 for every ``p``
    (the issue measured coupled Newton 2-13x slower than eigh on CPU). On an H100 (jax 0.11.2,
    bench/shampoo.py) coupled Newton is the one that holds up: per block of 512 / 1024 it took
    2.5 / 10.6 ms in f32 against eigh's 7.5 / 71 ms, and f32 eigh there misses the f32 accuracy
    tolerances of tests/test_matrix_roots.py at condition 1e6 (error 0.21 for p = 1), which
    coupled Newton meets. eigh is faster on the GPU only for blocks up to 256 (0.12 against
    0.65 ms at 128); pass ``root_method="eigh"`` with f64 roots there if that matters.
    """
    backend = backend or jax.default_backend()
    return EigenConfig.name if backend == "cpu" else CoupledNewtonConfig.name


def root_method_config(method: Union[str, RootMethodConfig], num_iters: int = 100,
                       error_tolerance: Optional[float] = None, path: str = "method") -> RootMethodConfig:
    """The typed choice for a method name (``"coupled_newton"``, ``"eigh"`` or ``"auto"``).

    ``num_iters`` and ``error_tolerance`` configure coupled Newton (also as ``"auto"``'s
    accelerator method). A typed config is returned unchanged.

    Raises:
      ValueError: an unknown name, naming ``path``.
    """
    if isinstance(method, (EigenConfig, CoupledNewtonConfig, AutoRootConfig)):
        return method
    newton = CoupledNewtonConfig(num_iters, error_tolerance)
    if method == CoupledNewtonConfig.name:
        return newton
    if method == EigenConfig.name:
        return EigenConfig()
    if method == AutoRootConfig.name:
        return AutoRootConfig(accelerator=newton)
    raise ValueError(f"{path}: unknown root method {method!r}; expected one of {ROOT_METHOD_NAMES}")


@dataclasses.dataclass(frozen=True)
class RootConfig:
    """Everything that decides the inverse roots of a batch of statistics (besides their dtype).

    Attributes:
      method: the root method (:class:`CoupledNewtonConfig` by default, as the seed).
      matrix_epsilon: the ridge added before the root (>= 0).
      relative_matrix_epsilon: scale the ridge by each matrix's largest eigenvalue.
    """

    method: RootMethodConfig = CoupledNewtonConfig()
    matrix_epsilon: float = 1e-6
    relative_matrix_epsilon: bool = True

    def __post_init__(self):
        if not isinstance(self.method, (EigenConfig, CoupledNewtonConfig, AutoRootConfig)):
            raise ValueError(f"root config: 'method' must be EigenConfig, CoupledNewtonConfig or AutoRootConfig, "
                             f"got {self.method!r} (map a name with root_method_config)")
        if not _is_real(self.matrix_epsilon) or self.matrix_epsilon < 0:
            raise ValueError(f"root config: 'matrix_epsilon' must be a number >= 0, got {self.matrix_epsilon!r}")
        if not isinstance(self.relative_matrix_epsilon, bool):
            raise ValueError(f"root config: 'relative_matrix_epsilon' must be a bool, "
                             f"got {self.relative_matrix_epsilon!r}")
        object.__setattr__(self, "matrix_epsilon", float(self.matrix_epsilon))

    def resolved(self, backend: Optional[str] = None) -> "RootConfig":
        """This config with an :class:`AutoRootConfig` replaced by its choice for ``backend``."""
        if isinstance(self.method, AutoRootConfig):
            return dataclasses.replace(self, method=self.method.resolve(backend))
        return self
