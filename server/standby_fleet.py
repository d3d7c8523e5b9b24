"""The shards' hot standbys (``--replicas 2``, ``docs/plans/hot_standby.md``): one standby shard
actor per shard index, on another Ray node than its primary, holding a standby part of each
session its primary serves (:class:`StandbyActors`, the fleet's handle on them).

Placement: each standby is pinned to a live node other than the node of its primary's placement
bundle (``NodeAffinitySchedulingStrategy``, not soft), the nodes taken in turn. A cluster with one
node is refused in one line naming ``--replicas``, unless ``replica_same_node`` (single-machine
tests) lets both share it.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional, Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from optserve.server.domain.sessions import ShardOpening
from optserve.server.domain.sessions import StandbySummary
from optserve.server.preflight import StartError

log = logging.getLogger(__name__)

AVOID_FAILED_NODE_S = 60.0  # a node where a fresh standby failed to start is passed over this long
START_TIMEOUT_S = 120.0  # a fresh standby not serving by then (not placed: no room on its node) failed


def shard_nodes() -> list[str]:
    """Live Ray nodes that can hold a shard (they offer CPU: a shard's bundle reserves some; a
    head started with ``--num-cpus 0`` to keep work off it holds none)."""
    return [node["NodeID"] for node in ray.nodes()
            if node.get("Alive") and node.get("Resources", {}).get("CPU", 0) > 0]


def standby_nodes(primary_nodes: Sequence[str], alive: Sequence[str], same_node: bool) -> list[str]:
    """The node id each shard's standby goes to: another live node than its primary's (``alive``
    in turn, skipping the primary's), or its primary's own with ``same_node``.

    Raises:
      StartError: no other live node (one line, naming ``--replicas``).
    """
    if same_node:
        return list(primary_nodes)
    picks = []
    for index, primary in enumerate(primary_nodes):
        others = [node for node in alive if node != primary]
        if not others:
            raise StartError(f"--replicas 2 puts each shard's standby on another Ray node than its primary; the "
                             f"cluster has {len(set(alive))} node that can hold shards: add a node or use --replicas 1")
        picks.append(others[index % len(others)])
    return picks


class StandbyActors:
    """Shard ``i``'s standby actor at ``actors[i]`` (None once it was promoted or lost), with the
    address of its internal port (``clock_addresses[i]``), where its primary streams to it.

    Args:
      start_actor: ``(index, scheduling_strategy) -> actor`` (a shard actor of that index).
      nodes: the node id each standby is pinned to (:func:`standby_nodes`).
      same_node: a standby may share its primary's node (single-machine tests).
    """

    def __init__(self, start_actor: Callable, nodes: Sequence[str], same_node: bool = False):
        self._start_actor, self._same_node = start_actor, same_node
        self._failed_on: dict[str, float] = {}  # node id -> when a fresh standby failed to start there
        self.actors: list = [start_actor(i, NodeAffinitySchedulingStrategy(node, soft=False))
                             for i, node in enumerate(nodes)]
        self.clock_addresses: list[Optional[str]] = ray.get([a.clock_address.remote() for a in self.actors])

    def start_fresh(self, index: int, primary_node: str) -> None:
        """A new standby for shard ``index`` (whose primary runs on ``primary_node``), on another
        live node; it holds nothing until sessions follow on it. A node where a start failed in
        the last :data:`AVOID_FAILED_NODE_S` seconds (cut off, not yet declared dead) is taken
        only when no other is left.

        Raises:
          StartError: no other live node.
          Exception: what Ray raised when the actor could not start (the node is avoided next time).
        """
        now = time.monotonic()
        alive = shard_nodes()
        fresh = [node for node in alive if now - self._failed_on.get(node, -AVOID_FAILED_NODE_S) >= AVOID_FAILED_NODE_S]
        node = standby_nodes([primary_node], fresh if set(fresh) - {primary_node} else alive, self._same_node)[0]
        actor = self._start_actor(index, NodeAffinitySchedulingStrategy(node, soft=False))
        try:
            self.clock_addresses[index] = ray.get(actor.clock_address.remote(), timeout=START_TIMEOUT_S)
        except Exception:
            self._failed_on[node] = time.monotonic()
            ray.kill(actor, no_restart=True)
            raise
        self.actors[index] = actor
        log.warning("event=standby_started shard=%d node=%s", index, node)

    def follow(self, openings: Sequence[ShardOpening], call, gone: tuple, replace: bool = False) -> list[ShardOpening]:
        """Each opening's standby part is held by its shard's standby (``call(ref)`` waits for one
        and raises the domain error; every one is waited for first; ``replace``: one it holds
        already is dropped first). A standby found dead
        (``gone``: what Ray raises then) holds nothing (the shard watch replaces it). Returns the
        openings whose standby holds them."""
        calls = [(o, self.actors[o.shard_index].follow_session.remote(o, replace)) for o in openings
                 if self.actors[o.shard_index]]
        errors, held = [], []
        for opening, ref in calls:
            try:
                ray.get(ref)
                held.append(opening)
            except gone:  # the watch's next check forgets it, lets its primary go on and starts a fresh one
                pass
            except Exception:  # noqa: BLE001 - the domain error, raised below once every standby answered
                try:
                    call(ref)
                except Exception as exc:  # noqa: BLE001
                    errors.append(exc)
        if errors:
            raise errors[0]
        return held

    def dead(self, gone: tuple, timeout_s: float = 5.0) -> list[int]:
        """Indices of the standbys whose actor died (``gone``: what Ray raises then)."""
        live = [(i, a.pid.remote()) for i, a in enumerate(self.actors) if a is not None]
        ready, _ = ray.wait([ref for _i, ref in live], num_returns=len(live), timeout=timeout_s)
        done, dead = set(ready), []
        for index, ref in live:
            if ref in done:
                try:
                    ray.get(ref)
                except gone:
                    dead.append(index)
        return dead

    def reports(self, timeout_s: float = 5.0) -> list[Optional[StandbySummary]]:
        """Each shard's standby now (None: it has none); one that did not answer is unhealthy."""
        refs = {i: a.server_status.remote() for i, a in enumerate(self.actors) if a is not None}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        done, out = set(ready), []
        for index in range(len(self.actors)):
            ref = refs.get(index)
            if ref is None:
                out.append(None)
                continue
            try:
                out.append(StandbySummary(ray.get(ref)["node_id"], healthy=True) if ref in done else StandbySummary())
            except Exception:  # noqa: BLE001 - a dead standby reports as unhealthy
                out.append(StandbySummary())
        return out

    def forget(self, index: int) -> None:
        """Shard ``index``'s standby died: its primary's parts go on with one copy."""
        if self.take(index) is not None:
            log.error("event=standby_died shard=%d", index)

    def take(self, index: int):
        """Shard ``index``'s standby, no longer a standby (None: it has none)."""
        actor, self.actors[index] = self.actors[index], None
        self.clock_addresses[index] = None
        return actor

    def live(self) -> list:
        return [a for a in self.actors if a is not None]
