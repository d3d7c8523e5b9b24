"""Watches the shard actors: a shard whose process died is replaced, and its sessions are lost.

The server keeps no copy of a session's state (durability is not built yet), so a dead shard
takes its part of every session it held with it. What the watch guarantees instead is that this
is seen within seconds and said plainly: the coordinator marks those sessions lost (every call
naming them is DATA_LOSS with a message naming the session and the shard, instead of minutes
of retries and timeouts), calls waiting on the other shards of those sessions end at once, and
a new actor takes the dead shard's place so the server goes on serving new sessions.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)


class ShardWatch:
    """A daemon thread that checks the fleet every ``period_s`` seconds (see the module docstring).

    Args:
      fleet: the :class:`~optserve.server.shard_actor.RayShardFleet`.
      coordinator: the :class:`~optserve.server.domain.coordinator.Coordinator`.
      period_s: seconds between checks.
    """

    def __init__(self, fleet, coordinator, period_s: float = 1.0):
        self._fleet = fleet
        self._coordinator = coordinator
        self._period_s = period_s
        self._stop = threading.Event()
        self.restarts = 0  # shards replaced so far
        self._thread = threading.Thread(target=self._run, name="optserve-shard-watch", daemon=True)

    def start(self) -> "ShardWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def check_once(self) -> list[int]:
        """One check: replaces every dead shard (after marking its sessions lost); returns their indices."""
        dead = self._fleet.dead_shards()
        for index in dead:
            address = self._fleet.addresses[index]
            lost = self._coordinator.shard_lost(index, address, "its process exited")
            log.error("event=shard_died shard=%d address=%s lost_sessions=%s", index, address, ",".join(lost) or "-")
            new_address = self._fleet.restart(index)
            self.restarts += 1
            log.warning("event=shard_restarted shard=%d address=%s", index, new_address)
        return dead

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            try:
                self.check_once()
            except Exception:  # noqa: BLE001 - the watch must outlive one failed check
                log.exception("event=shard_watch_failed")
