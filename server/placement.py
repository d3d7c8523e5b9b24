"""Shard placement: the one function that decides which shard holds which tensor."""

from __future__ import annotations

from typing import Sequence

from optserve.server.config import TensorSpec


def place_tensors(tensors: Sequence[TensorSpec], num_shards: int) -> list[list[str]]:
    """Balances parameter bytes across shards (largest tensor first onto the lightest shard).

    Args:
      tensors: the session's tensors.
      num_shards: shards available (>= 1).

    Returns:
      ``num_shards`` lists of tensor names (some may be empty when there are fewer tensors than
      shards); every tensor appears exactly once. Each list keeps the session's tensor order.
      Deterministic: ties go to the lower shard index, equal sizes keep declaration order.
    """
    loads = [0] * num_shards
    owner: dict[str, int] = {}
    order = sorted(range(len(tensors)), key=lambda i: (-tensors[i].nbytes, i))
    for i in order:
        shard = min(range(num_shards), key=lambda s: (loads[s], s))
        owner[tensors[i].name] = shard
        loads[shard] += max(tensors[i].nbytes, 1)
    return [[t.name for t in tensors if owner[t.name] == s] for s in range(num_shards)]
