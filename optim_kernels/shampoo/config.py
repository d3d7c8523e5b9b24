"""Shampoo's options as one validated, typed value (:class:`ShampooConfig`).

Option names follow the seed's ``distributed_shampoo``, and so do the defaults, with these
additions of optserve's own:

* ``block_size`` defaults to 128 (the seed's recommended value; it has no default there);
* ``merge_small_dims_block_size=None`` merges small dimensions up to ``block_size``, which is
  what the seed does (it has no such option); an int merges up to that value instead;
* ``root_method`` picks the typed root method
  (:mod:`optserve.optim_kernels.linalg.root_config`): ``"coupled_newton"`` (the seed's, the
  default), ``"eigh"``, or the opt-in ``"auto"`` (eigh on CPU, coupled Newton elsewhere, resolved
  by the process that computes the roots); ``root_num_iters`` caps coupled Newton's iterations;
* ``inline_preconditioners`` says whether the update computes roots itself (see
  :mod:`optserve.optim_kernels.shampoo.seam`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Union

import jax

from optserve.optim_kernels import arg_rules as rules
from optserve.optim_kernels.linalg.root_config import (
    ROOT_METHOD_NAMES,
    AutoRootConfig,
    RootConfig,
    RootMethodConfig,
    root_method_config,
)
from optserve.optim_kernels.shampoo.blocking import BlockLayout
from optserve.optim_kernels.shampoo.grafting import GraftingType, parse_graft_type
from optserve.optim_kernels.shampoo.statistics import block_exponent

__all__ = ["SHAMPOO_ARG_RULES", "ScalarOrSchedule", "ShampooConfig", "shampoo_config"]

ScalarOrSchedule = Union[float, Callable[[jax.Array], jax.Array]]

# The value of each option (each field of ShampooConfig, each keyword of ``shampoo``): the registry
# checks the given ones, ShampooConfig all of them. beta2 = 1 is the seed's plain sum (AdaGrad), beta2 = 0
# keeps only the latest gradient's statistics (the seed admits both); a learning rate of 0 leaves the
# parameters as they are;
# block_size 0 means no blocking; exponent_override 0 means the default root.
SHAMPOO_ARG_RULES = rules.ArgRules(
    rules.non_negative("learning_rate", schedule=True),
    rules.integer("block_size", 0),
    rules.unit_interval("beta1"),
    rules.real("beta2", 0, 1),
    rules.non_negative("diagonal_epsilon"),
    rules.non_negative("matrix_epsilon"),
    rules.non_negative("weight_decay"),
    rules.integer("start_preconditioning_step", 0),
    rules.integer("preconditioning_compute_steps", 1),
    rules.integer("statistics_compute_steps", 1),
    rules.flag("best_effort_shape_interpretation"),
    rules.delegated("graft_type", "a GraftingType, its int value or its name"),
    rules.flag("nesterov"),
    rules.integer("exponent_override", 0),
    rules.flag("best_effort_memory_usage_reduction"),
    rules.positive("inverse_failure_threshold"),
    rules.flag("moving_average_for_momentum"),
    rules.integer("skip_preconditioning_dim_size_gt", 1),
    rules.positive("clip_by_scaled_gradient_norm", none=True),
    rules.flag("relative_matrix_epsilon"),
    rules.integer("merge_small_dims_block_size", 1, none=True),
    rules.flag("decoupled_learning_rate"),
    rules.flag("decoupled_weight_decay"),
    rules.delegated("root_method", f"one of {ROOT_METHOD_NAMES} or a typed root method"),
    rules.integer("root_num_iters", 1),
    rules.flag("inline_preconditioners"),
)


@dataclasses.dataclass(frozen=True)
class ShampooConfig:
    """Validated Shampoo options (see the module docstring for those that are not the seed's).

    ``graft_type`` is stored as a :class:`GraftingType` whatever form it was given in.

    Raises:
      ValueError: an option out of range or of the wrong type; the message names it.
    """

    learning_rate: ScalarOrSchedule
    block_size: int = 128
    beta1: float = 0.9
    beta2: float = 0.999
    diagonal_epsilon: float = 1e-10
    matrix_epsilon: float = 1e-6
    weight_decay: float = 0.0
    start_preconditioning_step: int = 5
    preconditioning_compute_steps: int = 1
    statistics_compute_steps: int = 1
    best_effort_shape_interpretation: bool = True
    graft_type: GraftingType = GraftingType.SGD
    nesterov: bool = True
    exponent_override: int = 0
    best_effort_memory_usage_reduction: bool = False
    inverse_failure_threshold: float = 0.1
    moving_average_for_momentum: bool = False
    skip_preconditioning_dim_size_gt: int = 4096
    clip_by_scaled_gradient_norm: Optional[float] = None
    relative_matrix_epsilon: bool = True
    merge_small_dims_block_size: Optional[int] = None
    decoupled_learning_rate: bool = True
    decoupled_weight_decay: bool = False
    root_method: Union[str, RootMethodConfig] = "coupled_newton"
    root_num_iters: int = 100
    inline_preconditioners: bool = True

    def __post_init__(self):
        def need(ok: bool, name: str, rule: str):
            if not ok:
                raise ValueError(f"shampoo: option {name!r} {rule}, got {getattr(self, name)!r}")

        for rule in SHAMPOO_ARG_RULES:
            need(rule.violation(getattr(self, rule.name)) is None, rule.name, f"must satisfy {rule.describe()}")
        try:
            root_method_config(self.root_method, self.root_num_iters)
        except (ValueError, TypeError):
            need(False, "root_method", f"must be one of {ROOT_METHOD_NAMES} or a typed root method")
        object.__setattr__(self, "graft_type", parse_graft_type(self.graft_type))

    @property
    def root_method_config(self) -> RootMethodConfig:
        """The typed root method (a name maps with ``root_num_iters`` as coupled Newton's cap)."""
        return root_method_config(self.root_method, self.root_num_iters)

    @property
    def root_config(self) -> RootConfig:
        """What decides the roots: the typed method and the ridge (hashable, picklable)."""
        return RootConfig(self.root_method_config, self.matrix_epsilon, self.relative_matrix_epsilon)

    @property
    def method(self) -> str:
        """The concrete root method's name (``"auto"`` resolved for this process's backend)."""
        method = self.root_method_config
        return (method.resolve() if isinstance(method, AutoRootConfig) else method).name

    @property
    def merge_max_dim(self) -> int:
        """Small dimensions are merged while their product stays at most this."""
        return self.block_size if self.merge_small_dims_block_size is None else self.merge_small_dims_block_size

    def layout(self, shape) -> Optional[BlockLayout]:
        """The block layout of a parameter of ``shape``, or ``None`` when it is not preconditioned."""
        if len(shape) < 1 or any(d > self.skip_preconditioning_dim_size_gt for d in shape):
            return None
        return BlockLayout.create(shape, self.block_size, self.best_effort_shape_interpretation,
                                  self.merge_max_dim)

    def exponent(self, layout: BlockLayout) -> int:
        """The root ``p`` of every statistic of a parameter with ``layout``."""
        return block_exponent(len(layout.working_shape), self.exponent_override)


def shampoo_config(learning_rate: ScalarOrSchedule, **kwargs) -> ShampooConfig:
    """The :class:`ShampooConfig` for the same keyword arguments as
    :func:`~optserve.optim_kernels.shampoo.kernel.shampoo`."""
    return ShampooConfig(learning_rate, **kwargs)
