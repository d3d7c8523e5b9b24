"""Any optax optimizer by name: ``{"name": "optax.lion", "args": {...}}`` builds ``optax.lion(**args)``,
``"optax.contrib.NAME"`` builds ``optax.contrib.NAME(**args)``.

What is served (:data:`OPTAX_OPTIMIZERS`, listed explicitly): the optimizer constructors of optax and
optax.contrib whose required options are numbers or schedules, whose update takes only
``(grads, state, params)``, and whose update of each tensor depends on that tensor alone (a sharded
session runs one optimizer per shard, over that shard's tensors). Everything else under ``optax.`` is
refused with a ``ValueError`` naming it and listing what is served: transforms and combinators
(``optax.chain``, ``optax.scale``, ``optax.apply_updates``), wrappers of another transformation
(``optax.contrib.schedule_free``, ``optax.lookahead``), and the optimizers of :data:`_WHY_NOT_SERVED`.

Each entry (:func:`optax_entry`, cached) derives from the constructor's signature:

* ``arg_rules``: a bool option is a flag; an option named ``*dtype*`` a float dtype (``None`` where
  that is the default); a ``Literal`` of names a choice; a numeric option one finite number (an
  integer where the default is an int: step counts, sizes), ``None`` where that is the default, and a
  schedule spec where optax annotates it as a schedule (``ScalarOrSchedule``: ``learning_rate`` of
  most); ``mask`` / ``*_mask`` a pytree like the params (also in ``tensor_tree_args``); anything
  else is left to optax (``delegated``). Ranges are optax's to check.
* ``hyperparameters``: the float options (default a float, or a required number) that may change
  between steps without recompiling, found by tracing (:func:`_traced_options`).
* ``evaluation``: for the schedule-free optimizers, ``(state, params) -> params`` to evaluate a
  model with (``optax.contrib.schedule_free_eval_params``); ``None`` for the others.
"""

from __future__ import annotations

import collections.abc
import functools
import inspect
import numbers
import re
import types
import typing
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib

from optserve.optim_kernels import arg_rules as rules
from optserve.optim_kernels.arg_rules import ArgRule, ArgRules, RuleKind
from optserve.optim_kernels.entries import KernelEntry

__all__ = ["OPTAX_OPTIMIZERS", "OPTAX_PREFIX", "optax_entry", "optax_optimizer_names"]

OPTAX_PREFIX = "optax."

OPTAX_OPTIMIZERS: tuple[str, ...] = tuple(OPTAX_PREFIX + name for name in (
    "adabelief", "adadelta", "adafactor", "adagrad", "adam", "adamax", "adamaxw", "adamw", "adan", "amsgrad",
    "fromage", "lamb", "lars", "lion", "novograd", "optimistic_adam", "optimistic_adam_v2",
    "optimistic_gradient_descent", "radam", "rmsprop", "rprop", "sgd", "sign_sgd", "signum", "sm3", "yogi",
    "contrib.acprop", "contrib.ademamix", "contrib.adopt", "contrib.cocob", "contrib.galore", "contrib.madgrad",
    "contrib.muon", "contrib.schedule_free_adamw", "contrib.schedule_free_sgd", "contrib.simplified_ademamix",
))

_ACROSS_TENSORS = "its step size estimate sums over all tensors, which each shard of a session would take over its own"
_NEEDS_LOSS = "its update needs the loss (and its function), which a session does not send"
# Optimizers of optax that are not served, and why (other refused names are not optimizers).
_WHY_NOT_SERVED: dict[str, str] = {
    "optax.contrib.prodigy": _ACROSS_TENSORS,
    "optax.contrib.dadapt_adamw": _ACROSS_TENSORS,
    "optax.noisy_sgd": "its noise is drawn per tensor position, so the shards of a session would draw the same noise",
    "optax.contrib.dpsgd": "it needs per-example gradients",
    "optax.lbfgs": _NEEDS_LOSS,
    "optax.polyak_sgd": _NEEDS_LOSS,
    "optax.contrib.momo": _NEEDS_LOSS,
    "optax.contrib.momo_adam": _NEEDS_LOSS,
    "optax.contrib.sophia": _NEEDS_LOSS,
    "optax.contrib.schedule_free": "it wraps another transformation; use optax.contrib.schedule_free_adamw or "
                                   "optax.contrib.schedule_free_sgd",
}

