"""Optimizers by name: the one place that maps a wire-level optimizer spec to a kernel.

A spec is ``{"name": "adafactor_hf", "args": {...}}``. :func:`build_optimizer` resolves the
name, checks every argument against the constructor's signature (names, and the types its
annotations admit), then each given value against the entry's value rules (shape, finiteness,
range: :mod:`optserve.optim_kernels.arg_rules`, declared by each family next to its constructor)
and calls it, so a bad spec fails with a ``ValueError`` that names the optimizer and the option
before any state exists.

An entry (:class:`KernelEntry`) holds the constructor itself and what a server needs beyond the
transformation, each optional:

Cross-shard statistics
----------------------
Some optimizers need one number computed over *all* tensors of a model (T5X's global-norm
clipping, ScaledAdam's clipping to a multiple of the median gradient norm). When a model is
split across shards, each shard computes a *partial* statistic over its own tensors, the
shards sum the partials, and each passes the sum to its update as the extra argument
``global_grad_sq_norm``. An entry that needs this has a factory
``factory(**args) -> partial(grads, state, params) -> scalar``, or ``None`` when these
arguments need no such quantity (e.g. clipping is off). Summing ``partial`` over a partition
of the tensors must give exactly the value the kernel computes in process, and an update
called without ``global_grad_sq_norm`` computes it over its own tree.

Root offload
------------
A kernel whose update computes matrix inverse roots that may instead be computed elsewhere
(by preconditioner workers) declares a :class:`RootOffloadSeam`: everything a server needs to
export its statistics, compute the roots in another process and install them, without knowing
which optimizer it runs. Shampoo has one (inverse roots), and so has SOAP (its eigenbases: the
export carries the bases in use as a second stacked input, and the install re-projects Adam's
first moment into the new ones).

Options given per tensor
------------------------
Some options are a pytree like the params (optax's ``mask``): over the wire, a map from tensor
name to value. A shard holds only part of a session's tensors, so its optimizer is built with the
part of such a map that names its own tensors (:func:`args_for_tensors`); a map that does not
name exactly the session's tensors is refused, naming the ones missing or unknown. An entry lists
these options in ``tensor_tree_args``.
"""

from __future__ import annotations

import collections.abc
import inspect
import numbers
import types
import typing
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence

import jax
import numpy as np
import optax

from optserve.optim_kernels import arg_rules as rules
from optserve.optim_kernels.adam import DECAY_RATES as ADAM_DECAY_RATES
from optserve.optim_kernels.adam import adam, adamw
from optserve.optim_kernels.adafactor import adafactor, adafactor_hf, adafactor_partial_statistic, adafactor_t2t
from optserve.optim_kernels.adafactor.kernel import (
    ADAFACTOR_ARG_RULES,
    ADAFACTOR_HF_ARG_RULES,
    ADAFACTOR_T2T_ARG_RULES,
)
from optserve.optim_kernels.arg_rules import ArgRules
from optserve.optim_kernels.entries import CodeCost, KernelEntry, RootOffloadSeam
from optserve.optim_kernels.delayed_nesterov import DELAYED_NESTEROV_ARG_RULES, delayed_nesterov
from optserve.optim_kernels.hyperparams import (DEFAULT_GROUP, PARAM_GROUPS, build_groups, check_hyperparams,
                                                grouped, grouped_statistic, split_groups, starting_values)
from optserve.optim_kernels.linalg import inverse_pth_roots
from optserve.optim_kernels.muon import muon
from optserve.optim_kernels.muon.config import MUON_ARG_RULES
from optserve.optim_kernels.optax_catalog import OPTAX_PREFIX, optax_entry
from optserve.optim_kernels.scaled_adam import scaled_adam, scaled_adam_partial_statistic
from optserve.optim_kernels.scaled_adam.config import SCALED_ADAM_ARG_RULES
from optserve.optim_kernels.schedules import is_schedule_spec, resolve_schedules
from optserve.optim_kernels.shampoo import seam as shampoo_seam
from optserve.optim_kernels.shampoo import shampoo, shampoo_config
from optserve.optim_kernels.shampoo.config import SHAMPOO_ARG_RULES
from optserve.optim_kernels.soap import compute_bases, soap, soap_config
from optserve.optim_kernels.soap import seam as soap_seam
from optserve.optim_kernels.soap.config import SOAP_ARG_RULES

