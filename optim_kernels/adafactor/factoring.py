"""Which dimensions of a parameter Adafactor factors: pure shape logic, no arrays.

A :class:`FactorSpec` says, for one parameter shape, which axes form the "row" set, which form
the "column" set (both empty when the second moment is kept unfactored), and which axes the
per-parameter RMS quantities (update clipping, parameter scale) average over. Axes in neither
the row nor the column set are kept in both ``v_row`` and ``v_col``: for a rule with BATCH axes
each slice along them is factored on its own.

* ``v_row`` has the parameter's shape with the column axes removed (it is the mean of g^2 over
  the columns), ``v_col`` the shape with the row axes removed.
* Rules follow T5X: ``FactorDim.ROW / COLUMN / BATCH / NONE`` per axis, the legacy heuristic
  (two largest axes, both at least ``min_dim_size_to_factor``), HuggingFace's "last two axes"
  and tensor2tensor's "2-D only".

Paths are '/'-joined pytree keys (``{"layer": {"w": x}}`` -> ``"layer/w"``), the names that
``factor_map`` / ``multiply_by_parameter_scale`` regexes and error messages use.
"""

from __future__ import annotations

import enum
import re
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import jax
import numpy as np

Shape = Tuple[int, ...]


class FactorDim(enum.Enum):
    """Role of one axis in a T5X factor rule."""

    NONE = None  # not factored; averaged over by the RMS quantities
    BATCH = 1  # a stack of independent slices: never averaged over
    ROW = 2
    COLUMN = 3


_FACTOR_DIM_NAMES = {
    "row": FactorDim.ROW,
    "col": FactorDim.COLUMN,
    "column": FactorDim.COLUMN,
    "batch": FactorDim.BATCH,
    "none": FactorDim.NONE,
    "unfactorized": FactorDim.NONE,
}


class FactorSpec(NamedTuple):
    """How one parameter's second moment is stored.

    Attributes:
      row_axes: axes kept in ``v_row`` and averaged away in ``v_col`` (empty: unfactored).
      col_axes: axes kept in ``v_col`` and averaged away in ``v_row`` (empty: unfactored).
      averaging_axes: axes averaged by update clipping and the parameter scale (all axes
        except BATCH ones).
    """

    row_axes: Tuple[int, ...]
    col_axes: Tuple[int, ...]
    averaging_axes: Tuple[int, ...]

    @property
    def factored(self) -> bool:
        return bool(self.row_axes) and bool(self.col_axes)

    def v_row_shape(self, shape: Shape) -> Shape:
        return tuple(d for i, d in enumerate(shape) if i not in self.col_axes)

    def v_col_shape(self, shape: Shape) -> Shape:
        return tuple(d for i, d in enumerate(shape) if i not in self.row_axes)

    def row_axes_in_v_row(self) -> Tuple[int, ...]:
        """Positions of ``row_axes`` inside ``v_row`` (after the column axes are removed)."""
        return tuple(a - sum(c < a for c in self.col_axes) for a in self.row_axes)


# (path, shape) -> FactorSpec; raises ValueError for shapes the rule cannot handle.
Factoring = Callable[[str, Shape], FactorSpec]


def unfactored(shape: Shape) -> FactorSpec:
    """Full second moment; RMS quantities over every axis."""
    return FactorSpec((), (), tuple(range(len(shape))))


def heuristic(shape: Shape, min_dim_size_to_factor: int, path: str = "?") -> FactorSpec:
    """T5X's legacy rule for rank <= 2: factor the two largest axes when both are big enough.

    The smaller of the two becomes the row axis; on a tie the first axis is the row axis.
    Rank > 2 needs an explicit rule (``factor_map`` / ``logical_factor_rules``), as in T5X.
    """
    shape = tuple(shape)
    if len(shape) > 2:
        raise ValueError(
            f"parameter {path!r} of shape {shape} has rank > 2 and no factor rule: give it one "
            "with the `factor_map` or `logical_factor_rules` option (or set factored=False)"
        )
    if len(shape) < 2:
        return unfactored(shape)
    order = np.argsort(shape, kind="stable")
    if shape[order[-2]] < min_dim_size_to_factor:
        return unfactored(shape)
    return FactorSpec((int(order[-2]),), (int(order[-1]),), tuple(range(len(shape))))


def last_two_axes(shape: Shape) -> FactorSpec:
    """HuggingFace/fairseq: every parameter of rank >= 2 factors its last two axes.

    Leading axes are kept in both factors; RMS quantities still average over the whole tensor.
    """
    n = len(shape)
    if n < 2:
        return unfactored(shape)
    return FactorSpec((n - 2,), (n - 1,), tuple(range(n)))


def matrices_only(shape: Shape) -> FactorSpec:
    """tensor2tensor: only rank-2 parameters are factored (rows = axis 0)."""
    if len(shape) != 2:
        return unfactored(shape)
    return FactorSpec((0,), (1,), (0, 1))