_SCHEDULE_FREE = frozenset({"optax.contrib.schedule_free_adamw", "optax.contrib.schedule_free_sgd"})
_MASK_NOTE = "None, a pytree of bools like the params ({tensor name: bool}), or a callable returning one"
_PROBE_SHAPES = {"w": (4, 3), "b": (3,)}  # the params the hyperparameters are traced with
# Averaging coefficients (b1, b2, b3, beta, decay, rho) and exponents (weight_lr_power) are no
# hyperparameters: the update computes ``1 - b`` or ``x ** p``, which for a float32 value rounds
# differently from the Python number's (folded at compile time), so every step would move off optax
# run with the numbers (as the registry's own entries leave them out too).
_AVERAGING_COEFFICIENT = re.compile(r"^(b\d|beta\d?|decay|rho|\w*power)$")
_PROBE_NUMBER = 1e-3  # a required number while the others are traced (every required option is a learning rate)


def optax_optimizer_names() -> list[str]:
    """The optax optimizers served, sorted (``optax.NAME`` and ``optax.contrib.NAME``)."""
    return sorted(OPTAX_OPTIMIZERS)


@functools.cache
def optax_entry(name: str) -> KernelEntry:
    """The registry entry of ``name`` (``"optax.NAME"`` / ``"optax.contrib.NAME"``).

    Raises:
      ValueError: ``name`` is not served (optax has no such name, it is not an optimizer, or it is one
        of :data:`_WHY_NOT_SERVED`); the message names it, says why and lists the served names.
    """
    if name not in OPTAX_OPTIMIZERS:
        why = _WHY_NOT_SERVED.get(name) or (
            "optax has no such name" if _lookup(name) is None else "it is not an optimizer constructor")
        raise ValueError(f"unknown optimizer {name!r}: {why}; the optax optimizers served are "
                         f"{optax_optimizer_names()}")
    optimizer = _lookup(name)
    arg_rules = ArgRules(*(_rule(option, parameter) for option, parameter in _parameters(optimizer).items()))
    return KernelEntry(
        _refusing_bad_values(optimizer),
        arg_rules=arg_rules,
        tensor_tree_args=tuple(rule.name for rule in arg_rules if _is_mask(rule.name)),
        hyperparameters=_traced_options(optimizer, arg_rules),
        evaluation=optax.contrib.schedule_free_eval_params if name in _SCHEDULE_FREE else None,
    )


def _lookup(name: str) -> Optional[Callable]:
    """``optax.NAME`` or ``optax.contrib.NAME`` itself (None: no such public function)."""
    parts = name[len(OPTAX_PREFIX):].split(".") if name.startswith(OPTAX_PREFIX) else []
    if len(parts) == 2 and parts[0] == "contrib":
        module, parts = optax.contrib, parts[1:]
    else:
        module = optax
    if len(parts) != 1 or parts[0].startswith("_"):
        return None
    value = getattr(module, parts[0], None)
    return value if inspect.isfunction(value) else None


def _refusing_bad_values(optimizer: Callable) -> Callable[..., optax.GradientTransformation]:
    """``optimizer`` (same signature), refusing with a ``ValueError`` a value for an option that takes
    a transformation (only its default, None, can be sent) and any error of optax's own on a value
    (a mapping given for a tuple, say, that optax reads with an ``AttributeError``)."""
    unsendable = {name for name, p in _parameters(optimizer).items() if _takes_transformation(p.annotation)}

    @functools.wraps(optimizer)
    def constructor(**options):
        for name in sorted(unsendable):
            if options.get(name) is not None:
                raise ValueError(f"option {name!r} takes a transformation, which cannot be sent; leave it out")
        try:
            return optimizer(**options)
        except (ValueError, TypeError):
            raise
        except Exception as exc:  # noqa: BLE001 -- whatever optax raises on a value is a bad value
            raise ValueError(f"bad option value: {type(exc).__name__}: {exc}") from exc

    return constructor


# ---------------------------------------------------------------------------------------- rules