__all__ = [
    "GLOBAL_STATISTIC_ARG",
    "OPTIMIZERS",
    "BuiltOptimizer",
    "KernelEntry",
    "RootOffloadSeam",
    "args_for_tensors",
    "build_optimizer",
    "optimizer_entry",
    "optimizer_names",
    "optimizer_parameters",
]

GLOBAL_STATISTIC_ARG = "global_grad_sq_norm"


_SHAMPOO_ROOT_OFFLOAD = RootOffloadSeam(
    config=shampoo_config,
    without_inline_roots=shampoo_seam.without_inline_roots,
    block_labels=shampoo_seam.block_labels,
    export=shampoo_seam.export_statistics,
    install=shampoo_seam.install_preconditioners,
    root_config=shampoo_seam.root_config,
    compute_roots=inverse_pth_roots,
    compute_steps=shampoo_seam.compute_steps,
    progress=shampoo_seam.progress,
    per_statistic_state=("preconditioner_info",),
    # `python -m bench.code_size` (a step of 8 one-block tensors and one of 2 tensors of 16 blocks,
    # at the default block of 256), rounded up
    code_cost={False: CodeCost(per_tensor=256 << 10, per_block=384 << 10),
               True: CodeCost(per_tensor=1 << 20, per_block=1088 << 10)},
)

_SOAP_ROOT_OFFLOAD = RootOffloadSeam(
    config=soap_config,
    without_inline_roots=soap_seam.without_inline_bases,
    block_labels=soap_seam.block_labels,
    export=soap_seam.export_bases,
    install=soap_seam.install_bases,
    root_config=soap_seam.basis_config,
    compute_roots=compute_bases,
    compute_steps=soap_seam.compute_steps,
    progress=soap_seam.progress,
    lag=soap_seam.LAG,
    per_statistic_state=("basis_info",),
    code_cost={False: CodeCost(per_tensor=768 << 10, per_block=0), True: CodeCost(per_tensor=2816 << 10, per_block=0)},
)

# Value rules of the optax baselines (their own constructors check none of these): what
# torch.optim.Adam / AdamW / SGD admit under the same names. A learning rate of 0 is admitted (every
# warmup from 0 starts there; the parameters then stay as they are), as are eps = 0 (eps_root may keep
# the denominator away from 0 instead) and an SGD momentum of 1 or more (torch's rule is momentum >= 0).
_ADAM_ARG_RULES = (
    rules.non_negative("learning_rate", schedule=True),
    rules.unit_interval("b1"),
    rules.unit_interval("b2"),
    rules.non_negative("eps"),
    rules.non_negative("eps_root"),
    rules.dtype("mu_dtype", none=True),
    rules.flag("nesterov"),
)
ADAM_ARG_RULES = ArgRules(*_ADAM_ARG_RULES)
ADAMW_ARG_RULES = ArgRules(
    *_ADAM_ARG_RULES,
    rules.non_negative("weight_decay", schedule=True),
    rules.delegated("mask", "None, a pytree of bools like the params ({tensor name: bool}), or a callable "
                            "returning one"),
)
SGD_ARG_RULES = ArgRules(
    rules.non_negative("learning_rate", schedule=True),
    rules.non_negative("momentum", none=True),
    rules.flag("nesterov"),
    rules.dtype("accumulator_dtype", none=True),
)

# Options each constructor takes as traced values (see optim_kernels.hyperparams); an entry that
# declares none has its schedulable options as hyperparameters (passed as constant schedules).
# A momentum coefficient b whose kernel computes ``1 - b`` is one only where the kernel takes it with
# its complement (``_DECAY_RATES``, a hyperparams.Decay): ``1 - b`` of a float32 b rounds differently
# from the same difference of the Python number, which would move every step off the reference.
# SGD's momentum is one as it is (optax.sgd never takes its complement).
_ADAM_HYPERPARAMETERS = ADAM_DECAY_RATES + ("eps", "eps_root", "learning_rate")
_DECAY_RATES: dict[str, tuple[str, ...]] = {"adam": ADAM_DECAY_RATES, "adamw": ADAM_DECAY_RATES}

