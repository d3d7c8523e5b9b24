"""Shape handling for Shampoo: merge small dimensions, cut a tensor into blocks, glue it back.

A parameter of shape ``S`` is first reshaped to ``merge_small_dims(S, max_dim)`` (optional), then
every dimension longer than ``block_size`` is cut into chunks of ``block_size`` (the last chunk
holds the remainder). Blocks are listed in row-major order over the chunk grid; each block of
rank ``k`` owns ``k`` statistics, one ``[d, d]`` matrix per dimension ``d`` of the block.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

import jax
import jax.numpy as jnp


def merge_small_dims(shape: Sequence[int], max_dim: int) -> tuple[int, ...]:
    """Merges adjacent dimensions while their product stays ``<= max_dim``; drops 1s.

    ``(1, 2, 512, 1, 2048, 1, 3, 4)`` with ``max_dim=1024`` gives ``(1024, 2048, 12)``; an
    all-ones (or empty) shape gives ``(1,)``.
    """
    if all(d == 1 for d in shape):
        return (1,)
    merged: list[int] = []
    product = 1
    for d in shape:
        if product * d <= max_dim:
            product *= d
        else:
            if product > 1:
                merged.append(product)
            product = d
    if product > 1:
        merged.append(product)
    return tuple(merged)


def _chunks(d: int, block_size: int) -> tuple[int, ...]:
    if block_size <= 0 or d <= block_size:
        return (d,)
    full, rest = divmod(d, block_size)
    return (block_size,) * full + ((rest,) if rest else ())


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """How one parameter is reshaped and blocked.

    Attributes:
      shape: the parameter's shape.
      working_shape: the shape after merging small dims (equal to ``shape`` when disabled).
      chunks: per working dimension, the chunk lengths along it.
    """

    shape: tuple[int, ...]
    working_shape: tuple[int, ...]
    chunks: tuple[tuple[int, ...], ...]

    @classmethod
    def create(cls, shape: Sequence[int], block_size: int, merge_dims: bool, merge_max_dim: int) -> "BlockLayout":
        shape = tuple(int(d) for d in shape)
        working = merge_small_dims(shape, merge_max_dim) if merge_dims else shape
        return cls(shape, working, tuple(_chunks(d, block_size) for d in working))

    @property
    def block_shapes(self) -> list[tuple[int, ...]]:
        """Shapes of the blocks in row-major chunk order."""
        return [tuple(b) for b in itertools.product(*self.chunks)]

    @property
    def statistic_sizes(self) -> list[int]:
        """The side of every statistic matrix: for each block, one per block dimension."""
        return [d for b in self.block_shapes for d in b]

    def split(self, x: jax.Array) -> list[jax.Array]:
        """``x`` (shape ``self.shape``) -> list of blocks in row-major chunk order."""
        pieces = [jnp.reshape(x, self.working_shape)]
        for axis, sizes in enumerate(self.chunks):
            if len(sizes) == 1:
                continue
            cuts = list(itertools.accumulate(sizes))[:-1]
            pieces = [part for piece in pieces for part in jnp.split(piece, cuts, axis=axis)]
        return pieces

    def merge(self, blocks: Sequence[jax.Array]) -> jax.Array:
        """Inverse of :meth:`split`."""
        pieces = list(blocks)
        for axis in reversed(range(len(self.chunks))):
            n = len(self.chunks[axis])
            if n == 1:
                continue
            pieces = [jnp.concatenate(pieces[i : i + n], axis=axis) for i in range(0, len(pieces), n)]
        assert len(pieces) == 1
        return jnp.reshape(pieces[0], self.shape)
