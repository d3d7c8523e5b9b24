"""Muon's options as one validated, typed value (optax.contrib.muon's names and defaults).

:data:`MUON_ARG_RULES` holds the value rule of every option of
:func:`~optserve.optim_kernels.muon.kernel.muon`; the registry checks the given ones before
building, and :class:`MuonConfig` checks all of them (so the constructor called directly refuses
the same values with the same message) and parses the structured ones (``ns_coeffs``, the
tensor-name patterns, the dimension numbers) into hashable values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from optserve.optim_kernels import arg_rules as rules
from optserve.optim_kernels.arg_rules import ArgumentRuleError
from optserve.optim_kernels.muon.axes import MatrixAxes, parse_axes
from optserve.optim_kernels.muon.newton_schulz import (
    PRECONDITIONINGS,
    PRESETS,
    STANDARD_COEFFS,
    Coefficients,
    coefficient_schedule,
)
from optserve.optim_kernels.muon.selection import TensorSelection

__all__ = ["MUON_ARG_RULES", "MuonConfig"]

ScalarOrSchedule = float | Callable[[Any], Any]

_NS_COEFFS_NOTE = (f"three finite numbers (a, b, c), a list of such triples (one per iteration, at most "
                   f"ns_steps of them), or a preset name: {', '.join(repr(p) for p in PRESETS)}")
_PATTERNS_NOTE = "a list of fnmatch patterns of tensor names (strings)"
_DIMENSION_NUMBERS_NOTE = ("None, or a mapping from fnmatch patterns of tensor names to None (AdamW) or "
                           "{'reduction_axis': int or [int, ...], 'output_axis': int or [int, ...]}")

MUON_ARG_RULES = rules.ArgRules(
    rules.non_negative("learning_rate", schedule=True),
    rules.delegated("ns_coeffs", _NS_COEFFS_NOTE),
    rules.integer("ns_steps", 1),
    rules.unit_interval("beta"),
    rules.non_negative("eps"),
    rules.non_negative("weight_decay", schedule=True),
    rules.delegated("weight_decay_mask", f"None (every Muon-path tensor) or {_PATTERNS_NOTE}"),
    rules.dtype("mu_dtype", none=True),
    rules.flag("nesterov"),
    rules.flag("adaptive"),
    rules.choice("preconditioning", *PRECONDITIONINGS),
    rules.unit_interval("adam_b1"),
    rules.unit_interval("adam_b2"),
    rules.non_negative("adam_eps_root"),
    rules.non_negative("adam_weight_decay", schedule=True),
    rules.non_negative("adam_learning_rate", none=True, schedule=True),
    rules.delegated("muon_weight_dimension_numbers", _DIMENSION_NUMBERS_NOTE),
    rules.positive("consistent_rms", none=True),
    rules.delegated("adam_tensors", _PATTERNS_NOTE),
)


@dataclasses.dataclass(frozen=True)
class MuonConfig:
    """Validated Muon options (see :func:`~optserve.optim_kernels.muon.kernel.muon` for each).

    Structured options are stored in canonical, hashable form: ``ns_coeffs`` as a preset name in
    lower case or tuples of floats, the pattern lists as tuples of strings,
    ``muon_weight_dimension_numbers`` as sorted ``(pattern, MatrixAxes or None)`` pairs,
    ``preconditioning`` in lower case.

    Raises:
      ArgumentRuleError: (a ``ValueError``) naming the option, the value and the rule.
    """

    learning_rate: ScalarOrSchedule
    ns_coeffs: str | Sequence[float] | Sequence[Sequence[float]] = STANDARD_COEFFS
    ns_steps: int = 5
    beta: float = 0.95
    eps: float = 1e-8
    weight_decay: ScalarOrSchedule = 0.0
    weight_decay_mask: Sequence[str] | None = None
    mu_dtype: Any | None = None
    nesterov: bool = True
    adaptive: bool = False
    preconditioning: str = "frobenius"
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps_root: float = 0.0
    adam_weight_decay: ScalarOrSchedule = 0.0
    adam_learning_rate: ScalarOrSchedule | None = None
    muon_weight_dimension_numbers: Mapping[str, Any] | None = None
    consistent_rms: float | None = None
    adam_tensors: Sequence[str] = ()

    def __post_init__(self):
        for rule in MUON_ARG_RULES:
            error = rule.error("muon", getattr(self, rule.name))
            if error is not None:
                raise error
        canonical = {
            "preconditioning": self.preconditioning.lower(),
            "ns_steps": int(self.ns_steps),
            "ns_coeffs": self._parse("ns_coeffs", _NS_COEFFS_NOTE, _canonical_coeffs),
            "adam_tensors": self._parse("adam_tensors", _PATTERNS_NOTE, _patterns),
        }
        if self.weight_decay_mask is not None:
            canonical["weight_decay_mask"] = self._parse("weight_decay_mask", _PATTERNS_NOTE, _patterns)
        if self.muon_weight_dimension_numbers is not None:
            canonical["muon_weight_dimension_numbers"] = self._parse(
                "muon_weight_dimension_numbers", _DIMENSION_NUMBERS_NOTE, _axes_rules)
        for name, value in canonical.items():
            object.__setattr__(self, name, value)
        self._parse("ns_coeffs", _NS_COEFFS_NOTE, lambda coeffs: coefficient_schedule(coeffs, self.ns_steps))

    def _parse(self, name: str, note: str, parse: Callable[[Any], Any]) -> Any:
        value = getattr(self, name)
        try:
            return parse(value)
        except (TypeError, ValueError) as exc:
            raise ArgumentRuleError("muon", name, value, f"{name} is {note}", str(exc)) from None

    @property
    def schedule(self) -> tuple[Coefficients, ...]:
        """``(a, b, c)`` of each Newton–Schulz iteration."""
        return coefficient_schedule(self.ns_coeffs, self.ns_steps)

    @property
    def selection(self) -> TensorSelection:
        """Which tensors take which path (see :mod:`~optserve.optim_kernels.muon.selection`)."""
        return TensorSelection(self.adam_tensors, self.muon_weight_dimension_numbers or ())


def _canonical_coeffs(value) -> str | tuple:
    """A preset name in lower case, or the numbers as (tuples of) floats; the shape is checked by
    :func:`~.newton_schulz.coefficient_schedule`."""
    if isinstance(value, str):
        return value.lower()
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"got a {type(value).__name__}")
    return tuple(tuple(_float(c) for c in row) if isinstance(row, (list, tuple)) else _float(row) for row in value)


def _float(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{value!r} is not a number")
    return float(value)


def _patterns(value) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise TypeError(f"got {type(value).__name__}, not a list of strings")
    bad = [p for p in value if not isinstance(p, str) or not p]
    if bad:
        raise ValueError(f"{bad[0]!r} is not a non-empty string")
    return tuple(value)


def _axes_rules(value) -> tuple[tuple[str, MatrixAxes | None], ...]:
    if not isinstance(value, Mapping):
        raise TypeError(f"got {type(value).__name__}, not a mapping")
    parsed = []
    for pattern, axes in value.items():
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"pattern {pattern!r} is not a non-empty string")
        try:
            parsed.append((pattern, None if axes is None else parse_axes(axes)))
        except ValueError as exc:
            raise ValueError(f"pattern {pattern!r}: {exc}") from None
    return tuple(sorted(parsed, key=lambda item: item[0]))
