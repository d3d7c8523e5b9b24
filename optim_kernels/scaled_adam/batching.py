"""Stacking of same-shape tensors, so one batched computation serves a whole group.

ScaledAdam treats every tensor alike except for a per-tensor scale. Tensors that share a
shape and dtype are stacked along a new leading axis (the *batch* axis), updated by one
kernel, and split back. Grouping is decided once per trace from static shapes, so it costs
nothing at run time beyond the stack and the split.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp


class ShapeGroups(NamedTuple):
    """Leaf indices grouped by ``(shape, dtype)``, in order of first appearance.

    Attributes:
      members: one tuple of leaf indices per group; together they cover ``range(num_leaves)``.
      num_leaves: number of leaves that were grouped.
    """

    members: tuple[tuple[int, ...], ...]
    num_leaves: int


def shape_groups(leaves: Sequence[jax.Array]) -> ShapeGroups:
    """Groups ``leaves`` (a flat list of arrays) by their static shape and dtype."""
    by_key: dict[tuple, list[int]] = {}
    for index, leaf in enumerate(leaves):
        key = (tuple(leaf.shape), jnp.dtype(leaf.dtype).name)
        by_key.setdefault(key, []).append(index)
    return ShapeGroups(tuple(tuple(m) for m in by_key.values()), len(leaves))


def stack(groups: ShapeGroups, leaves: Sequence[jax.Array]) -> list[jax.Array]:
    """One array per group, of shape ``(len(group), *leaf_shape)``."""
    return [jnp.stack([leaves[i] for i in members]) for members in groups.members]


def unstack(groups: ShapeGroups, stacked: Sequence[jax.Array]) -> list[jax.Array]:
    """Inverse of :func:`stack`: the flat list of leaves, in their original order."""
    leaves: list = [None] * groups.num_leaves
    for members, batch in zip(groups.members, stacked):
        for position, index in enumerate(members):
            leaves[index] = batch[position]
    return leaves


def map_batched(
    fn: Callable[..., tuple[jax.Array, ...]],
    num_outputs: int,
    groups: ShapeGroups,
    *leaf_lists: Sequence[jax.Array],
) -> tuple[list[jax.Array], ...]:
    """Applies ``fn`` once per group to stacked arguments and splits its outputs.

    Args:
      fn: ``fn(*stacked_args) -> tuple of stacked outputs``; every argument and output has
        the group's size as its leading axis.
      num_outputs: how many arrays ``fn`` returns.
      groups: the grouping, from :func:`shape_groups`.
      *leaf_lists: flat lists of leaves, each aligned with the grouped leaves.

    Returns:
      One flat list of leaves per output of ``fn``, in the original leaf order.
    """
    outputs_per_group = [
        fn(*[jnp.stack([leaves[i] for i in members]) for leaves in leaf_lists])
        for members in groups.members
    ]
    return tuple(
        unstack(groups, [outputs[k] for outputs in outputs_per_group]) for k in range(num_outputs)
    )
