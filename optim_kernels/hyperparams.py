"""Hyperparameters that change between steps without recompiling, and parameter groups.

Hyperparameters
---------------
An optimizer's *hyperparameters* are its options that may take a new number between two steps:
the entry's declared ``hyperparameters`` (options its constructor accepts as traced values) and
every option whose rule admits a schedule. Given as plain numbers, they reach the update as
float32 scalars, an argument of the jitted step (:class:`HyperValues`), so changing one reuses the
compiled step. A hyperparameter given as a schedule spec follows its schedule and is not a value
(it cannot be set). How each reaches the constructor:

- declared options: the traced value itself (the optimizer state keeps its structure);
- declared *decay rates* (:class:`Decay`): the traced rate together with its traced complement;
- other schedulable options: a constant schedule returning the traced value.

Decay rates
-----------
A kernel computing ``(1 - b) * g + b * m`` from a decay rate ``b`` (Adam's ``b1``, ``b2``) cannot
take ``b`` alone as a float32 value: ``1 - float32(b)`` is not ``float32(1 - b)`` (for ``b2 =
0.999``: 9.99987e-4 against 1.0e-3, a relative 1.3e-5), and the second is what the kernel computes
from a Python number, so every step would move off the reference. A decay rate declared by the
registry therefore reaches the step as two values, ``b`` and its complement ``1 - b`` computed in
double precision where the value is set (:func:`starting_values`, :func:`check_hyperparams`) and
rounded to float32 once, carried in :class:`HyperValues` under :func:`complement_key` (``"1-b1"``)
beside ``b``; the constructor receives a :class:`Decay`. An unchanged rate thus runs the very
numbers a constant ``b`` gives, and a changed one the float32 of the exact difference, as
``torch.optim`` computes it. The complement is no option of its own (it cannot be set; setting
``b`` sets both, and a change's record lists both).

Parameter groups
----------------
``args["param_groups"]`` (:data:`PARAM_GROUPS`) is an optional list of groups
``{"tensors": [tensor names], option: value, ...}``: each group's tensors run the optimizer with
the session's options overridden by the group's (any option but per-tensor maps like ``mask``;
numbers, or schedule specs where the rule admits them). Tensors named by no group form the group
:data:`DEFAULT_GROUP` with the session's own options. Groups are labelled ``"default"``, ``"0"``,
``"1"``, ... (their index in the list). Each group keeps its own optimizer state (``{label:
state}``); without groups the state is the optimizer's own (no wrapper).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence

import jax
import numpy as np
import optax

from optserve.optim_kernels.entries import KernelEntry
from optserve.optim_kernels.schedules import is_schedule_spec

PARAM_GROUPS = "param_groups"
GROUP_TENSORS = "tensors"
DEFAULT_GROUP = "default"
_FLOAT32_MAX = float(np.finfo(np.float32).max)  # a step runs its hyperparameters in float32

HyperValues = dict  # {group label: {option: float32 scalar}}: the hyperparameters a step runs with
_COMPLEMENT = "1-"


def complement_key(option: str) -> str:
    """The key of decay rate ``option``'s complement in :data:`HyperValues` (``"1-b1"``)."""
    return _COMPLEMENT + option


class Decay(NamedTuple):
    """A decay rate as a step runs it: ``rate`` (b) and ``complement`` (1 - b), each a number or a
    traced float32 scalar. The complement is computed where the rate is set, in double precision
    (see the module docstring), never inside the step."""

    rate: Any
    complement: Any

    @classmethod
    def of(cls, value: Any) -> "Decay":
        """``value`` itself if it is a :class:`Decay`, else ``Decay(value, 1 - value)`` (for a Python
        number, the difference in double precision)."""
        return value if isinstance(value, Decay) else cls(value, 1 - value)


