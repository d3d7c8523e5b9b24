"""Shampoo's per-block second-moment statistics and their application to a gradient block.

For a block ``G`` of rank ``k`` and each dimension ``i``, the statistic is the ``[d_i, d_i]``
matrix ``L_i <- w1 L_i + w2 G_(i) G_(i)^T`` where ``G_(i)`` is ``G`` unfolded along ``i``
(``w1 = beta2``, ``w2 = 1 - beta2``, or ``w2 = 1`` when ``beta2 == 1``). Statistics start at
``matrix_epsilon * I``. The preconditioned block is ``G x_1 P_1 x_2 ... x_k P_k`` with
``P_i = L_i^(-1/(2k))`` (the exponent ``2k`` unless overridden).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp


def statistic_weights(beta2: float) -> tuple[float, float]:
    """``(w1, w2)`` for the running statistics: an EMA, or a plain sum when ``beta2 == 1``."""
    return beta2, (1.0 if beta2 == 1.0 else 1.0 - beta2)


def init_statistics(sizes: Sequence[int], matrix_epsilon: float) -> list[jax.Array]:
    """``matrix_epsilon * I`` of every size, f32."""
    return [matrix_epsilon * jnp.eye(d, dtype=jnp.float32) for d in sizes]


def gram(block: jax.Array, axis: int, precision=None) -> jax.Array:
    """``G_(axis) G_(axis)^T``: [d, d] with ``d = block.shape[axis]``."""
    others = [i for i in range(block.ndim) if i != axis]
    return jnp.tensordot(block, block, axes=(others, others), precision=precision)


def update_block_statistics(
    stats: Sequence[jax.Array], block: jax.Array, beta2: float, precision=None
) -> list[jax.Array]:
    """New statistics of one block: ``w1 * old + w2 * gram`` for every dimension of ``block``."""
    w1, w2 = statistic_weights(beta2)
    return [w1 * s + w2 * gram(block, axis, precision) for axis, s in enumerate(stats)]


def precondition_block(block: jax.Array, preconditioners: Sequence[jax.Array], precision=None) -> jax.Array:
    """Applies ``P_i`` along every dimension ``i`` of ``block`` (same shape out).

    Contracting the leading axis with ``P`` each time rotates the axes back to their order after
    ``rank`` contractions.
    """
    for p in preconditioners:
        block = jnp.tensordot(block, p, axes=[[0], [0]], precision=precision)
    return block


def block_exponent(rank: int, exponent_override: int) -> int:
    """The root ``p`` used for every statistic of a rank-``rank`` block: ``2 * rank`` by default."""
    return exponent_override if exponent_override else 2 * rank