def _parameters(optimizer: Callable) -> dict[str, inspect.Parameter]:
    """The keyword options of ``optimizer``, with annotations resolved where they can be."""
    try:
        signature = inspect.signature(optimizer, eval_str=True)
    except Exception:  # noqa: BLE001 -- an unresolvable annotation: keep them as written
        signature = inspect.signature(optimizer)
    return {name: p for name, p in signature.parameters.items()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def _kinds(annotation: Any) -> frozenset[str]:
    """What an annotation admits: ``float`` (any real or array), ``int``, ``bool``, ``none``,
    ``callable`` (a schedule), ``other`` (anything else, or no annotation)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return frozenset().union(*(_kinds(a) for a in typing.get_args(annotation)))
    if annotation is type(None):
        return frozenset({"none"})
    if annotation in (bool, np.bool_):
        return frozenset({"bool"})
    if annotation is int:
        return frozenset({"int"})
    if annotation in (float, complex, jax.Array) or (
            isinstance(annotation, type) and issubclass(annotation, (np.ndarray, np.number))):
        return frozenset({"float"})
    if annotation in (Callable, collections.abc.Callable) or typing.get_origin(annotation) is collections.abc.Callable:
        return frozenset({"callable"})
    return frozenset({"other"})


def _takes_transformation(annotation: Any) -> bool:
    members = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) \
        else (annotation,)
    return any(isinstance(m, type) and issubclass(m, optax.GradientTransformation) for m in members)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_mask(option: str) -> bool:
    return option == "mask" or option.endswith("_mask")


def _rule(option: str, parameter: inspect.Parameter) -> ArgRule:
    """The value rule of one option (see the module docstring)."""
    default, annotation = parameter.default, parameter.annotation
    kinds = _kinds(annotation) if annotation is not parameter.empty else frozenset({"other"})
    optional = default is None
    if _is_mask(option):
        return rules.delegated(option, _MASK_NOTE)
    if _takes_transformation(annotation):
        return rules.delegated(option, "None only (a transformation cannot be sent)")
    if isinstance(default, bool) or kinds == {"bool"}:
        return rules.flag(option)
    if "dtype" in option:
        return rules.dtype(option, none=optional)
    literal = typing.get_args(annotation) if typing.get_origin(annotation) is typing.Literal else ()
    if literal and all(isinstance(choice, str) for choice in literal):
        return rules.choice(option, *literal)
    numeric = bool(kinds & {"float", "int"}) and "other" not in kinds
    if numeric or (kinds == {"other"} and _is_number(default)):
        if (_is_number(default) and isinstance(default, numbers.Integral)) or kinds - {"none"} == {"int"}:
            return rules.integer(option, low=None, none=optional)
        return rules.real(option, none=optional, schedule="callable" in kinds)
    return rules.delegated(option, "checked by optax")


# ------------------------------------------------------------------------------ hyperparameters


@functools.cache
def _probe_params() -> dict[str, jax.ShapeDtypeStruct]:
    return {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in _PROBE_SHAPES.items()}


def _live(jaxpr) -> set[int]:
    """The ids of the variables ``jaxpr``'s outputs depend on (its equations walked backwards)."""
    live = {id(v) for v in jaxpr.outvars}
    for eqn in reversed(jaxpr.eqns):
        if any(id(v) in live for v in eqn.outvars):
            live.update(id(v) for v in eqn.invars)
    return live


def _traced_options(optimizer: Callable, arg_rules: ArgRules) -> tuple[str, ...]:
    """The options that may change between steps without recompiling: of the float options (rule a
    finite number, not None by default; a default float or a required number), those that

    * build an optimizer whose ``init`` and ``update`` trace (:func:`jax.eval_shape`) with the
      option a traced f32 scalar, giving a state and updates of the same structure, shapes and
      dtypes as with numbers (so a value may be passed into a compiled step), and
    * ``init`` does not read: a value the state held from the start would not follow a change
      (schedule-free's ``b1``, which its state keeps and its evaluation parameters use).

    Taken together, one option at a time, in signature order (an option that fails with the ones
    kept so far is left out).
    """
    parameters = _parameters(optimizer)
    required = {name: _PROBE_NUMBER for name, p in parameters.items() if p.default is p.empty}
    candidates = [rule.name for rule in arg_rules if rule.kind is RuleKind.REAL and not rule.allow_none
                  and (isinstance(parameters[rule.name].default, float) or rule.name in required)
                  and not _AVERAGING_COEFFICIENT.match(rule.name)]
    params = _probe_params()

    def build(values):
        return optimizer(**{**required, **values})

    def outputs(names: tuple[str, ...]):
        values = {name: jax.ShapeDtypeStruct((), jnp.float32) for name in names}

        def step(values, params, grads):
            tx = build(values)
            state = tx.init(params)
            return state, tx.update(grads, state, params)

        try:
            shapes = jax.eval_shape(step, values, params, params)
            init = jax.make_jaxpr(lambda values, params: build(values).init(params))(values, params)
        except Exception:  # noqa: BLE001 -- an option that does not trace is not a hyperparameter
            return None
        live = _live(init.jaxpr)
        if any(id(v) in live for v in init.jaxpr.invars[:len(values)]):
            return None  # init's state holds a traced option (values flatten first, in sorted-name order)
        return jax.tree.structure(shapes), [(x.shape, x.dtype) for x in jax.tree.leaves(shapes)]

    reference = outputs(())
    kept: tuple[str, ...] = ()
    for name in candidates:
        if reference is not None and outputs(kept + (name,)) == reference:
            kept += (name,)
    return kept
