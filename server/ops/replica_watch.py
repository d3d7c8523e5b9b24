"""Watches hot standbys' pairs (``--replicas 2``) faster than Ray notices a lost host.

Ray declares a node dead seconds after it stops answering (docs/operating.md), and until then a
shard on it is neither dead nor serving. This watch probes every shard's primary and standby
process on their internal ports (``ShardReplica.Probe``) many times a second, and acts once one
side has been silent for ``silence_s`` while the other answers:

- **the primary silent**: its standby is promoted in its place (the coordinator's fail-over, as
  when the process died). The old primary may still be alive behind a partition; it can never
  acknowledge again: a step is acknowledged only once its standby holds it (the promoted standby
  holds nothing more of it) or once the coordinator let it go on alone (never, now);
- **the standby silent**: it is forgotten (killed, where Ray can still reach it) and its primary's
  sessions acknowledge with one copy; a fresh standby is started;
- **both answer, and the primary names sessions whose standby holds nothing more** (it refused
  them, their stream broke, or they fell behind): those go on with one copy (with
  ``--on-one-replica refuse``: they acknowledge nothing) while that standby is caught up on them
  again from the primary's memory (the other sessions it holds keep their two copies).

Both silent: nothing is done here (Ray's death, :class:`~optserve.server.ops.shard_watch.ShardWatch`).
Every decision is taken holding the fleet's ``topology`` lock, checking that the pair it probed is
still the shard's.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from optserve.protos.optserve.v1 import replica_pb2
from optserve.server.ops.periodic import Periodic
from optserve.server.wire.replica_service import SERVICE

log = logging.getLogger(__name__)


class _Prober:
    """One process's ``ShardReplica.Probe`` over a channel of its own. Probes are sent without
    waiting for the last one's answer (each has its own deadline), so a silent process never holds
    up the watch's rounds; answers are booked as they come (on gRPC's threads)."""

    def __init__(self, address: str, trust):
        self.address = address
        self._trust = trust
        self._channel = trust.channel(address)
        self._probe = self._channel.unary_unary(f"/{SERVICE}/Probe",
                                                request_serializer=replica_pb2.ProbeRequest.SerializeToString,
                                                response_deserializer=replica_pb2.ProbeAnswer.FromString)
        self._lock = threading.Lock()
        self.last_answer = time.monotonic()  # silence counts from now
        self.answered = False  # not yet since it is watched (a process just started, still loading)
        self.unanswered = 0  # probes unanswered (failed or past their deadline) since the last answer
        self.out_of_sync: list[str] = []

    def silent(self, now: float, silence_s: float, first_answer_s: float) -> bool:
        """Whether it answered no probe for ``silence_s`` (for ``first_answer_s`` while it never
        answered) and missed at least three (a watch that was itself held up sent none meanwhile:
        its own delay is not the process's silence)."""
        with self._lock:
            allowed = silence_s if self.answered else max(silence_s, first_answer_s)
            return now - self.last_answer > allowed and self.unanswered >= 3

    def silence(self, now: float) -> str:
        """How it was silent, for the log: seconds since its last answer and probes it missed."""
        with self._lock:
            since = "its last answer" if self.answered else "it was watched (it never answered)"
            return f"{now - self.last_answer:.2f} s since {since}, {self.unanswered} probes unanswered"

    def ask(self, timeout_s: float) -> None:
        """Sends one probe; its answer, or its failure once ``timeout_s`` passed, is booked."""
        future = self._probe.future(replica_pb2.ProbeRequest(), timeout=timeout_s, metadata=self._trust.metadata)
        future.add_done_callback(self._booked)

    def _booked(self, future) -> None:
        try:
            answer = future.result()
        except Exception:  # noqa: BLE001 - silent (not serving, unreachable, or too slow): not an answer
            with self._lock:
                self.unanswered += 1
            return
        with self._lock:
            self.last_answer, self.unanswered, self.answered = time.monotonic(), 0, True
            self.out_of_sync = list(answer.out_of_sync)

    def close(self) -> None:
        self._channel.close()


class ReplicaWatch(Periodic):
    """A daemon thread probing every ``period_s`` (see the module docstring).

    Args:
      fleet: the :class:`~optserve.server.shard_fleet.RayShardFleet` (replicated).
      coordinator: its :class:`~optserve.server.domain.sessions.Coordinator`.
      shard_watch: lets a primary go on alone and starts fresh standbys
        (:class:`~optserve.server.ops.shard_watch.ShardWatch`).
      trust: the server's internal trust (the probes carry its secret).
      silence_s: how long a process may not answer before it counts as lost.
      period_s, probe_timeout_s: between probes; how long one probe waits for its answer (None:
        ``silence_s``: a process that answers, however slowly under load, within that long is
        never taken for lost; probes do not wait for each other).
      first_answer_s: how long a process newly watched (a fresh standby, a server starting) may
        take to answer its first probe (at least ``silence_s``): one still loading is not lost.
    """

    failure_event = "replica_watch_failed"

    def __init__(self, fleet, coordinator, shard_watch, trust, silence_s: float = 0.5, period_s: float = 0.05,
                 probe_timeout_s: Optional[float] = None, first_answer_s: float = 10.0):
        super().__init__("optserve-replica-watch", period_s)
        self._fleet, self._coordinator, self._shard_watch, self._trust = fleet, coordinator, shard_watch, trust
        self._silence_s = silence_s
        self._probe_timeout_s = silence_s if probe_timeout_s is None else probe_timeout_s
        self._first_answer_s = first_answer_s
        self._probers: dict[str, _Prober] = {}

    def stop(self) -> None:
        super().stop()
        for prober in self._probers.values():
            prober.close()
        self._probers = {}

    def check_once(self) -> None:
        pairs = self._pairs()
        self._probe({address for pair in pairs for address in pair[1:] if address})
        now = time.monotonic()
        silent = {address for address, prober in self._probers.items()
                  if prober.silent(now, self._silence_s, self._first_answer_s)}
        lost = {index for index, primary, _ in pairs if primary in silent}
        failing = [(index, primary, standby) for index, primary, standby in pairs
                   if index in lost and standby is not None and standby not in silent]
        if failing:
            with self._fleet.topology:  # the primaries failed over are told nothing while any of them is
                self._fleet.silent_actors = [self._fleet.actors[index] for index, primary, standby in failing
                                             if self._current(index, primary, standby)]
                try:
                    for index, primary, standby in failing:
                        self._fail_over(index, primary, standby, self._probers[primary].silence(now))
                finally:
                    self._fleet.silent_actors = []
        for index, primary, standby in pairs:
            if standby is None or index in lost:
                continue
            if standby in silent:
                self._forget_standby(index, primary, standby, f"its standby at {standby} did not answer "
                                                              f"({self._probers[standby].silence(now)})")
            elif self._probers[primary].out_of_sync:
                self._let_go(index, primary, standby, self._probers[primary].out_of_sync)

    def _pairs(self) -> list[tuple[int, str, Optional[str]]]:
        """(shard index, its primary's internal address, its standby's or None), now."""
        with self._fleet.topology:
            standbys = self._fleet.standbys.clock_addresses
            return [(index, address, standbys[index]) for index, address in enumerate(self._fleet.clock_addresses)]

    def _probe(self, addresses: set) -> None:
        """Probes ``addresses`` (their answers are booked as they come; a process no longer
        watched is dropped)."""
        for gone in set(self._probers) - addresses:
            self._probers.pop(gone).close()
        for address in addresses - set(self._probers):
            self._probers[address] = _Prober(address, self._trust)
        for address in addresses:
            self._probers[address].ask(self._probe_timeout_s)

    def _current(self, index: int, primary: str, standby: str) -> bool:
        """Whether shard ``index``'s pair is still the one probed (``topology`` held)."""
        return (self._fleet.clock_addresses[index] == primary
                and self._fleet.standbys.clock_addresses[index] == standby)

    def _fail_over(self, index: int, primary: str, standby: str, silence: str) -> None:
        cause = f"its process at {primary} did not answer ({silence})"
        with self._fleet.topology:
            if not self._current(index, primary, standby):
                return
            address = self._fleet.addresses[index]
            lost = self._coordinator.fail_over(index, address, cause)
        if lost is None:  # durable: no standby took over. Dead, the shard watch restores it from its
            log.error("event=fail_over_without_standby shard=%d address=%s cause=%s", index, address,
                      cause.replace(" ", "_"))  # files; alive, it goes on with one copy until a fresh standby
            self._shard_watch.let_go(index, f"its standby could not take over when it was silent ({cause})")
            self._shard_watch.restandby_later(index)
            return
        log.error("event=shard_failed_over shard=%d address=%s new_address=%s lost_sessions=%s cause=%s", index,
                  address, self._fleet.addresses[index], ",".join(lost) or "-", cause.replace(" ", "_"))
        self._shard_watch.restandby_later(index)

    def _forget_standby(self, index: int, primary: str, standby: str, why: str) -> None:
        with self._fleet.topology:
            if not self._current(index, primary, standby):
                return
            self._fleet.forget_standby(index, why)
        self._shard_watch.let_go(index, why)
        self._shard_watch.restandby_later(index)

    def _let_go(self, index: int, primary: str, standby: str, names: list) -> None:
        """Sessions ``names`` go on with one copy (with ``--on-one-replica refuse``: they
        acknowledge nothing) until their standby, which lives on, is caught up on them again."""
        with self._fleet.topology:
            if not self._current(index, primary, standby):
                return
            let_go = self._fleet.go_on_alone(index, names, f"its standby at {standby} holds them no more")
        log.error("event=one_copy shard=%d sessions=%s why=standby_out_of_sync", index, ",".join(let_go) or "-")
        self._probers[primary].out_of_sync = []
        if let_go:  # the standby lives: it is caught up on them again
            self._shard_watch.refollow_later(index, let_go, standby)
