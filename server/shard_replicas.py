"""A shard process's hot-standby roles (``docs/plans/hot_standby.md``): the primary of some
sessions' parts, whose steps it streams to their standbys in other shard processes, and the
standby of others' (:class:`ShardReplicas`, what :class:`~optserve.server.shard_actor.ShardActor`
delegates to).

A standby's part is built as a served part is (:class:`~optserve.server.shard_parts.ShardParts`)
but not served to clients: its follower keeps it in step with what the primary's ``ShardReplica``
stream brings (served on the shard's internal port, beside the clocks), until it is promoted and
served in the primary's place.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

from optserve.server.domain.errors import AlreadyExists, FailedPrecondition, NotFound, SessionLost
from optserve.server.domain.sessions import ShardOpening
from optserve.server.domain.shard import ShardRegistry
from optserve.server.domain.shard import StandbyFollower, Standbys
from optserve.server.shard_parts import ShardParts
from optserve.server.wire.replica_channel import ReplicaChannel, ReplicaTraffic
from optserve.server.wire.replica_service import ReplicaServicer, add_replica_service

log = logging.getLogger(__name__)


class ShardReplicas:
    """Args:
      parts: builds the standby's parts.
      registry: the parts this shard serves (a promoted standby joins them).
      serve_clock: ``(session, clock)``: serves a promoted home part's clock to its peers.
      internal: the server's internal trust (the streams to standbys use it).
      durable: the server keeps step logs (a promoted standby takes its part's files).
      traffic: counts the bytes of the streams to this shard's standbys.
      refuse_one_copy: ``--on-one-replica refuse``: a part with one copy in sync (let go by the
        coordinator, or promoted) acknowledges nothing until a fresh standby holds it.
    """

    def __init__(self, parts: ShardParts, registry: ShardRegistry, serve_clock: Callable, internal, durable: bool,
                 traffic: Optional[ReplicaTraffic] = None, refuse_one_copy: bool = False):
        self._parts = parts
        self._registry = registry
        self._serve_clock = serve_clock
        self._internal = internal
        self._durable = durable
        self._traffic = traffic
        self._refuse_one_copy = refuse_one_copy
        self.standbys = Standbys()
        self._channels: dict[str, ReplicaChannel] = {}
        self._unsynced: dict[str, str] = {}  # primary parts whose standby holds nothing more -> why
        self._lock = threading.Lock()

    def add_service(self, server, pool) -> None:
        """Serves ``ShardReplica`` (this process's standbys, and the coordinator's probes) on
        ``server`` (the internal port's)."""
        add_replica_service(server, ReplicaServicer(self.standbys.follower, pool, self.out_of_sync))

    def out_of_sync(self) -> list[str]:
        """Primary: sessions whose standby holds nothing more (it refused, or its stream broke).
        They acknowledge nothing until the coordinator, which alone knows whether the standby is
        gone or was promoted in this process's place, calls :meth:`go_on_alone`."""
        with self._lock:
            return sorted(self._unsynced)

    def go_on_alone(self, names, why: str) -> list[str]:
        """Primary: the coordinator lets sessions ``names`` (None: every session this process
        streams to a standby) go on with this one copy: they acknowledge with it, or, with
        ``--on-one-replica refuse``, acknowledge nothing until a fresh standby holds them. A step
        waiting for the standby fails UNAVAILABLE and its client's retry is not applied again.
        Returns the sessions let go."""
        if names is None:
            names = [s.config.name for s in self._registry.sessions()]
        with self._lock:
            channels = list(self._channels.values())
        let_go = []
        for name in names:
            session = self._registry.find(name)
            if session is not None:
                session.durability.refuse_one_copy = self._refuse_one_copy
                if session.durability.let_go(why):
                    let_go.append(name)
            for channel in channels:
                channel.forget(name)
            with self._lock:
                self._unsynced.pop(name, None)
        return let_go

    def follow(self, opening: ShardOpening, replace: bool = False) -> None:
        """Standby: holds a part of a session whose primary, another shard process, replicates it
        here (:meth:`replicate` there); with ``replace``, a part of it held already (its primary
        let it go: it refused a step, its stream broke or it fell behind) is dropped first.

        A durable server's standby writes no files while it follows (its primary does): it
        takes the session's files when it is promoted (:meth:`promote`).

        Raises:
          AlreadyExists: this process is the session's standby already.
          InvalidArgument: as when the part is opened to be served.
        """
        if replace:
            self._unfollow(opening.config.name)
        session = self._parts.build(opening, files=False)
        clock = session.clock if session.clock.is_home else None
        follower = StandbyFollower(session.durability.start_from, session.durability.follow, clock,
                                   list(opening.tensor_names), session.where)
        try:
            self.standbys.add(opening.config.name, session, follower)
        except AlreadyExists:
            follower.close()
            raise

    def set_replicated(self, name: str) -> None:
        """Primary: session ``name`` has standbys (see ``SessionDurability.set_replicated``)."""
        self._registry.get(name).durability.set_replicated()

    def replicate(self, name: str, standby_address: str) -> None:
        """Primary: starts session ``name``'s standby at ``standby_address`` (its shard's internal
        port) from this part's state now; from then on each step is acknowledged once the standby
        holds it too. Call :meth:`set_replicated` on every shard of the session first.

        Raises:
          NotFound: this shard serves no part of ``name``.
          Unavailable: the part is inside a step, or the stream to the standby is broken (ask again).
        """
        session = self._registry.get(name)
        session.durability.refuse_one_copy = self._refuse_one_copy
        session.durability.start_replica(self._channel(standby_address).port(name))

    def standby_missing(self, name: str, why: str) -> None:
        """Primary: session ``name``'s part here got no standby (its shard has none now): with
        ``--on-one-replica refuse`` it acknowledges nothing until a fresh standby holds it."""
        session = self._registry.find(name)
        if session is not None and self._refuse_one_copy:
            session.durability.refuse_one_copy = True
            session.durability.refuse_until_standby(why)

    def promote(self, name: str, timeout_s: float) -> int:
        """Standby: the primary is gone: applies every step held, then serves the session in its
        place (a home part's clock decides again and serves its peers). On a durable server the
        part takes the session's files first (this process owns the shard's files: see
        ``ShardActor.own_files``). Returns its version.

        Raises:
          NotFound: this process is no standby of ``name``.
          OptservError: the standby stopped following (not in sync: it must not serve).
          TimeoutError: the steps held were not all applied within ``timeout_s`` (ask again).
          FailedPrecondition: a durable server's standby that does not own the shard's files.
          OSError: a durable part's checkpoint could not be written (it must not serve).
        """
        follower = self.standbys.follower(name)
        if self._durable and self._parts.fence is None:
            raise FailedPrecondition(f"session {name!r}: a durable server's standby serves once it owns the shard's "
                                     f"files (own_files), and this one does not")
        version = follower.promote(timeout_s)
        session, _follower = self.standbys.take(name)
        try:
            session.durability.lead()
            if self._durable:
                self._parts.take_files(session)
        except BaseException as exc:
            session.abandon(SessionLost(f"session {name!r}: its promoted standby could not serve in its place: {exc}"))
            raise
        if self._refuse_one_copy:
            session.durability.refuse_one_copy = True
            session.durability.refuse_until_standby("it was promoted in its lost primary's place")
        if session.clock.is_home:
            self._serve_clock(name, session.clock)
        self._registry.add(session)
        log.warning("event=standby_promoted session=%s version=%d", name, version)
        return version

    def drop(self, name: str) -> None:
        """The session closed: its standby here (if any) follows no more; its stream port goes."""
        self._unfollow(name)
        with self._lock:
            channels = list(self._channels.values())
        for channel in channels:
            channel.forget(name)

    def _unfollow(self, name: str) -> None:
        """Session ``name``'s standby part here (if any) follows no more."""
        try:
            _session, follower = self.standbys.take(name)
        except NotFound:
            return
        follower.close()

    def stop(self) -> None:
        for name in self.standbys.names():
            self.drop(name)
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()

    def _out_of_sync(self, name: str, why: str) -> None:
        """Session ``name``'s standby holds nothing more: its part here waits for the coordinator
        (:meth:`out_of_sync`)."""
        if self._registry.find(name) is None:
            return  # closed
        with self._lock:
            self._unsynced[name] = why
        log.error("event=standby_out_of_sync session=%s why=%s (nothing is acknowledged until the coordinator "
                  "lets it go on with one copy)", name, why)

    def _channel(self, address: str) -> ReplicaChannel:
        """The stream to the standby process at ``address`` (a broken one is replaced)."""
        with self._lock:
            channel = self._channels.get(address)
            if channel is None or channel.broken is not None:
                stale, channel = channel, ReplicaChannel(address, self._internal, out_of_sync=self._out_of_sync,
                                                        traffic=self._traffic)
                self._channels[address] = channel
            else:
                stale = None
        if stale is not None:
            stale.close()
        return channel
