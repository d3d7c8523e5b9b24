"""Value rules for optimizer arguments, declared by each kernel next to its signature.

The registry checks an argument's *type* from the constructor's annotation; a rule says which
*values* of it make sense: its shape (one number, or a pair), finiteness, and the range the
kernel documents (``learning_rate > 0``, ``0 <= b1 < 1``, an integer ``>= 1``, ...), and whether
``None`` or a schedule (a callable of the step) stand in for a number. Every family declares the
rules of its constructors in its own package (:data:`ArgRules` tables such as
``ADAFACTOR_HF_ARG_RULES``); :func:`~optserve.optim_kernels.registry.build_optimizer` checks the
given arguments against the entry's table before it builds anything, and a family's typed config
may check its fields against the same table, so each range is written once.

A violation is an :class:`ArgumentRuleError` (a ``ValueError``) naming the optimizer, the
argument, the value given and the rule::

    optimizer 'adam': argument 'b1' = 1.5 must satisfy 0 <= b1 < 1 (one finite number)

Kinds of rule (build them with the helpers below):

* :func:`real` / :func:`positive` / :func:`non_negative` / :func:`unit_interval`: one finite
  number (a Python or NumPy scalar, or a 0-d array; never a bool, list or larger array) in an
  interval, optionally ``None`` and/or a schedule;
* :func:`integer`: one integer (not a bool, not a float) in an interval, optionally ``None``;
* :func:`pair`: a sequence of exactly two items, each with its own rule;
* :func:`flag`: ``True`` or ``False``;
* :func:`choice`: one of a few names (case-insensitive);
* :func:`dtype`: a floating-point dtype (``"float32"``, ``"bfloat16"``, a dtype object);
* :func:`delegated`: a structured value (a regex map, a root method, ...) that the constructor
  itself parses and rejects with a ``ValueError`` naming it; the rule only records that.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from typing import Any, Iterator, Mapping, Optional

import jax.numpy as jnp
import jax
import numpy as np

__all__ = [
    "ArgRule",
    "ArgRules",
    "ArgumentRuleError",
    "RuleKind",
    "choice",
    "delegated",
    "dtype",
    "flag",
    "integer",
    "non_negative",
    "pair",
    "positive",
    "real",
    "unit_interval",
]

_REPR_LIMIT = 80
_OUT_OF_RANGE = "out of range"  # the reason when the rule itself says it all (left out of messages)
_DTYPE_WORDS = "a floating-point dtype such as 'float32' or 'bfloat16'"


class RuleKind(enum.Enum):
    REAL = "real"
    INT = "int"
    PAIR = "pair"
    BOOL = "bool"
    CHOICE = "choice"
    DTYPE = "dtype"
    DELEGATED = "delegated"


@dataclasses.dataclass(frozen=True)
class ArgRule:
    """What values one argument admits.

    Attributes:
      name: the argument's name in the constructor's signature.
      kind: see :class:`RuleKind`.
      low / high: interval bounds of a REAL or INT (``None``: unbounded on that side).
      low_inclusive / high_inclusive: whether the bound itself is admitted.
      allow_none: ``None`` is admitted (an option that is off, or a default the kernel computes).
      allow_schedule: a callable (a schedule of the step) is admitted in place of a number.
      choices: the names a CHOICE admits (compared case-insensitively).
      items: the rule of each item of a PAIR.
      note: what the constructor checks, for a DELEGATED rule.
    """

    name: str
    kind: RuleKind
    low: Optional[float] = None
    high: Optional[float] = None
    low_inclusive: bool = True
    high_inclusive: bool = True
    allow_none: bool = False
    allow_schedule: bool = False
    choices: tuple[str, ...] = ()
    items: tuple["ArgRule", ...] = ()
    note: str = ""

    # ------------------------------------------------------------------ description

    def describe(self) -> str:
        """The rule in words, e.g. ``0 <= b1 < 1 (one finite number)``."""
        kind = self.kind
        if kind is RuleKind.REAL:
            return f"{self._interval()} ({self._or('one finite number')})"
        if kind is RuleKind.INT:
            return f"{self._interval()} ({self._or('an integer')})"
        if kind is RuleKind.PAIR:
            parts = " and ".join(item._interval() for item in self.items)
            return f"{self.name} is {self._or(f'a pair of finite numbers with {parts}')}"
        if kind is RuleKind.BOOL:
            return f"{self.name} is true or false"
        if kind is RuleKind.CHOICE:
            return f"{self.name} is one of {', '.join(repr(c) for c in self.choices)}"
        if kind is RuleKind.DTYPE:
            return f"{self.name} is {self._or(_DTYPE_WORDS)}"
        return f"{self.name}: {self.note or 'checked by the constructor'}"

    def _interval(self) -> str:
        below = "<=" if self.low_inclusive else "<"
        above = "<=" if self.high_inclusive else "<"
        if self.low is not None and self.high is not None:
            return f"{_number(self.low)} {below} {self.name} {above} {_number(self.high)}"
        if self.low is not None:
            return f"{self.name} {'>=' if self.low_inclusive else '>'} {_number(self.low)}"
        if self.high is not None:
            return f"{self.name} {above} {_number(self.high)}"
        return f"{self.name} is finite"

    def _or(self, what: str) -> str:
        """``what``, followed by the stand-ins the rule admits (a schedule, None)."""
        options = [what] + ["a schedule"] * self.allow_schedule + ["None"] * self.allow_none
        return what if len(options) == 1 else ", ".join(options[:-1]) + ", or " + options[-1]

    # ------------------------------------------------------------------ checking

    def violation(self, value: Any) -> Optional[str]:
        """``None`` when ``value`` satisfies the rule, else a short reason it does not."""
        if value is None:
            return None if self.allow_none or self.kind is RuleKind.DELEGATED else "None is not admitted"
        kind = self.kind
        if kind is RuleKind.DELEGATED:
            return None
        if kind is RuleKind.BOOL:
            return None if isinstance(value, (bool, np.bool_)) else f"got {_what(value)}, not a bool"
        if kind is RuleKind.CHOICE:
            if isinstance(value, str) and value.lower() in {c.lower() for c in self.choices}:
                return None
            return _OUT_OF_RANGE
        if kind is RuleKind.DTYPE:
            return _dtype_violation(value)
        if kind is RuleKind.PAIR:
            return self._pair_violation(value)
        if callable(value):
            return None if self.allow_schedule else "a schedule (callable) is not admitted here"
        if isinstance(value, jax.core.Tracer):  # a hyperparameter inside the jitted update: checked at the edge
            return None
        scalar, why = _scalar(value, integral=kind is RuleKind.INT)
        if why:
            return why
        return None if self._in_interval(scalar) else _OUT_OF_RANGE

    def _pair_violation(self, value: Any) -> Optional[str]:
        if isinstance(value, (str, bytes, Mapping)) or (_is_array(value) and np.ndim(value) != 1):
            return f"got {_what(value)}, not a pair"
        try:
            items = list(value)
        except TypeError:
            return f"got {_what(value)}, not a pair"
        if len(items) != len(self.items):
            return f"got {len(items)} items, not {len(self.items)}"
        for rule, item in zip(self.items, items):
            why = rule.violation(item)
            if why:
                return f"{rule.name} = {_short(item)}: {why}"
        return None

    def _in_interval(self, x: float) -> bool:
        if self.low is not None and not (x >= self.low if self.low_inclusive else x > self.low):
            return False
        if self.high is not None and not (x <= self.high if self.high_inclusive else x < self.high):
            return False
        return True

    def error(self, optimizer: str, value: Any) -> Optional["ArgumentRuleError"]:
        """The error for ``value`` (``None`` when it satisfies the rule)."""
        why = self.violation(value)
        return None if why is None else ArgumentRuleError(optimizer, self.name, value, self.describe(), why)


class ArgumentRuleError(ValueError):
    """An optimizer argument whose value breaks its rule.

    Attributes:
      optimizer / argument / value: what was given where.
      rule: the rule in words (:meth:`ArgRule.describe`).
      reason: why the value breaks it ("out of range", "nan is not finite", "got a list of 2
        items, not one number", ...).
    """

    def __init__(self, optimizer: str, argument: str, value: Any, rule: str, reason: str):
        self.optimizer, self.argument, self.value, self.rule, self.reason = optimizer, argument, value, rule, reason
        super().__init__(f"optimizer {optimizer!r}: argument {argument!r} = {_short(value)} must satisfy {rule}"
                         + ("" if reason == _OUT_OF_RANGE else f"; {reason}"))


class ArgRules:
    """One constructor's rules, at most one per argument, in the order they are checked."""

    def __init__(self, *rules: ArgRule):
        names = [r.name for r in rules]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"arguments with more than one rule: {duplicates}")
        self._rules = tuple(rules)

    def __iter__(self) -> Iterator[ArgRule]:
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)

    def __getitem__(self, name: str) -> ArgRule:
        for rule in self._rules:
            if rule.name == name:
                return rule
        raise KeyError(name)

    def __repr__(self) -> str:
        return f"ArgRules({', '.join(r.name for r in self._rules)})"

    @property
    def names(self) -> frozenset[str]:
        return frozenset(r.name for r in self._rules)

    def first_error(self, optimizer: str, values: Mapping[str, Any]) -> Optional[ArgumentRuleError]:
        """The error of the first given value (in rule order) that breaks its rule; values
        without a rule are not looked at."""
        for rule in self._rules:
            if rule.name in values:
                error = rule.error(optimizer, values[rule.name])
                if error is not None:
                    return error
        return None

    def check(self, optimizer: str, values: Mapping[str, Any]) -> None:
        """Raises :class:`ArgumentRuleError` for the first value that breaks its rule."""
        error = self.first_error(optimizer, values)
        if error is not None:
            raise error