def to_factor_dim(value: Any, path: str = "?") -> FactorDim:
    """Accepts a :class:`FactorDim`, ``None`` or one of T5X's names ('row', 'col', ...)."""
    if isinstance(value, FactorDim):
        return value
    if value is None:
        return FactorDim.NONE
    if isinstance(value, str) and value.lower() in _FACTOR_DIM_NAMES:
        return _FACTOR_DIM_NAMES[value.lower()]
    raise ValueError(
        f"parameter {path!r}: factor rule entry {value!r} is not one of "
        f"{sorted(_FACTOR_DIM_NAMES)} or a FactorDim"
    )


def from_rule(
    rule: Optional[Sequence[Any]], shape: Shape, path: str, min_dim_size_to_factor: int
) -> FactorSpec:
    """T5X's explicit rule: one FactorDim per axis, or ``None`` for "do not factor".

    A rank <= 2 rule without BATCH axes falls back to :func:`heuristic` (T5X ignores it).
    ROW and COLUMN must both appear or both be absent.
    """
    shape = tuple(shape)
    if rule is None:
        return unfactored(shape)
    dims = tuple(to_factor_dim(d, path) for d in rule)
    if len(dims) != len(shape):
        raise ValueError(
            f"parameter {path!r} of shape {shape}: factor rule {dims} has rank {len(dims)}, "
            f"the parameter has rank {len(shape)} (option `factor_map`)"
        )
    batch = tuple(i for i, d in enumerate(dims) if d is FactorDim.BATCH)
    if len(shape) <= 2 and not batch:
        return heuristic(shape, min_dim_size_to_factor, path)
    rows = tuple(i for i, d in enumerate(dims) if d is FactorDim.ROW)
    cols = tuple(i for i, d in enumerate(dims) if d is FactorDim.COLUMN)
    if bool(rows) != bool(cols):
        raise ValueError(
            f"parameter {path!r} of shape {shape}: factor rule {dims} has ROW without COLUMN "
            "or COLUMN without ROW (option `factor_map`)"
        )
    averaging = tuple(i for i in range(len(shape)) if i not in batch)
    return FactorSpec(rows, cols, averaging)


def rule_from_logical_axes(
    axes: Sequence[Any], logical_factor_rules: Mapping[Any, Any], path: str
) -> Tuple[FactorDim, ...]:
    """T5X's ``set_param_axes``: map logical axis names to FactorDims.

    A rule with only one of ROW / COLUMN becomes unfactored (its BATCH axes kept); ROW and
    COLUMN together with a NONE axis is an incomplete specification and is rejected.
    """
    dims = []
    for name in axes:
        if name not in logical_factor_rules:
            raise ValueError(
                f"parameter {path!r}: logical axis {name!r} has no entry in `logical_factor_rules`"
            )
        dims.append(to_factor_dim(logical_factor_rules[name], path))
    dims = tuple(dims)
    has_row, has_col = FactorDim.ROW in dims, FactorDim.COLUMN in dims
    if has_row and has_col and FactorDim.NONE in dims:
        raise ValueError(
            f"parameter {path!r}: incomplete factor rule {dims} from logical axes {tuple(axes)} "
            "(ROW and COLUMN together with NONE; option `logical_factor_rules`)"
        )
    if not (has_row and has_col):
        dims = tuple(FactorDim.NONE if d in (FactorDim.ROW, FactorDim.COLUMN) else d for d in dims)
    return dims


def standard_logical_factor_rules() -> dict[str, FactorDim]:
    """T5X's default logical-axis -> FactorDim table (T5-style axis names)."""
    col, row, batch, none = FactorDim.COLUMN, FactorDim.ROW, FactorDim.BATCH, FactorDim.NONE
    return {
        "vocab": col, "embed": row, "mlp": col, "heads": col, "kv": col, "joined_kv": col,
        "relpos_buckets": none, "layers": batch, "stack": batch, "q_wi_fused": col,
        "o_wo_fused": col, "multiquery_heads": col, "kv_fused": col, "layer_norm_scale": none,
        "mlp_activations": col,
    }


class PathMap:
    """Regex rules over parameter paths: the first rule whose pattern ``re.search``-es wins.

    Built from a mapping ``{pattern: value}`` (insertion order) or a sequence of
    ``(pattern, value)`` pairs; ``option`` names the constructor argument in errors.
    """

    def __init__(self, rules: Union[Mapping[str, Any], Sequence[Tuple[str, Any]]], option: str):
        items = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
        try:
            self._rules = [(re.compile(pattern), value) for pattern, value in items]
        except (TypeError, ValueError, re.error) as exc:
            raise ValueError(f"option `{option}`: rules must be (regex, value) pairs: {exc}") from None
        self.option = option

    def __getitem__(self, path: str) -> Any:
        for pattern, value in self._rules:
            if pattern.search(path):
                return value
        raise ValueError(f"parameter {path!r}: no rule in option `{self.option}` matches its path")


def path_string(key_path: Sequence[Any]) -> str:
    """'/'-joined names of a jax key path (dict keys, attribute names, sequence indices)."""
    parts = []
    for key in key_path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def leaf_paths(tree: Any) -> list[str]:
    """The '/'-joined path of every leaf of ``tree``, in ``jax.tree.leaves`` order."""
    return [path_string(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
