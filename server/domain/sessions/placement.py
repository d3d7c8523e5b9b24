"""Shard placement: the one function that decides which shard holds which tensor."""

from __future__ import annotations

from typing import Optional, Sequence

from optserve.server.domain.config import TensorSpec


def place_tensors(tensors: Sequence[TensorSpec], num_shards: int, *, min_shard_bytes: int = 0,
                  shard_loads: Optional[Sequence[int]] = None) -> list[list[str]]:
    """Chooses the shards of a session and balances its parameter bytes across them.

    A session spreads over ``k = clamp(total_bytes // min_shard_bytes, 1, num_shards)`` shards:
    every extra shard costs each step a round trip and a cross-shard vote, which only pays off
    when each shard has enough bytes to move and update in parallel. The ``k`` shards are the
    least loaded ones (``shard_loads``: bytes of the sessions they already hold), and the session's
    tensors are balanced across them, largest tensor first onto the lightest shard.

    Args:
      tensors: the session's tensors.
      num_shards: shards available (>= 1).
      min_shard_bytes: the fewest bytes worth a shard of their own; 0 spreads every session over
        all shards.
      shard_loads: ``num_shards`` byte counts the shards already hold (None: all zero).

    Returns:
      ``num_shards`` lists of tensor names (empty for the shards the session does not use, and
      when there are fewer tensors than shards); every tensor appears exactly once. Each list keeps
      the session's tensor order. Deterministic: ties go to the lower shard index, equal sizes keep
      declaration order.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if min_shard_bytes < 0:
        raise ValueError(f"min_shard_bytes must be >= 0, got {min_shard_bytes}")
    loads_before = list(shard_loads) if shard_loads is not None else [0] * num_shards
    if len(loads_before) != num_shards:
        raise ValueError(f"shard_loads has {len(loads_before)} entries for {num_shards} shards")
    total = sum(t.nbytes for t in tensors)
    used = num_shards if min_shard_bytes == 0 else min(num_shards, max(1, total // min_shard_bytes))
    chosen = sorted(sorted(range(num_shards), key=lambda s: (loads_before[s], s))[:used])
    loads = {s: 0 for s in chosen}
    owner: dict[str, int] = {}
    order = sorted(range(len(tensors)), key=lambda i: (-tensors[i].nbytes, i))
    for i in order:
        shard = min(chosen, key=lambda s: (loads[s], s))
        owner[tensors[i].name] = shard
        loads[shard] += max(tensors[i].nbytes, 1)
    return [[t.name for t in tensors if owner[t.name] == s] for s in range(num_shards)]