OPTIMIZERS: dict[str, KernelEntry] = {
    "adafactor": KernelEntry(adafactor, adafactor_partial_statistic, arg_rules=ADAFACTOR_ARG_RULES,
                             hyperparameters=("decay_rate", "epsilon1", "epsilon2", "learning_rate")),
    "adafactor_hf": KernelEntry(adafactor_hf, arg_rules=ADAFACTOR_HF_ARG_RULES, hyperparameters=("decay_rate", "lr")),
    "adafactor_t2t": KernelEntry(adafactor_t2t, arg_rules=ADAFACTOR_T2T_ARG_RULES),
    "shampoo": KernelEntry(shampoo, root_offload=_SHAMPOO_ROOT_OFFLOAD, arg_rules=SHAMPOO_ARG_RULES,
                           hyperparameters=("diagonal_epsilon", "learning_rate")),
    "scaled_adam": KernelEntry(scaled_adam, scaled_adam_partial_statistic, arg_rules=SCALED_ADAM_ARG_RULES),
    "muon": KernelEntry(muon, arg_rules=MUON_ARG_RULES, hyperparameters=(
        "adam_eps_root", "adam_weight_decay", "eps", "learning_rate", "weight_decay")),
    "soap": KernelEntry(soap, root_offload=_SOAP_ROOT_OFFLOAD, arg_rules=SOAP_ARG_RULES,
                        hyperparameters=("eps", "learning_rate")),
    "delayed_nesterov": KernelEntry(delayed_nesterov, arg_rules=DELAYED_NESTEROV_ARG_RULES),
    # Baselines: optax's Adam / AdamW (options, defaults, state) taking b1 / b2 with their complements
    # (optim_kernels.adam), and optax.sgd itself.
    "adam": KernelEntry(adam, arg_rules=ADAM_ARG_RULES, hyperparameters=_ADAM_HYPERPARAMETERS),
    "adamw": KernelEntry(adamw, arg_rules=ADAMW_ARG_RULES, tensor_tree_args=("mask",),
                         hyperparameters=_ADAM_HYPERPARAMETERS + ("weight_decay",)),
    "sgd": KernelEntry(optax.sgd, arg_rules=SGD_ARG_RULES, hyperparameters=("learning_rate", "momentum")),
}


class BuiltOptimizer(NamedTuple):
    """A validated optimizer ready to run.

    Attributes:
      name: the registry name.
      args: the keyword arguments it was built with (after validation; schedules as their specs,
        so ``args`` stays plain JSON; ``param_groups`` included).
      transformation: the optax transformation; its ``update`` also takes ``hyperparams=``
        (:data:`~optserve.optim_kernels.hyperparams.HyperValues`, None: the values given).
      partial_statistic: ``partial(grads, state, params) -> scalar`` whose sum over shards is
        passed to ``transformation.update`` as ``global_grad_sq_norm``; ``None`` if unused.
      root_offload: the kernel's root offload seam, or ``None``.
      groups: the parameter groups (:class:`~optserve.optim_kernels.hyperparams.Group`; the
        default group first).
      evaluation: ``(state, params) -> params`` to evaluate a model with (schedule-free
        optimizers), or ``None`` (the trained parameters are the ones to evaluate).
    """

    name: str
    args: dict[str, Any]
    transformation: optax.GradientTransformation
    partial_statistic: Optional[Callable]
    root_offload: Optional[RootOffloadSeam]
    groups: tuple = ()
    evaluation: Optional[Callable] = None

    @property
    def hyperparams(self) -> dict:
        """``{group label: {option: float}}``: the values a step starts with: the hyperparameters as
        given (each can be set), and beside each decay rate ``b`` its complement under ``"1-b"``
        (see :class:`~optserve.optim_kernels.hyperparams.Decay`)."""
        return starting_values(self.groups)

    def checked_hyperparams(self, values: Mapping[str, Any], group: Optional[str] = None) -> dict:
        """``values`` (``{option: number}``) for ``group`` (a label; None: every group that has
        the option) as ``{label: {option: float}}``, each value checked against its option's rule
        (a decay rate ``b`` joined by its complement ``"1-b"``, computed in double precision).

        Raises:
          ValueError: an unknown group, an option that is no hyperparameter of this optimizer (or
            follows a schedule), or a value that breaks the option's rule; the message names them.
        """
        return check_hyperparams(self.name, _entry(self.name), self.groups, values, group)


def optimizer_names() -> list[str]:
    return sorted(OPTIMIZERS)


def optimizer_parameters(name: str) -> Mapping[str, inspect.Parameter]:
    """The constructor's parameters, for validation and documentation."""
    return inspect.signature(_entry(name).constructor).parameters


