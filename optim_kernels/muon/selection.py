"""Which tensors take Muon's path and which the AdamW fallback, decided by name and shape.

The server's params are a dict ``name -> array`` and a shard holds a subset of it, so every rule
here is a per-tensor function of the tensor's name (the '/'-joined key path, e.g.
``"blocks/0/mlp/w"``) and shape: each shard decides its own tensors exactly as the whole model
would.

A tensor takes the **AdamW** path if

1. its name matches one of ``adam_tensors`` (fnmatch patterns: embeddings, output heads, ...);
   else
2. its name matches a pattern of ``axes_rules`` whose value is ``None``; else
3. no pattern of ``axes_rules`` matches and it is not 2-D (biases, norms, scalars, and
   higher-rank tensors).

Every other tensor takes the **Muon** path with the axes its pattern gives, or
:data:`~.axes.DEFAULT_AXES` for an unmatched 2-D tensor. A name matched by two patterns of
``axes_rules`` is an error (rules are unordered, as a JSON object is).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Sequence
from typing import Any

import jax
from optserve.optim_kernels.adafactor.factoring import path_string
from optserve.optim_kernels.muon.axes import DEFAULT_AXES, MatrixAxes, normalize_axes

__all__ = ["ADAM", "MUON", "TensorSelection", "matches_any", "name_mask"]

MUON = "muon"
ADAM = "adam"


def matches_any(name: str, patterns: Sequence[str]) -> bool:
    """Whether ``name`` matches one of the fnmatch ``patterns`` (case-sensitive)."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


@dataclasses.dataclass(frozen=True)
class TensorSelection:
    """The rules above.

    Attributes:
      adam_tensors: fnmatch patterns of tensors forced onto the AdamW path.
      axes_rules: ``(pattern, MatrixAxes or None)`` pairs; ``None`` sends matching tensors to
        AdamW, axes send them (of any rank >= 2) to Muon with those axes.
    """

    adam_tensors: tuple[str, ...] = ()
    axes_rules: tuple[tuple[str, MatrixAxes | None], ...] = ()

    def matrix_axes(self, name: str, shape: Sequence[int]) -> MatrixAxes | None:
        """The normalized axes of tensor ``name`` on the Muon path, or ``None`` for AdamW.

        Raises:
          ValueError: naming the tensor and its shape, when two axis rules match it or its
            rule's axes do not fit its shape.
        """
        if matches_any(name, self.adam_tensors):
            return None
        rules = [(pattern, axes) for pattern, axes in self.axes_rules if fnmatch.fnmatchcase(name, pattern)]
        if len(rules) > 1:
            raise ValueError(f"muon: tensor {name!r} of shape {tuple(shape)} matches several "
                             f"muon_weight_dimension_numbers patterns: {[p for p, _ in rules]}")
        if not rules:
            return DEFAULT_AXES if len(shape) == 2 else None
        pattern, axes = rules[0]
        if axes is None:
            return None
        try:
            return normalize_axes(axes, len(shape))
        except ValueError as exc:
            raise ValueError(f"muon: muon_weight_dimension_numbers[{pattern!r}] does not fit tensor {name!r} "
                             f"of shape {tuple(shape)}: {exc}") from None

    def labels(self, tree: Any) -> Any:
        """``tree`` with each array replaced by :data:`MUON` or :data:`ADAM` (for ``optax.partition``)."""
        return jax.tree_util.tree_map_with_path(
            lambda path, x: ADAM if self.matrix_axes(path_string(path), x.shape) is None else MUON, tree)

    def axes_of(self, path, shape: Sequence[int]) -> MatrixAxes:
        """The axes of a Muon-path tensor at jax key ``path`` (a link's per-tensor lookup)."""
        axes = self.matrix_axes(path_string(path), shape)
        if axes is None:
            raise ValueError(f"muon: tensor {path_string(path)!r} of shape {tuple(shape)} is not on the Muon path")
        return axes


def name_mask(patterns: Sequence[str]) -> Callable[[Any], Any]:
    """``tree -> tree of bools``: True for the arrays whose name matches one of ``patterns``."""
    patterns = tuple(patterns)
    return lambda tree: jax.tree_util.tree_map_with_path(
        lambda path, _: matches_any(path_string(path), patterns), tree)
