"""Admitting a new session: its request checked against the limits, its tensors placed over the
shards within each shard's memory budget. Runs under the coordinator's ``_membership`` lock (one
placement at a time, each counting the sessions held and being opened); nothing is allocated.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from optserve.server.compute.kernels import check_optimizer
from optserve.server.domain.config import Limits, SessionConfig
from optserve.server.domain.errors import InvalidArgument
from optserve.server.domain.sessions.placement import place_tensors
from optserve.server.domain.sessions.session_records import SessionRecord
from optserve.server.domain.sessions.session_table import SessionTable


class Placed(NamedTuple):
    """A new session placed: its record, its estimated bytes on each shard (shard index ->
    bytes), and what each shard's budget has left beyond that estimate (a shard refuses the
    part if its step's working memory needs more)."""

    record: SessionRecord
    estimated: dict[int, int]
    left: dict[int, int]


def check_request(config: SessionConfig, limits: Limits) -> None:
    """Checks what needs no placement: the session's size and its optimizer's options.

    Raises:
      ResourceExhausted: larger than ``max_session_bytes``.
      InvalidArgument: a bad optimizer option (the message names it).
    """
    session_bytes = sum(t.nbytes for t in config.tensors)
    if session_bytes > limits.max_session_bytes:
        raise limits.exceeded("max_session_bytes", f"session {config.name!r}: {session_bytes} parameter bytes")
    try:
        check_optimizer(config.optimizer_name, config.optimizer_args, [t.name for t in config.tensors])
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def place_session(config: SessionConfig, owner: str, creator: str, *, addresses: Sequence[str],
                  table: SessionTable, limits: Limits, workers: bool, min_shard_bytes: int) -> Placed:
    """Places the session over the shards at ``addresses`` (balancing what ``table`` holds),
    within every shard's memory budget; ``workers``: the server has preconditioner workers
    (see :func:`~optserve.server.domain.sessions.memory_estimate.estimate`).

    Raises:
      ResourceExhausted: its estimated bytes would take a shard past its budget.
    """
    num_shards = len(addresses)
    placement = place_tensors(config.tensors, num_shards, min_shard_bytes=min_shard_bytes,
                              shard_loads=table.shard_loads(num_shards))
    record = SessionRecord.placed(config, [(i, names) for i, names in enumerate(placement) if names],
                                  addresses, owner, creator)
    budget, estimates = limits.shard_budget(num_shards), record.memory_estimates(workers)
    left = {}
    for shard, needed in sorted(estimates.items()):
        held = table.estimated_on(shard)
        if held + needed.total > budget:
            raise limits.exceeded(
                "shard_memory_bytes", f"session {config.name!r} needs an estimated {needed.describe()} on "
                f"shard {shard}, which holds an estimated {held} bytes of other sessions", budget)
        left[shard] = budget - held - needed.total
    return Placed(record, {shard: needed.total for shard, needed in estimates.items()}, left)