@dataclasses.dataclass(frozen=True)
class Group:
    """One parameter group of a built optimizer.

    Attributes:
      label: :data:`DEFAULT_GROUP` or the group's index as a string.
      tensors: the tensor names given for it (None: the default group, every tensor in no group).
      values: its constructor options, schedules resolved, hyperparameters as given.
      hyper: ``{option: float}``: its hyperparameters given as numbers (their starting values).
      by_value: the hyperparameters passed to the constructor as traced values (the others as
        constant schedules).
      decays: those of ``by_value`` that are decay rates, passed as a :class:`Decay` (the rate and
        its complement ``1 - rate`` from :data:`HyperValues`).
    """

    label: str
    tensors: Optional[frozenset]
    values: dict
    hyper: dict
    by_value: frozenset
    decays: frozenset = frozenset()

    def members(self, names: Sequence[str], grouped: frozenset) -> list[str]:
        """Which of ``names`` belong to this group (``grouped``: the names some group lists)."""
        if self.tensors is None:
            return [n for n in names if n not in grouped]
        return [n for n in names if n in self.tensors]

    def constructor_args(self, hyper: Optional[Mapping[str, Any]] = None) -> dict:
        """The constructor's options with the hyperparameters ``hyper`` (traced values inside a
        step; None: the starting values), each passed as the constructor takes it."""
        hyper = hyper or {}
        args = dict(self.values)
        for option, start in self.hyper.items():
            value = hyper.get(option, start)
            if option in self.decays:
                complement = hyper.get(complement_key(option))
                args[option] = Decay.of(value) if complement is None else Decay(value, complement)
            else:
                args[option] = value if option in self.by_value else _constant(value)
        return args

    def step_values(self, hyper: Mapping[str, float]) -> dict:
        """``hyper`` (``{option: number}``, options of this group) as a step runs them: each
        decay rate joined by its complement ``1 - rate`` (computed here, in double precision)."""
        values = {option: float(value) for option, value in hyper.items()}
        for option in sorted(self.decays & set(values)):
            values[complement_key(option)] = 1.0 - values[option]
        return values


def _constant(value):
    return lambda count: value


def hyperparameter_options(entry: KernelEntry) -> frozenset:
    """Every option of ``entry`` that may be a hyperparameter (declared or schedulable)."""
    schedulable = {rule.name for rule in entry.arg_rules if rule.allow_schedule}
    return frozenset(entry.hyperparameter_names()) | schedulable


def split_groups(name: str, entry: KernelEntry, args: Mapping[str, Any]) -> tuple[dict, list[dict]]:
    """``(args without param_groups, [group overrides])``, each override ``{"tensors": [...], ...}``.

    Raises:
      ValueError: ``param_groups`` is not a list of maps each naming its tensors (a non-empty list
        of strings, no tensor in two groups), or a group sets an option the optimizer does not
        have or a per-tensor option; the message names the optimizer, the group and the option.
    """
    args = dict(args)
    raw = args.pop(PARAM_GROUPS, None)
    if raw is None:
        return args, []
    where = f"optimizer {name!r}: {PARAM_GROUPS!r}"
    if not isinstance(raw, (list, tuple)) or not raw:
        raise ValueError(f"{where} must be a non-empty list of groups {{'tensors': [names], option: value}}, "
                         f"got {raw!r}")
    seen: dict[str, int] = {}
    groups = []
    for index, group in enumerate(raw):
        if not isinstance(group, Mapping):
            raise ValueError(f"{where}[{index}] must be a map {{'tensors': [names], option: value}}, got {group!r}")
        tensors = group.get(GROUP_TENSORS)
        if not isinstance(tensors, (list, tuple)) or not tensors or not all(isinstance(t, str) for t in tensors):
            raise ValueError(f"{where}[{index}]: 'tensors' must be a non-empty list of tensor names, got {tensors!r}")
        for tensor in tensors:
            if tensor in seen:
                raise ValueError(f"{where}[{index}]: tensor {tensor!r} is already in group {seen[tensor]}")
            seen[tensor] = index
        for option in group:
            if option == GROUP_TENSORS:
                continue
            if option in entry.tensor_tree_args:
                raise ValueError(f"{where}[{index}]: option {option!r} is given per tensor for the whole session, "
                                 f"not per group")
            if option == PARAM_GROUPS:
                raise ValueError(f"{where}[{index}]: groups do not nest")
        groups.append(dict(group))
    return args, groups