# ---------------------------------------------------------------------------- rule builders


def real(name: str, low: Optional[float] = None, high: Optional[float] = None, *, low_inclusive: bool = True,
         high_inclusive: bool = True, none: bool = False, schedule: bool = False) -> ArgRule:
    """One finite number in ``[low, high]`` (ends open where ``*_inclusive`` is False)."""
    return ArgRule(name, RuleKind.REAL, low, high, low_inclusive, high_inclusive, allow_none=none,
                   allow_schedule=schedule)


def positive(name: str, *, none: bool = False, schedule: bool = False) -> ArgRule:
    """One finite number ``> 0``."""
    return real(name, 0, low_inclusive=False, none=none, schedule=schedule)


def non_negative(name: str, *, none: bool = False, schedule: bool = False) -> ArgRule:
    """One finite number ``>= 0``."""
    return real(name, 0, none=none, schedule=schedule)


def unit_interval(name: str, *, none: bool = False, schedule: bool = False) -> ArgRule:
    """One number in ``[0, 1)``: a decay rate (of a momentum or a moving average)."""
    return real(name, 0, 1, high_inclusive=False, none=none, schedule=schedule)


def integer(name: str, low: Optional[int] = 0, high: Optional[int] = None, *, high_inclusive: bool = True,
            none: bool = False) -> ArgRule:
    """One integer in ``[low, high]``."""
    return ArgRule(name, RuleKind.INT, low, high, True, high_inclusive, allow_none=none)


