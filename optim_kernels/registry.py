"""Optimizers by name: the one place that maps a wire-level optimizer spec to a kernel.

A spec is ``{"name": "adafactor_hf", "args": {...}}``. :func:`build_optimizer` resolves the
name, checks every argument against the constructor's signature and calls it, so a bad spec
fails with a ``ValueError`` that names the optimizer and the option before any state exists.

Cross-shard statistics
----------------------
Some optimizers need one number computed over *all* tensors of a model (T5X's global-norm
clipping, ScaledAdam's clipping to a multiple of the median gradient norm). When a model is
split across shards, each shard computes a *partial* statistic over its own tensors, the
shards sum the partials, and each passes the sum to its update as the extra argument
``global_grad_sq_norm``. An entry that needs this names a factory in its module:
``factory(**args) -> partial(grads, state, params) -> scalar``, or ``None`` when these
arguments need no such quantity (e.g. clipping is off). Summing ``partial`` over a partition
of the tensors must give exactly the value the kernel computes in process, and an update
called without ``global_grad_sq_norm`` computes it over its own tree.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any, Callable, Mapping, NamedTuple, Optional

import optax

GLOBAL_STATISTIC_ARG = "global_grad_sq_norm"


@dataclasses.dataclass(frozen=True)
class KernelEntry:
    """Where a named optimizer lives.

    Attributes:
      module: import path of the module that defines the constructor.
      constructor: name of the function returning an ``optax.GradientTransformation``.
      partial_statistic: name of a factory in ``module`` (same keyword arguments as the
        constructor) returning ``partial(grads, state, params) -> f32 scalar``, or ``None``
        when the optimizer needs no cross-tensor quantity.
    """

    module: str
    constructor: str
    partial_statistic: Optional[str] = None

    def load(self) -> Callable[..., optax.GradientTransformation]:
        return getattr(importlib.import_module(self.module), self.constructor)

    def load_partial_statistic(self) -> Optional[Callable[..., Callable]]:
        if self.partial_statistic is None:
            return None
        return getattr(importlib.import_module(self.module), self.partial_statistic)


_K = "optserve.optim_kernels"

OPTIMIZERS: dict[str, KernelEntry] = {
    "adafactor": KernelEntry(f"{_K}.adafactor", "adafactor", "adafactor_partial_statistic"),
    "adafactor_hf": KernelEntry(f"{_K}.adafactor", "adafactor_hf"),
    "adafactor_t2t": KernelEntry(f"{_K}.adafactor", "adafactor_t2t"),
    "shampoo": KernelEntry(f"{_K}.shampoo", "shampoo"),
    "scaled_adam": KernelEntry(f"{_K}.scaled_adam", "scaled_adam", "scaled_adam_partial_statistic"),
    # Baselines, straight from optax.
    "adam": KernelEntry("optax", "adam"),
    "adamw": KernelEntry("optax", "adamw"),
    "sgd": KernelEntry("optax", "sgd"),
}


class BuiltOptimizer(NamedTuple):
    """A validated optimizer ready to run.

    Attributes:
      name: the registry name.
      args: the keyword arguments it was built with (after validation).
      transformation: the optax transformation.
      partial_statistic: ``partial(grads, state, params) -> scalar`` whose sum over shards is
        passed to ``transformation.update`` as ``global_grad_sq_norm``; ``None`` if unused.
    """

    name: str
    args: dict[str, Any]
    transformation: optax.GradientTransformation
    partial_statistic: Optional[Callable]


def optimizer_names() -> list[str]:
    return sorted(OPTIMIZERS)


def optimizer_parameters(name: str) -> Mapping[str, inspect.Parameter]:
    """The constructor's parameters, for validation and documentation."""
    return inspect.signature(_entry(name).load()).parameters


def build_optimizer(name: str, args: Optional[Mapping[str, Any]] = None) -> BuiltOptimizer:
    """Validates ``args`` against the constructor of ``name`` and builds the optimizer.

    Raises:
      ValueError: unknown optimizer, unknown or missing argument, or a value the constructor
        rejects; the message names the optimizer and the option.
    """
    args = dict(args or {})
    entry = _entry(name)
    constructor = entry.load()
    signature = inspect.signature(constructor)
    accepts_kwargs = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    if not accepts_kwargs:
        unknown = sorted(set(args) - set(signature.parameters))
        if unknown:
            raise ValueError(
                f"optimizer {name!r} has no option {unknown[0]!r}; "
                f"its options are {sorted(signature.parameters)}"
            )
    try:
        signature.bind(**args)
    except TypeError as exc:
        raise ValueError(f"optimizer {name!r}: {exc}") from exc
    try:
        transformation = constructor(**args)
    except ValueError as exc:
        raise ValueError(f"optimizer {name!r}: {exc}") from exc
    except TypeError as exc:
        raise ValueError(f"optimizer {name!r}: bad option value: {exc}") from exc
    factory = entry.load_partial_statistic()
    partial = factory(**args) if factory is not None else None
    return BuiltOptimizer(name, args, transformation, partial)


def _entry(name: str) -> KernelEntry:
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; known optimizers: {optimizer_names()}") from None