def check_group_tensors(name: str, args: Mapping[str, Any], session_tensors: Sequence[str]) -> None:
    """Every tensor ``param_groups`` names is one of the session's.

    Raises:
      ValueError: naming the optimizer, the group and the unknown tensors.
    """
    known = set(session_tensors)
    for index, group in enumerate(args.get(PARAM_GROUPS) or ()):
        unknown = sorted(set(group.get(GROUP_TENSORS, ())) - known) if isinstance(group, Mapping) else []
        if unknown:
            raise ValueError(f"optimizer {name!r}: {PARAM_GROUPS!r}[{index}] names tensors the session does not "
                             f"have: {unknown[:5]}")


def build_groups(name: str, entry: KernelEntry, base: Mapping[str, Any], overrides: Sequence[Mapping[str, Any]],
                 check: Callable[[str, Mapping[str, Any]], dict], decays: Sequence[str] = ()) -> list[Group]:
    """The groups of an optimizer: the default one, then one per override.

    ``check(where, args) -> values``: validates a group's full options and returns them with
    schedules resolved (the registry's checks; raises ``ValueError``). ``decays``: the declared
    hyperparameters that are decay rates (passed as a :class:`Decay`).
    """
    names = hyperparameter_options(entry)
    declared = frozenset(entry.hyperparameters or ())  # the others reach the constructor as constant schedules
    if not set(decays) <= declared:
        raise ValueError(f"optimizer {name!r}: decay rates {sorted(set(decays) - declared)} are not among its "
                         f"declared hyperparameters")
    defaults = {option: p.default for option, p in inspect.signature(entry.constructor).parameters.items()
                if p.default is not p.empty}
    groups = []
    for label, given in [(DEFAULT_GROUP, None)] + [(str(i), o) for i, o in enumerate(overrides)]:
        args = dict(base)
        if given is not None:
            args.update({k: v for k, v in given.items() if k != GROUP_TENSORS})
        values = check(label, args)
        full = {**defaults, **values}
        hyper = {option: float(full[option]) for option in sorted(names & set(full))
                 if _is_number(full[option]) and not is_schedule_spec(args.get(option))}
        tensors = None if given is None else frozenset(given[GROUP_TENSORS])
        groups.append(Group(label, tensors, values, hyper, declared, frozenset(decays) & set(hyper)))
    return groups


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)) and math.isfinite(value)


def check_hyperparams(name: str, entry: KernelEntry, groups: Sequence[Group], values: Mapping[str, Any],
                      group: Optional[str] = None) -> dict:
    """See :meth:`~optserve.optim_kernels.registry.BuiltOptimizer.checked_hyperparams`."""
    labels = [g.label for g in groups]
    if group is not None and group not in labels:
        raise ValueError(f"optimizer {name!r} has no parameter group {group!r}; its groups are {labels}")
    if not values:
        raise ValueError(f"optimizer {name!r}: no hyperparameter given; those that can be set: "
                         f"{sorted(set().union(*(g.hyper for g in groups)))}")
    rules = {rule.name: rule for rule in entry.arg_rules}
    chosen = [g for g in groups if group is None or g.label == group]
    out: dict = {}
    for option, value in values.items():
        holders = [g for g in chosen if option in g.hyper]
        if not holders:
            settable = sorted(set().union(*(g.hyper for g in chosen)))
            scheduled = option in hyperparameter_options(entry) and option in set().union(*(g.values for g in chosen))
            why = "follows a schedule" if scheduled else "is not a hyperparameter that can be set"
            raise ValueError(f"optimizer {name!r}: option {option!r} {why}"
                             f"{'' if group is None else f' in group {group!r}'}; those that can be set: {settable}")
        if not _is_number(value) or abs(value) > _FLOAT32_MAX:
            raise ValueError(f"optimizer {name!r}: hyperparameter {option!r} must be one number that is finite in "
                             f"float32 (the step's precision), got {value!r}")
        rule = rules.get(option)
        error = rule.error(name, float(value)) if rule is not None else None
        if error is not None:
            raise error
        for holder in holders:
            out.setdefault(holder.label, {}).update(holder.step_values({option: value}))
    return out