def pair(name: str, first: ArgRule, second: ArgRule, *, none: bool = False) -> ArgRule:
    """Exactly two items; ``first`` and ``second`` are their rules (named e.g. ``eps[0]``)."""
    return ArgRule(name, RuleKind.PAIR, items=(first, second), allow_none=none)


def flag(name: str) -> ArgRule:
    """``True`` or ``False``."""
    return ArgRule(name, RuleKind.BOOL)


def choice(name: str, *choices: str) -> ArgRule:
    """One of ``choices`` (case-insensitive)."""
    return ArgRule(name, RuleKind.CHOICE, choices=tuple(choices))


def dtype(name: str, *, none: bool = False) -> ArgRule:
    """A floating-point dtype, by name or as a dtype object."""
    return ArgRule(name, RuleKind.DTYPE, allow_none=none)


def delegated(name: str, note: str) -> ArgRule:
    """A structured value the constructor parses and rejects itself; ``note`` says what it admits."""
    return ArgRule(name, RuleKind.DELEGATED, note=note)


# ---------------------------------------------------------------------------- helpers


def _is_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")


def _scalar(value: Any, integral: bool) -> tuple[Optional[float], Optional[str]]:
    """(the number, None) for one admissible number, else (None, why not)."""
    if _is_array(value):
        shape = tuple(np.shape(value))
        if shape:
            return None, f"got an array of shape {shape}, not one number"
        try:
            value = np.asarray(value).item()
        except Exception:  # noqa: BLE001 -- a value that cannot be read is not a number
            return None, f"got {_what(value)}, not a number"
    if isinstance(value, (bool, np.bool_)):
        return None, "got a bool, not a number"
    if isinstance(value, (list, tuple)):
        return None, f"got a list of {len(value)} items, not one number"
    if integral:
        if not isinstance(value, numbers.Integral):
            return None, f"got {_what(value)}, not an integer"
        return int(value), None
    if not isinstance(value, numbers.Real):
        return None, f"got {_what(value)}, not a number"
    number = float(value)
    if not math.isfinite(number):
        return None, f"{number!r} is not finite"
    return number, None


def _dtype_violation(value: Any) -> Optional[str]:
    try:
        resolved = jnp.dtype(value)
    except Exception:  # noqa: BLE001 -- whatever jnp.dtype cannot read is not a dtype
        return "not a dtype"
    if not jnp.issubdtype(resolved, jnp.floating):
        return f"{resolved.name} is not a floating-point dtype"
    return None


def _what(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} items"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, float):
        return f"the float {value!r}"
    kind = type(value).__name__
    return f"{'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind}"


def _number(x: float) -> str:
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return repr(x)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _REPR_LIMIT else text[: _REPR_LIMIT - 3] + "..."