def build_optimizer(name: str, args: Optional[Mapping[str, Any]] = None) -> BuiltOptimizer:
    """Validates ``args`` against the constructor of ``name`` and builds the optimizer.

    Raises:
      ValueError: unknown optimizer, unknown or missing argument, a schedule spec that names no
        schedule or a keyword it does not take (see :mod:`~optserve.optim_kernels.schedules`), a
        value of a type the option does not admit, a value that breaks the option's rule (an
        :class:`~optserve.optim_kernels.arg_rules.ArgumentRuleError` naming the optimizer, the
        option, the value and the rule), or a value the constructor rejects; the message names
        the optimizer and the option.
    """
    args = dict(args or {})
    entry = _entry(name)
    base, overrides = split_groups(name, entry, args)
    if overrides and entry.root_offload is not None:
        raise ValueError(f"optimizer {name!r}: {PARAM_GROUPS!r} are not served for optimizers whose matrix roots "
                         f"may run on preconditioner workers; give one set of options")

    def check(label: str, group_args: Mapping[str, Any]) -> dict:
        if label == DEFAULT_GROUP:
            return _checked_values(name, entry, group_args)
        try:
            return _checked_values(name, entry, group_args)
        except ValueError as exc:
            raise ValueError(f"{PARAM_GROUPS}[{label}]: {exc}") from None

    groups = tuple(build_groups(name, entry, base, overrides, check, _DECAY_RATES.get(name, ())))
    transformation, evaluation = grouped(entry.constructor, groups, entry.evaluation)
    try:  # one statistic over all tensors, if any group's options need it (each group's kernel reads it)
        partials = [entry.partial_statistic(**g.values) for g in groups] if entry.partial_statistic is not None else []
    except (TypeError, ValueError) as exc:
        raise ValueError(f"optimizer {name!r}: {exc}") from exc
    partial = next((p for p in partials if p is not None), None)
    return BuiltOptimizer(name, args, transformation, grouped_statistic(partial, groups), entry.root_offload,
                          groups, evaluation)


def _checked_values(name: str, entry: KernelEntry, args: Mapping[str, Any]) -> dict:
    """``args`` checked against the constructor of ``name`` (names, types, rules; the constructor
    is called once), with schedule specs resolved."""
    constructor = entry.constructor
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
    _check_schedulable(name, entry, args)
    values = resolve_schedules(name, args)  # schedule specs -> optax schedules
    _check_value_types(name, constructor, values)
    entry.arg_rules.check(name, values)
    try:
        constructor(**values)
    except ValueError as exc:
        raise ValueError(f"optimizer {name!r}: {exc}") from exc
    except TypeError as exc:
        raise ValueError(f"optimizer {name!r}: bad option value: {exc}") from exc
    return values


def args_for_tensors(name: str, args: Mapping[str, Any], session_tensors: Sequence[str],
                     tensors: Sequence[str]) -> dict[str, Any]:
    """``args`` of optimizer ``name`` for the part of a session that holds ``tensors``.

    Each option of the entry's ``tensor_tree_args`` given as a map (``{tensor name: value}``, a
    pytree like the session's params ``{name: array}``) must name exactly ``session_tensors``;
    it is restricted to ``tensors`` (a shard's). Other values (None, a bool, a callable) and other
    options are kept as they are.

    Raises:
      ValueError: such a map names a tensor the session does not have, or lacks one it has (the
        message names the optimizer, the option and the tensors).
    """
    args = dict(args)
    for option in _entry(name).tensor_tree_args:
        value = args.get(option)
        if not isinstance(value, Mapping):
            continue
        keys = set(value)
        unknown = sorted(map(str, keys - set(session_tensors)))
        missing = sorted(set(session_tensors) - keys)
        if unknown or missing:
            problems = []
            if unknown:
                problems.append(f"names {_few(unknown)} that the session does not have")
            if missing:
                problems.append(f"lacks {_few(missing)}")
            raise ValueError(f"optimizer {name!r}: option {option!r} must map each of the session's tensors "
                             f"(and no other name) to a value, but it {' and '.join(problems)}")
        args[option] = {tensor: value[tensor] for tensor in tensors}
    return args


def _few(names: Sequence[str], limit: int = 5) -> str:
    """``'a', 'b'`` (``'a', ..., 'e' and N more`` past ``limit`` names)."""
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


def optimizer_entry(name: str) -> KernelEntry:
    """The registry entry of ``name`` (a built-in name or ``optax.NAME`` / ``optax.contrib.NAME``).

    Raises:
      ValueError: no such optimizer (the message lists the known ones).
    """
    return _entry(name)


