"""SOAP's options as one validated, typed value (:class:`SoapConfig`).

Option names and defaults follow ``pytorch_optimizer.SOAP`` (4.1.0), whose defaults are those of
the paper's reference implementation, with ``lr`` spelled ``learning_rate`` as in every optax
kernel here. optserve's own additions:

* ``inline_bases`` says whether the update refreshes the eigenbases itself (see
  :mod:`optserve.optim_kernels.soap.seam`); off, they come from outside (preconditioner workers).

Left out: ``maximize`` (negate the loss, or chain ``optax.scale(-1.0)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
from optserve.optim_kernels import arg_rules as rules

__all__ = ["DATA_FORMATS", "SOAP_ARG_RULES", "ScalarOrSchedule", "SoapConfig", "soap_config"]

ScalarOrSchedule = float | Callable[[jax.Array], jax.Array]

DATA_FORMATS = ("channels_first", "channels_last")

# The value of each option (each field of SoapConfig, each keyword of ``soap``): the registry checks
# the given ones, SoapConfig all of them. shampoo_beta None means "the second moment's beta".
SOAP_ARG_RULES = rules.ArgRules(
    rules.non_negative("learning_rate", schedule=True),
    rules.pair("betas", rules.unit_interval("betas[0]"), rules.unit_interval("betas[1]")),
    rules.unit_interval("shampoo_beta", none=True),
    rules.non_negative("weight_decay"),
    rules.integer("precondition_frequency", 1),
    rules.integer("max_precondition_dim", 1),
    rules.flag("merge_dims"),
    rules.flag("precondition_1d"),
    rules.flag("correct_bias"),
    rules.flag("normalize_gradient"),
    rules.choice("data_format", *DATA_FORMATS),
    rules.non_negative("eps"),
    rules.flag("inline_bases"),
)


@dataclasses.dataclass(frozen=True)
class SoapConfig:
    """Validated SOAP options (see :func:`~optserve.optim_kernels.soap.kernel.soap` for what each does).

    ``betas`` is stored as a tuple of two floats and ``data_format`` in lower case, whatever form
    they were given in, so a config is hashable whenever ``learning_rate`` is.

    Raises:
      ValueError: an option out of range or of the wrong type; the message names it.
    """

    learning_rate: ScalarOrSchedule = 3e-3
    betas: Sequence[float] = (0.95, 0.95)
    shampoo_beta: float | None = None
    weight_decay: float = 1e-2
    precondition_frequency: int = 10
    max_precondition_dim: int = 10000
    merge_dims: bool = False
    precondition_1d: bool = False
    correct_bias: bool = True
    normalize_gradient: bool = False
    data_format: str = "channels_first"
    eps: float = 1e-8
    inline_bases: bool = True

    def __post_init__(self):
        for rule in SOAP_ARG_RULES:
            value = getattr(self, rule.name)
            if rule.violation(value) is not None:
                raise ValueError(f"soap: option {rule.name!r} must satisfy {rule.describe()}, got {value!r}")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        object.__setattr__(self, "data_format", self.data_format.lower())

    @property
    def beta1(self) -> float:
        return self.betas[0]

    @property
    def beta2(self) -> float:
        return self.betas[1]

    @property
    def statistics_beta(self) -> float:
        """The EMA rate of the Kronecker factors: ``shampoo_beta``, else the second moment's."""
        return self.beta2 if self.shampoo_beta is None else float(self.shampoo_beta)


def soap_config(**kwargs) -> SoapConfig:
    """The :class:`SoapConfig` for the same keyword arguments as
    :func:`~optserve.optim_kernels.soap.kernel.soap`."""
    return SoapConfig(**kwargs)
