"""Watches the shard actors: a shard whose process died is replaced within seconds.

On a durable server (``--checkpoint-dir``) the new actor restores the dead shard's part of every
session from its checkpoint and step log, to exactly the version it had acknowledged; votes
waiting for it end at once (UNAVAILABLE, the clients retry) and clients find it again through
the coordinator's shard map.

Without durability the server keeps no copy of a session's state, so a dead shard takes its
part of every session it held with it. The watch then makes that plain: the coordinator marks
those sessions lost (every call naming them is DATA_LOSS with a message naming the session and
the shard, instead of minutes of retries and timeouts), calls waiting on the other shards of
those sessions end at once, and a new actor takes the dead shard's place so the server goes on
serving new sessions.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time

from optserve.server.ops.periodic import Periodic

log = logging.getLogger(__name__)


REFOLLOW_EVERY_S = 10.0  # a session let go again soon after it was caught up waits this long for the next


def _retry_delays():
    """Seconds to wait after each failed start of a fresh standby: 1, 2, 4, 8, then every 10."""
    delay = 1.0
    while True:
        yield delay
        delay = min(10.0, delay * 2)


class ShardWatch(Periodic):
    """A daemon thread that checks the fleet every ``period_s`` seconds (see the module docstring).

    Args:
      fleet: the :class:`~optserve.server.shard_fleet.RayShardFleet`.
      coordinator: the :class:`~optserve.server.domain.sessions.coordinator.Coordinator`.
      period_s: seconds between checks.
    """

    failure_event = "shard_watch_failed"

    def __init__(self, fleet, coordinator, period_s: float = 0.25):
        # a check is one cheap actor call per shard; a dead shard is found 0.125 s after its death
        # on average (1 s checks cost 0.5 s on average, up to 1 s, of every shard restart's outage)
        super().__init__("optserve-shard-watch", period_s)
        self._fleet = fleet
        self._coordinator = coordinator
        self._holding: set[int] = set()  # restarted shards whose sessions wait for a shard that failed to start
        self._restandbying: set[int] = set()  # --replicas 2: shards whose fresh standby is being started
        self._asked_again: set[int] = set()  # ... and asked for again meanwhile (that standby was lost too)
        self._refollowed: dict[tuple[int, str], float] = {}  # (shard, session) -> when last caught up again
        self._lock = threading.Lock()

    def check_once(self) -> list[int]:
        """One check: replaces every dead shard (durable servers restore its sessions on the new
        one; others mark them lost first); returns their indices."""
        for index in self._fleet.forget_dead_standbys():  # --replicas 2: their primaries go on with one copy
            self.let_go(index, "its standby's process exited")
            self.restandby_later(index)
        found = self._fleet.dead_actors()
        if not found:
            return []
        with self._fleet.topology:  # a shard failed over meanwhile (ReplicaWatch) is not dead
            dead = [index for index, actor in sorted(found.items()) if self._fleet.actors[index] is actor]
            if dead and self._coordinator.durable:
                self._restore([index for index in dead if not self._failed_over(index)])
            elif dead:
                self._replace(dead)
        return dead

    def let_go(self, index: int, why: str) -> None:
        """--replicas 2: shard ``index``'s standby is gone: its sessions acknowledge with one copy."""
        try:
            names = self._fleet.go_on_alone(index, None, why)
            log.warning("event=one_copy shard=%d sessions=%s why=%s", index, ",".join(names) or "-", why)
        except Exception:  # noqa: BLE001 - its primary died too: the next check finds it
            log.exception("event=one_copy_failed shard=%d", index)

    def _failed_over(self, index: int) -> bool:
        """Durable servers with --replicas 2: dead shard ``index``'s standby serves in its place
        (sessions it did not hold are restored there from their files); False: it has none (or
        it was gone too), the shard is restarted and restored from its files."""
        if not self._fleet.has_standby(index):
            return False
        address = self._fleet.addresses[index]
        lost = self._coordinator.fail_over(index, address, "its process exited")
        if lost is None:
            return False
        log.error("event=shard_failed_over shard=%d address=%s new_address=%s lost_sessions=%s", index, address,
                  self._fleet.addresses[index], ",".join(lost) or "-")
        self.restandby_later(index)
        return True

    def _replace(self, dead: list[int]) -> None:
        """Servers without durability: each dead shard's standby serves in its place, or its
        sessions are lost and an empty shard replaces it."""
        for index in dead:
            address = self._fleet.addresses[index]
            if self._fleet.has_standby(index):  # --replicas 2: its standby serves in its place, at once
                lost = self._coordinator.fail_over(index, address, "its process exited")
                log.error("event=shard_failed_over shard=%d address=%s new_address=%s lost_sessions=%s", index,
                          address, self._fleet.addresses[index], ",".join(lost) or "-")
                self.restandby_later(index)
                continue  # (a standby that was gone too: the next check restarts the shard empty)
            lost = self._coordinator.shard_lost(index, address, "its process exited")
            log.error("event=shard_died shard=%d address=%s lost_sessions=%s", index, address, ",".join(lost) or "-")
            new_address = self._fleet.restart(index)
            self._coordinator.shard_replaced(index)
            log.warning("event=shard_restarted shard=%d address=%s", index, new_address)
            if self._fleet.replicated:
                self.restandby_later(index)

    def restandby_later(self, index: int) -> None:
        """--replicas 2: shard ``index`` gets a fresh standby, and its sessions are caught up on it
        from the shard's memory, off the watch's thread (seconds: an actor starts, each session's
        step compiles there). Asked again while one is being started (that one was lost too), it
        starts another once this one is done; it tries until the shard has a standby holding its
        sessions."""
        with self._lock:
            if index in self._restandbying:
                self._asked_again.add(index)
                return
            self._restandbying.add(index)

        def run() -> None:
            try:
                for delay in _retry_delays():
                    with self._lock:
                        self._asked_again.discard(index)
                    try:
                        if not self._fleet.has_standby(index):
                            self._fleet.add_standby(index)
                        failed = self._coordinator.restandby(index)
                        if self._fleet.has_standby(index):  # (lost meanwhile: once more)
                            log.warning("event=standby_caught_up shard=%d one_copy_sessions=%s", index,
                                        ",".join(failed) or "-")
                            with self._lock:
                                if index not in self._asked_again:
                                    return
                            continue
                    except Exception as exc:  # noqa: BLE001 - the shard goes on with one copy meanwhile
                        log.error("event=standby_start_failed shard=%d retry_in_s=%.0f why=%s", index, delay,
                                  f"{type(exc).__name__}: {exc}".splitlines()[0])
                    if self._stop.wait(delay):
                        return
            finally:
                with self._lock:
                    self._restandbying.discard(index)
                    self._asked_again.discard(index)

        threading.Thread(target=run, name=f"optserve-standby-{index}", daemon=True).start()

    def refollow_later(self, index: int, names: list[str], standby: str) -> None:
        """--replicas 2: shard ``index``'s sessions ``names`` were let go while its standby (at
        ``standby``) lives on (it refused them, their stream broke, or they fell behind): that
        standby is caught up on them again from the shard's memory, off the watch's thread. A
        session caught up less than :data:`REFOLLOW_EVERY_S` ago waits until then (one its standby
        keeps refusing does not cost a state transfer each probe). Skipped once the shard's
        standby changed (a fresh one is caught up on every session)."""
        now = time.monotonic()
        with self._lock:  # (entries past their wait are dropped: closed sessions leave none)
            self._refollowed = {key: at for key, at in self._refollowed.items() if at + REFOLLOW_EVERY_S > now}
            wait = max([self._refollowed.get((index, n), -REFOLLOW_EVERY_S) + REFOLLOW_EVERY_S - now for n in names]
                       + [0.0])
            for name in names:
                self._refollowed[(index, name)] = now + wait

        def run() -> None:
            if wait and self._stop.wait(wait):
                return
            with self._fleet.topology:
                if self._fleet.standbys.clock_addresses[index] != standby:
                    return
            try:
                failed = self._coordinator.restandby(index, list(names))
                log.warning("event=standby_caught_up shard=%d sessions=%s one_copy_sessions=%s", index,
                            ",".join(names), ",".join(failed) or "-")
            except Exception as exc:  # noqa: BLE001 - they go on with one copy meanwhile
                failed = list(names)
                log.error("event=standby_catch_up_failed shard=%d sessions=%s why=%s", index, ",".join(names),
                          f"{type(exc).__name__}: {exc}".splitlines()[0])
            if failed:  # asked again once their wait passed (a session closed meanwhile is not live: skipped)
                self.refollow_later(index, failed, standby)

        threading.Thread(target=run, name=f"optserve-refollow-{index}", daemon=True).start()

    def _restore(self, dead: list[int]) -> None:
        """Durable servers: the dead shards are started again at once, side by side (a lost
        machine takes all its shards), then their sessions are restored on them together (a
        session whose every shard died is restored at one version, see
        ``Coordinator.shards_restarted``)."""
        if not dead:
            return
        started = time.monotonic()
        for index in dead:
            sessions = self._coordinator.shard_down(index)
            log.error("event=shard_died shard=%d address=%s restoring_sessions=%s", index,
                      self._fleet.addresses[index], ",".join(sessions) or "-")
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(dead)) as pool:
            starts = {index: pool.submit(self._fleet.restart, index, True) for index in dead}
        failed = {index: start.exception() for index, start in starts.items() if start.exception() is not None}
        back = {index for index in dead if index not in failed} | self._holding  # failed: the next check
        lost, self._holding = self._coordinator.shards_restarted(sorted(back), waiting=sorted(failed))
        for index in sorted(back - self._holding):
            log.warning("event=shard_recovered shard=%d address=%s lost=%s seconds=%.2f", index,
                        self._fleet.addresses[index], ",".join(lost) or "-", time.monotonic() - started)
        if self._fleet.replicated:
            for index in sorted(back - self._holding):
                self.restandby_later(index)
        if failed:
            raise next(iter(failed.values()))