def _entry(name: str) -> KernelEntry:
    if name.startswith(OPTAX_PREFIX):
        return optax_entry(name)
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; known optimizers: {optimizer_names()}") from None


# ------------------------------------------------------------------ value types from annotations
#
# Specs come from JSON, so the values to check are numbers, strings, bools, None, lists and
# dicts. An option's annotation is reduced to the kinds of value it admits; anything the check
# cannot interpret (a custom class, an array type, ``Any``) admits everything and is left to the
# constructor.

_ANY = frozenset({"any"})


def _check_schedulable(name: str, entry: KernelEntry, args: Mapping[str, Any]) -> None:
    """A schedule spec is given only for an option whose rule admits a schedule."""
    schedulable = sorted(rule.name for rule in entry.arg_rules if rule.allow_schedule)
    for option, value in args.items():
        if is_schedule_spec(value) and option in entry.arg_rules.names and option not in schedulable:
            raise ValueError(f"optimizer {name!r}: option {option!r} takes no schedule; its options that do: "
                             f"{schedulable}")


def _check_value_types(name: str, constructor: Callable, args: Mapping[str, Any]) -> None:
    for option, value in args.items():
        kinds = _admitted_kinds(_type_hint(constructor, option))
        if not _admits(kinds, value):
            raise ValueError(
                f"optimizer {name!r}: option {option!r} must be {_describe(kinds)}, got {value!r}")


def _type_hint(fn: Callable, option: str):
    """The resolved annotation of one parameter (``Any`` when absent or unresolvable).

    One at a time, so that an annotation that does not resolve (a name only imported for type
    checkers) leaves the other options checked.
    """
    target = inspect.unwrap(fn)
    annotation = getattr(target, "__annotations__", {}).get(option)
    if annotation is None:
        return Any
    probe = types.FunctionType(_probe.__code__, getattr(target, "__globals__", {}))
    probe.__annotations__ = {"x": annotation}
    try:
        return typing.get_type_hints(probe)["x"]
    except Exception:  # noqa: BLE001 -- any failure to resolve means "not checked"
        return Any


def _probe(x):
    del x


def _admitted_kinds(hint) -> frozenset:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        kinds = frozenset()
        for arg in typing.get_args(hint):
            kinds |= _admitted_kinds(arg)
        return kinds
    if hint is type(None):
        return frozenset({"none"})
    if hint is bool:
        return frozenset({"bool"})
    if hint is int:
        return frozenset({"int"})
    if hint in (float, complex):
        return frozenset({"number"})
    if hint is str:
        return frozenset({"str"})
    if origin is typing.Literal:
        return frozenset({"str"}) if all(isinstance(a, str) for a in typing.get_args(hint)) else _ANY
    if hint is collections.abc.Callable or origin is collections.abc.Callable:
        return frozenset({"callable"})
    if origin in (tuple, list, collections.abc.Sequence) or hint in (tuple, list, collections.abc.Sequence):
        return frozenset({"sequence"})
    if origin in (dict, collections.abc.Mapping) or hint in (dict, collections.abc.Mapping):
        return frozenset({"mapping"})
    if hint is jax.Array or (isinstance(hint, type) and issubclass(hint, (np.ndarray, np.number, np.bool_))):
        return frozenset({"number", "array"})
    return _ANY


def _admits(kinds: frozenset, value) -> bool:
    if "any" in kinds:
        return True
    if value is None:
        return "none" in kinds
    if isinstance(value, bool):
        return bool(kinds & {"bool", "int", "number"})
    if isinstance(value, numbers.Integral):
        return bool(kinds & {"int", "number", "bool"})
    if isinstance(value, numbers.Real):
        return "number" in kinds or ("int" in kinds and float(value).is_integer())
    if isinstance(value, str):
        return "str" in kinds
    if isinstance(value, Mapping):
        return "mapping" in kinds
    if isinstance(value, (list, tuple)):
        return bool(kinds & {"sequence", "array"})
    if callable(value):
        return "callable" in kinds
    return True


_KIND_WORDS = {"none": "None", "bool": "a bool", "int": "an integer", "number": "a number", "str": "a string",
               "array": "an array", "callable": "a schedule (callable)", "sequence": "a list",
               "mapping": "a mapping"}


def _describe(kinds: frozenset) -> str:
    return " or ".join(_KIND_WORDS[k] for k in sorted(kinds, key=list(_KIND_WORDS).index))
