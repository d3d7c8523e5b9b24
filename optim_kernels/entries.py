"""What the registry knows of each optimizer: :class:`KernelEntry` (its constructor and what a server
needs beyond the transformation) and :class:`RootOffloadSeam` (how its matrix roots are computed
elsewhere). See :mod:`optserve.optim_kernels.registry` for how they are used."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple, Optional

import optax

from optserve.optim_kernels.arg_rules import ArgRules


class CodeCost(NamedTuple):
    """Host bytes a compiled step keeps (XLA's executable on the CPU and what JAX caches with it)
    for the blocked update of an optimizer with matrix roots: it is unrolled per block, so it grows
    with the blocks, not with their size. ``per_tensor``: each preconditioned tensor; ``per_block``:
    each of its blocks (SOAP: a tensor is one block). Measured by ``python -m bench.code_size``."""

    per_tensor: int
    per_block: int


@dataclasses.dataclass(frozen=True)
class RootOffloadSeam:
    """How a kernel's matrix inverse roots are computed outside its update (preconditioner workers).

    Attributes:
      config: ``(**args) -> config``, the kernel's typed config for the same options as its
        constructor (Shampoo: ``ShampooConfig``).
      without_inline_roots: ``args -> args`` of the same kernel with the roots left out of its
        update (they then come only from ``install``).
      block_labels: ``(config, shapes) -> [BlockLabel]``: which statistic each position of an
        export is (``BlockLabel(tensor, block, dim, size)``), for a shard holding ``shapes``
        (name -> shape of a dict pytree, whose tensors flatten in sorted-name order).
      export: ``(state, config, grads=None) -> StatisticsExport(statistics [B, n, n],
        exponents [B], sizes [B], step)``; jit-able. With the pending ``grads`` of the next update
        it exports the statistics that update will hold. ``exponents`` is a per-block int the
        computation reads (Shampoo: the root ``p``; SOAP: the refresh kind). An export may also
        have a field ``previous`` ([B, n, n], the results in use, identity-padded), which is
        then passed on to ``compute_roots``.
      install: ``(state, config, roots, errors, step) -> state``; jit-able. Rejected roots (error
        NaN or over the kernel's threshold) keep the previous ones and count a failure.
      root_config: ``config -> RootConfig``, the typed, hashable, picklable description of the
        root computation, sent unchanged to the workers.
      compute_roots: ``(statistics, exponents, sizes, root_config[, previous]) -> (roots [B, n, n],
        errors [B])``, pure; ``root_config`` is static, so a closure or ``functools.partial`` over
        it jits once per batch shape. A module-level function, so it pickles by reference.
        ``previous`` is given exactly when the export has it.
      compute_steps: ``config -> int``, updates between two root computations.
      progress: ``state -> (count, source_step [B], failures [B], last_error [B])`` as arrays,
        for status reports (``source_step`` -1: no root installed yet).
      code_cost: ``{roots computed inside the step: CodeCost}``, what the kernel's compiled step
        keeps beside its state, which a server's memory budget counts (empty: not counted).
      per_statistic_state: paths in the kernel's state (dot-separated, as
        ``server/compute/state_leaves.py`` writes them) of leaves stacked over the shard's
        statistics in export order (one row per ``BlockLabel``): a saved state splits them by tensor.
      lag: in the in-process kernel, the updates between the last gradient a computation's
        statistics hold and the first update using its result: 0 for Shampoo (its update folds
        the gradient in, then computes and uses the roots), 1 for SOAP (its update uses the
        basis, then folds the gradient in and refreshes).
    """

    config: Callable[..., Any]
    without_inline_roots: Callable[[Mapping[str, Any]], dict]
    block_labels: Callable[[Any, Mapping[str, tuple[int, ...]]], list]
    export: Callable[..., Any]
    install: Callable[..., Any]
    root_config: Callable[[Any], Any]
    compute_roots: Callable[..., tuple]
    compute_steps: Callable[[Any], int]
    progress: Callable[[Any], tuple]
    lag: int = 0
    per_statistic_state: tuple[str, ...] = ()
    code_cost: Mapping[bool, CodeCost] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class KernelEntry:
    """A named optimizer.

    Attributes:
      constructor: keyword options -> ``optax.GradientTransformation``.
      partial_statistic: a factory with the constructor's keyword options returning
        ``partial(grads, state, params) -> f32 scalar`` or ``None`` (see the module docstring);
        ``None`` when the optimizer never needs a cross-tensor quantity.
      root_offload: the kernel's root offload seam, or ``None``.
      arg_rules: the value rule of each constructor option (one per option; the registry's
        tests keep the names equal to the signature's).
      tensor_tree_args: the options whose value may be a pytree like the params, i.e. a
        ``{tensor name: value}`` map (see :func:`args_for_tensors`).
      hyperparameters: the options whose number may change between steps without recompiling
        the update (the constructor traces them as values); ``None``: the options whose rule
        admits a schedule (a schedule is evaluated inside the update, so they trace).
      evaluation: ``(state, params) -> params`` the parameters to evaluate a model with, where
        they differ from the trained ones (schedule-free optimizers); ``None``: the same.
    """

    constructor: Callable[..., optax.GradientTransformation]
    partial_statistic: Optional[Callable[..., Optional[Callable]]] = None
    root_offload: Optional[RootOffloadSeam] = None
    arg_rules: ArgRules = ArgRules()
    tensor_tree_args: tuple[str, ...] = ()
    hyperparameters: Optional[tuple[str, ...]] = None
    evaluation: Optional[Callable[[Any, Any], Any]] = None

    def hyperparameter_names(self) -> tuple[str, ...]:
        """See ``hyperparameters``."""
        if self.hyperparameters is not None:
            return self.hyperparameters
        return tuple(sorted(rule.name for rule in self.arg_rules if rule.allow_schedule))
