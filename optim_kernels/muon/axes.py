"""Which axes of a tensor form Muon's matrix: pure shape logic.

A weight used as ``y = x W`` has a *reduction* (input, fan-in) side and an *output* (fan-out)
side. For a 2-D ``W`` of shape ``(fan_in, fan_out)`` (the JAX/Flax layout) these are axes 0 and
1. For other tensors :class:`MatrixAxes` names the axes of each side; every axis in neither is a
*batch* axis, and each batch slice is orthogonalised on its own. For example a torch conv
filter ``(out, in, kh, kw)`` viewed as Keller Jordan's Muon views it is
``MatrixAxes(reduction=(1, 2, 3), output=(0,))``; a torch ``Linear.weight`` ``(out, in)`` is
``MatrixAxes(reduction=(1,), output=(0,))``.

:func:`matrix_view` turns a tensor into a stack ``(batch, fan_in, fan_out)`` and back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax

__all__ = ["DEFAULT_AXES", "MatrixAxes", "MatrixView", "matrix_view", "normalize_axes", "parse_axes"]

Axes = int | Sequence[int]


class MatrixAxes(NamedTuple):
    """Axes of the reduction (fan-in) and output (fan-out) sides; negative counts from the end."""

    reduction: tuple[int, ...] = (0,)
    output: tuple[int, ...] = (1,)


DEFAULT_AXES = MatrixAxes()
"""A 2-D ``(fan_in, fan_out)`` weight, as optax.contrib.muon assumes by default."""


class MatrixView(NamedTuple):
    """How a tensor of one shape is seen as a stack of matrices.

    Attributes:
      fan_in / fan_out: product of the reduction / output axis sizes (the matrix is
        ``fan_in x fan_out``).
      to_stack: ``tensor -> (batch, fan_in, fan_out)``.
      from_stack: the inverse.
    """

    fan_in: int
    fan_out: int
    to_stack: Callable[[jax.Array], jax.Array]
    from_stack: Callable[[jax.Array], jax.Array]


def parse_axes(value) -> MatrixAxes:
    """A :class:`MatrixAxes` from its JSON forms.

    Accepted: ``{"reduction_axis": r, "output_axis": o}`` (optax's field names), a pair
    ``[r, o]``, or a ``MatrixAxes`` / ``optax.contrib.MuonDimensionNumbers``; ``r`` and ``o`` are
    each an integer or a non-empty list of integers.

    Raises:
      ValueError: any other form.
    """
    if isinstance(value, dict):
        if set(value) != {"reduction_axis", "output_axis"}:
            raise ValueError(f"needs exactly the keys 'reduction_axis' and 'output_axis', got {sorted(value)}")
        reduction, output = value["reduction_axis"], value["output_axis"]
    elif isinstance(value, (list, tuple)) and len(value) == 2:
        reduction, output = value
    else:
        raise ValueError(f"expected {{'reduction_axis': ..., 'output_axis': ...}} or a pair, got {value!r}")
    return MatrixAxes(_axis_tuple(reduction), _axis_tuple(output))


def normalize_axes(axes: MatrixAxes, ndim: int) -> MatrixAxes:
    """``axes`` with non-negative indices for a tensor of rank ``ndim``.

    Raises:
      ValueError: rank below 2, an axis out of range, or the sides not disjoint.
    """
    if ndim < 2:
        raise ValueError(f"a Muon matrix needs a tensor of rank >= 2, this one has rank {ndim}")
    resolved = []
    for side in (axes.reduction, axes.output):
        for axis in side:
            if not -ndim <= axis < ndim:
                raise ValueError(f"axis {axis} is out of range for rank {ndim}")
        resolved.append(tuple(axis % ndim for axis in side))
    reduction, output = resolved
    if len(set(reduction)) != len(reduction) or len(set(output)) != len(output) or set(reduction) & set(output):
        raise ValueError(f"reduction axes {reduction} and output axes {output} must be distinct")
    return MatrixAxes(reduction, output)


def matrix_view(shape: Sequence[int], axes: MatrixAxes) -> MatrixView:
    """The :class:`MatrixView` of a tensor of ``shape`` (``axes`` already normalized)."""
    shape = tuple(int(d) for d in shape)
    batch = tuple(a for a in range(len(shape)) if a not in axes.reduction and a not in axes.output)
    order = batch + axes.reduction + axes.output
    fan_in = math.prod(shape[a] for a in axes.reduction)
    fan_out = math.prod(shape[a] for a in axes.output)
    stack_shape = (math.prod(shape[a] for a in batch), fan_in, fan_out)
    permuted_shape = tuple(shape[a] for a in order)
    inverse = tuple(order.index(a) for a in range(len(shape)))
    identity = order == tuple(range(len(shape)))

    def to_stack(x: jax.Array) -> jax.Array:
        return (x if identity else x.transpose(order)).reshape(stack_shape)

    def from_stack(x: jax.Array) -> jax.Array:
        x = x.reshape(permuted_shape)
        return x if identity else x.transpose(inverse)

    return MatrixView(fan_in, fan_out, to_stack, from_stack)


def _axis_tuple(value) -> tuple[int, ...]:
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items or not all(isinstance(a, int) and not isinstance(a, bool) for a in items):
        raise ValueError(f"an axis is an integer or a non-empty list of integers, got {value!r}")
    return tuple(items)