def values_at(groups: Sequence[Group], hyper: Mapping[str, Mapping[str, float]], count: int) -> list[tuple]:
    """``[(group, option, value, scheduled)]``: the hyperparameters a step at optimizer count
    ``count`` runs with: ``hyper``'s values, and each hyperparameter option given as a schedule
    evaluated at ``count``."""
    rows = []
    for group in groups:
        for option, value in sorted(hyper.get(group.label, group.hyper).items()):
            if option in group.hyper:  # a decay rate's complement is no option of its own
                rows.append((group.label, option, float(value), False))
        for option, value in sorted(group.values.items()):
            if callable(value) and option not in group.hyper:
                try:
                    rows.append((group.label, option, float(value(count)), True))
                except (TypeError, ValueError):  # a callable that is no schedule of the step count
                    continue
    return rows


def starting_values(groups: Sequence[Group]) -> HyperValues:
    """The groups' hyperparameters as given: ``{label: {option: float}}``, each decay rate joined by
    its complement (Python numbers: a jitted step traces them as weakly typed float32, so a
    bfloat16 model's updates stay bfloat16)."""
    return {g.label: dict(sorted(g.step_values(g.hyper).items())) for g in groups}


def grouped(constructor: Callable[..., optax.GradientTransformation], groups: Sequence[Group],
            evaluation: Optional[Callable] = None) -> tuple[optax.GradientTransformationExtraArgs, Optional[Callable]]:
    """The transformation running each group's optimizer on its tensors, and its evaluation.

    Its ``update(updates, state, params, *, hyperparams=None, **extra)`` takes the step's
    :data:`HyperValues` (None: the starting values) and passes ``extra`` (a cross-shard statistic)
    to every group. Params are dicts ``{tensor name: array}``. With only the default group (no
    ``param_groups``), the state is the optimizer's own.

    ``evaluation``: the entry's ``(state, params) -> params`` or None; returned per group.
    """
    by_label = {g.label: g for g in groups}
    listed = frozenset().union(*(g.tensors for g in groups if g.tensors is not None))
    single = len(groups) == 1

    def tx_for(group: Group, hyper: Optional[HyperValues]):
        return constructor(**group.constructor_args(None if hyper is None else hyper.get(group.label)))

    def parts(tree: Mapping[str, Any]) -> list[tuple[Group, list[str]]]:
        names = sorted(tree)
        return [(g, members) for g in groups if (members := g.members(names, listed))]

    def init(params):
        if single:
            return tx_for(groups[0], None).init(params)
        return {g.label: tx_for(g, None).init(_subset(params, members)) for g, members in parts(params)}

    def update(updates, state, params=None, *, hyperparams: Optional[HyperValues] = None, **extra):
        if single:
            return tx_for(groups[0], hyperparams).update(updates, state, params, **extra)
        out, new_state = {}, {}
        for label, group_state in state.items():
            group = by_label[label]
            members = group.members(sorted(updates), listed)
            sub_params = None if params is None else _subset(params, members)
            group_updates, new_state[label] = tx_for(group, hyperparams).update(
                _subset(updates, members), group_state, sub_params, **extra)
            out.update(group_updates)
        return {name: out[name] for name in updates}, new_state

    def evaluate(state, params):
        if single:
            return evaluation(state, params)
        out = dict(params)
        for label, group_state in state.items():
            members = by_label[label].members(sorted(params), listed)
            out.update(evaluation(group_state, _subset(params, members)))
        return out

    return optax.GradientTransformationExtraArgs(init, update), evaluate if evaluation is not None else None


def grouped_statistic(partial: Optional[Callable], groups: Sequence[Group]) -> Optional[Callable]:
    """A cross-shard partial statistic over grouped state: the sum of each group's part."""
    if partial is None or len(groups) == 1:
        return partial
    by_label = {g.label: g for g in groups}
    listed = frozenset().union(*(g.tensors for g in groups if g.tensors is not None))

    def total(grads, state, params):
        parts = []
        for label, group_state in state.items():
            members = by_label[label].members(sorted(grads), listed)
            parts.append(partial(_subset(grads, members), group_state, _subset(params, members)))
        return jax.numpy.sum(jax.numpy.stack(parts))

    return total


def _subset(tree: Mapping[str, Any], names: Sequence[str]) -> dict:
    return {name: tree[name] for name in names}
