"""Process host of a shard: the Ray actor that serves ShardData (the coordinator's handle on all
of them is :class:`~optserve.server.shard_fleet.RayShardFleet`).

A composition root: it builds each session's compute side (optimizer, updater, roots), its
domain side (the shard session and its clock) and serves them on the wire (data plane and clock
endpoint). The coordinator reaches the actors over Ray; clients reach them over gRPC.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os
import signal
import sys
from typing import Optional, Sequence

import ray

from optserve.protos import contract
from optserve.server.compute.compile_cache import compile_stats
from optserve.server.compute.devices import check_device, DeviceReport, DeviceRequest, ray_gpu_ids
from optserve.server.compute.heap import keep_large_buffers_on_heap, release_free_memory
from optserve.server.domain.config import ServerConfig
from optserve.server.domain.errors import SessionLost, Unavailable
from optserve.server.domain.sessions import ShardOpening
from optserve.server.domain.shard import ShardRegistry, ShardSessionStatus, StepObserver, log_value
from optserve.server.ops.health import Health
from optserve.server.ops.logs import configure_logging
from optserve.server.ops.memory_trace import start_from_environment as start_memory_trace
from optserve.server.ops.metrics import pack_families, resident_bytes, session_gauges, ShardMetrics
from optserve.server.shard_parts import ShardParts
from optserve.server.shard_replicas import ShardReplicas
from optserve.server.storage.ownership import ShardFence
from optserve.server.wire.clock_service import ClockServer
from optserve.server.wire.limits import server_options
from optserve.server.wire.loop_server import LoopServer
from optserve.server.wire.replica_channel import ReplicaTraffic
from optserve.server.wire.shard_servicer import add_to_server
from optserve.server.wire.thread_pool import ShrinkingThreadPool

log = logging.getLogger(__name__)


class ShardActor:
    """One shard: holds per-session state and serves its data plane (wrap with ``ray.remote``).

    Args:
      index: shard index (0-based).
      config: the server's configuration (bind host, threads, timeouts).
      security: the server's :class:`~optserve.server.wire.security.ServerSecurity` (TLS, tokens,
        internal secret).
      precond_pool: the server's :class:`~optserve.server.compute.preconditioner_pool.PreconditionerPool`
        (``None``: no preconditioner workers).
      ports: ``(data, clock)`` ports to bind if free (a restarted shard takes its predecessor's, so
        clients and peers find it where it was); 0 or a taken port: any free one.
      recovering: durable servers: sessions are being restored onto this shard; until
        :meth:`recovered`, a call naming a session it does not hold yet is UNAVAILABLE (retry), not
        NOT_FOUND.
      epoch: durable servers: the ownership epoch the server claimed for this actor
        (:func:`~optserve.server.storage.ownership.claim_shard`; 0: not fenced). Once a newer
        one is claimed (this shard was replaced while cut off), it exits before its next write.
    """

    def __init__(self, index: int, config: ServerConfig, security, precond_pool=None, ports: tuple = (0, 0),
                 recovering: bool = False, epoch: int = 0):
        if config.log_level is not None:
            configure_logging(config.log_level, exclusive=True)  # Ray forwards this process's stderr
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)  # where a shard hangs
        start_memory_trace(f"shard-{index}")  # OPTSERVE_TRACEMALLOC_DIR: where a long run's memory goes
        # first: where this actor's JAX runs; one given a GPU it cannot use serves nothing (the fleet refuses it)
        self._device = check_device(shard_device_request(config, index), ray_gpu_ids(), ray.util.get_node_ip_address())
        if self._device.problem:
            return
        keep_large_buffers_on_heap()  # received chunks and each step's tensor-sized buffers reuse freed memory
        self._index = index
        self._config = config
        self._registry = ShardRegistry(recovering=recovering)
        self._security = security
        self._metrics = ShardMetrics(index, lambda: session_gauges(self._registry.sessions(), str(index)))
        self._parts = ShardParts(index, config, security.internal,
                                 precond_pool.for_shard(index) if precond_pool is not None else None,
                                 fence_of_shard(config, index, epoch), self._observer)
        self._replicas = ShardReplicas(self._parts, self._registry, lambda name, clock: self._clocks.add(name, clock),
                                       security.internal, config.durability is not None,
                                       ReplicaTraffic(self._metrics.replica_sent_bytes.inc,
                                                      self._metrics.replica_received_bytes.inc),
                                       refuse_one_copy=config.on_one_replica == "refuse")
        self._server = LoopServer(ShrinkingThreadPool(config.grpc_threads, thread_name_prefix="optserve-data"),
                                  options=contract.SERVER_OPTIONS + server_options(config.limits),
                                  interceptors=security.interceptors(open_services=Health.OPEN_SERVICES),
                                  name="optserve-data-loop")
        self._health = Health(self._server, ("optserve.v1.ShardData",))
        # open PushPull calls wait on the event loop; past max_open_streams they end after their step
        # the steps run in a pool of their own: a unary call (a lease renewal) never queues behind them
        self._data = add_to_server(self._registry, self._server, max_open_streams=config.limits.max_open_streams,
                                   tokens=security.tokens,
                                   max_streams_per_tenant=config.limits.max_streams_per_tenant,
                                   step_pool=ShrinkingThreadPool(config.grpc_threads, thread_name_prefix="optserve-steps"))
        host = config.data_host
        port = _bind(lambda p: security.add_port(self._server, f"{host}:{p}"), ports[0])
        self._server.start()
        advertised = ray.util.get_node_ip_address() if host in ("0.0.0.0", "::", "[::]", "") else host
        self._address = f"{advertised}:{port}"
        # clocks of the sessions this shard is home to
        self._clocks = ClockServer(host, advertised, security.internal, port=ports[1],
                                   also=(self._replicas.add_service,))  # and the standbys' ShardReplica
        self._node_id = ray.get_runtime_context().get_node_id()
        self._health.serving()

    def device_report(self) -> DeviceReport:
        """Where this shard's JAX runs (with a ``problem``: it serves nothing)."""
        return self._device

    def address(self) -> str:
        return self._address

    def clock_address(self) -> str:
        """Where the other shards of the sessions this shard is home to reach their clocks."""
        return self._clocks.address

    def reachable(self, opening: ShardOpening) -> tuple[int, int, str, int, int]:
        """Durable servers: how far this shard's part of a session can be restored, read from disk
        without loading it (:meth:`ShardParts.reachable`); a session this shard still holds in
        memory: its version, twice, and no fallback.

        Raises:
          SessionLost: a damaged manifest or log record (the message names the file).
        """
        held = self._registry.find(opening.config.name)
        if held is not None:
            return held.version, held.version, "", -1, -1  # held in memory: nothing to roll back
        return self._parts.reachable(opening)

    def open_session(self, opening: ShardOpening, restore: bool = False, upto: Optional[int] = None) -> int:
        """Holds ``opening.tensor_names`` of a session (:meth:`ShardParts.build`: durable servers
        restore it with ``restore``, up to version ``upto``) and registers it on the data plane
        (the home shard of a multi-shard session serves its clock to the others). Returns the
        session's version on this shard.

        Raises:
          SessionLost, InvalidArgument: see :meth:`ShardParts.build`.
        """
        held = self._registry.find(opening.config.name)
        if restore and held is not None:  # a re-attached shard kept it in memory
            return held.version
        session = self._parts.build(opening, restore, upto)
        if opening.home_clock is None and opening.participants > 1:
            self._clocks.add(opening.config.name, session.clock)
        self._registry.add(session)
        if restore:
            log.warning("event=session_restored session=%s shard=%d version=%d", opening.config.name,
                        opening.shard_index, session.version)
        return session.version

    def recovered(self) -> None:
        """Every session this shard should hold is restored (see ``recovering``)."""
        self._registry.recovering = False

    def peer_up(self, shard_index: int, names: Sequence[str]) -> None:
        """Shard ``shard_index`` serves those sessions again (see :meth:`peer_down`)."""
        for session in self._sessions_named(names):
            if session.clock.is_home:
                session.clock.peer_up(shard_index)

    def _sessions_named(self, names: Sequence[str]) -> list:
        return [s for s in map(self._registry.find, names) if s is not None]

    def checkpoint_session(self, name: str) -> bool:
        """A checkpoint of the session's part here if it has steps since its last one, written
        before this returns (the session is about to be unloaded)."""
        session = self._registry.find(name)
        return bool(session is not None and session.durability.checkpoint_now())

    def checkpoint_all(self) -> int:
        """Durable servers, at shutdown: a checkpoint of every session with steps since its last
        one, written before this returns; returns how many were written."""
        return sum(bool(session.durability.checkpoint_now()) for session in self._registry.sessions())

    def peer_down(self, shard_index: int, names: Sequence[str]) -> None:
        """Shard ``shard_index`` died and is being restarted: the votes this shard's clocks hold
        for those sessions end now (UNAVAILABLE: the client retries) instead of at their timeout."""

        for session in self._sessions_named(names):
            if session.clock.is_home:
                session.clock.peer_down(shard_index, Unavailable(f"session {session.config.name!r}: shard "
                                                                 f"{shard_index} is restarting; nothing was applied, "
                                                                 f"retry"))

    def set_home_clock(self, name: str, address: str) -> None:
        """The session's home shard restarted at another clock address: peers call it there."""

        session = self._registry.find(name)
        if session is not None and not session.clock.is_home:
            session.clock.repoint(address)

    def close_session(self, name: str, reason: str = "") -> bool:
        """Drops the session's part on this shard; with a ``reason`` (the session was lost), calls
        still waiting in it fail with SessionLost(``reason``) instead of waiting out their timeouts."""

        session = self._registry.find(name)
        if session is not None and reason:
            session.abandon(SessionLost(reason))
        self._clocks.remove(name)
        self._replicas.drop(name)
        if session is not None:
            session.durability.close_store()
        removed = self._registry.remove(name)
        self._data.regions.reap()  # its shared-memory regions go now, not at the reaper's next sweep
        self._metrics.forget(name)
        if removed:  # its buffers are free: give their pages back now (the heap would keep up to 1 GiB of them)
            release_free_memory()
        return removed

    # hot standbys (server/shard_replicas.py)
    def follow_session(self, opening: ShardOpening, replace: bool = False) -> None:
        """Standby of a session part another shard process serves (:meth:`ShardReplicas.follow`)."""
        self._replicas.follow(opening, replace)

    def set_replicated(self, name: str) -> None:
        self._replicas.set_replicated(name)

    def replicate_session(self, name: str, standby_address: str) -> None:
        """Primary: starts the standby at ``standby_address`` (:meth:`ShardReplicas.replicate`)."""
        self._replicas.replicate(name, standby_address)

    def standby_missing(self, name: str, why: str) -> None:
        self._replicas.standby_missing(name, why)

    def go_on_alone(self, names=None, why: str = "") -> list:
        """Primary: the coordinator lets these sessions acknowledge with one copy
        (:meth:`ShardReplicas.go_on_alone`)."""
        return self._replicas.go_on_alone(names, why)

    def own_files(self, epoch: int) -> None:
        """Standby of a durable server, about to be promoted: shard ``index``'s files are this
        process's from now on, at ownership ``epoch`` (claimed for it by the server, which fences
        the lost primary: it exits before its next write). Until :meth:`recovered`, a session it
        does not hold may still be restored here from its files (see ``restore_unpromoted``):
        calls naming one are UNAVAILABLE, retried."""
        self._parts.fence = fence_of_shard(self._config, self._index, epoch)
        self._registry.recovering = True

    def promote_session(self, name: str, timeout_s: float = 30.0) -> int:
        """Standby: serves the session in its lost primary's place (:meth:`ShardReplicas.promote`)."""
        return self._replicas.promote(name, timeout_s)

    def internal_trust(self):
        """The internal endpoints' secret and TLS identity this shard was started with (a
        re-attaching coordinator gives the same to the shards it starts)."""
        return self._security.internal

    def compile_stats(self) -> dict:
        """This process's XLA compilations and shared compiled updates
        (:func:`~optserve.server.compute.compile_cache.compile_stats`)."""

        return compile_stats()

    def pid(self) -> int:
        """The shard's process id (operators and fault tests kill it)."""

        return os.getpid()

    def _observer(self, session: str):
        """The session's metrics observer; a no-op one when the server exports no metrics."""

        return self._metrics.observer(session) if self._config.metrics_port is not None else StepObserver()

    def session_series(self, name: str):
        """The series the session's home shard keeps: ``(accepted, refused, rounds)`` records
        (rounds: the ``RoundRecord`` of each version, every mode)."""
        session = self._registry.get(name)
        accepted, refused = session.series.snapshot() if session.series is not None else ([], [])
        rounds = session.home.history(0) if session.series is not None else []
        return accepted, refused, rounds

    def session_activity(self) -> dict:
        """Session name -> its last activity on this shard (unix seconds)."""
        return self._registry.activity()

    def metrics(self) -> bytes:
        """This shard's metric families (prometheus ``Metric`` objects), read now, packed
        (``ops.metrics.pack_families``)."""
        return pack_families(self._metrics.collect())

    def server_status(self) -> dict:
        """``{"node_id", "sessions", "param_bytes", "resident_bytes", "device", "in_sync",
        "replicated"}`` of this shard, now (``device``: its :class:`DeviceReport`; ``in_sync``:
        sessions whose standby holds their start and every step acknowledged, of the
        ``replicated`` ones: it could serve in their place)."""
        sessions = self._registry.sessions()
        unsynced = set(self._replicas.out_of_sync())
        return {"node_id": self._node_id, "sessions": len(sessions),
                "param_bytes": sum(s.updater.param_bytes() for s in sessions), "resident_bytes": resident_bytes(),
                "device": self._device,
                "in_sync": sum(s.durability.standby_started and s.config.name not in unsynced for s in sessions),
                "replicated": sum(s.config.replicas == 2 for s in sessions)}

    def session_status(self, name: str) -> ShardSessionStatus:
        return dataclasses.replace(self._registry.get(name).status(), node_id=self._node_id)

    def drain(self) -> None:
        """Health says NOT_SERVING (load balancers and probes stop sending new work)."""
        self._health.draining()

    def stop(self) -> None:
        self._health.draining()
        self._server.stop(grace=0.5)
        self._replicas.stop()
        self._clocks.stop()


def shard_device_request(config: ServerConfig, index: int = -1) -> DeviceRequest:
    """What shard ``index`` asks Ray for (any shard's Ray options: ``index`` -1)."""
    return DeviceRequest("shard" if index < 0 else f"shard {index}", "--gpus-per-shard", config.gpus_per_shard,
                         config.gpu_rehearsal)


def fence_of_shard(config: ServerConfig, index: int, epoch: int) -> Optional[ShardFence]:
    """Shard ``index``'s fence on its files (durable servers given an epoch), watched from now on;
    a superseded shard logs ``event=shard_fenced`` and exits its process at once (see
    :mod:`~optserve.server.storage.ownership`)."""
    if config.durability is None or epoch <= 0:
        return None
    fence = ShardFence(config.durability.checkpoint_dir, index, epoch, on_superseded=_exit_fenced)
    fence.check("serving")
    fence.watch()
    return fence


def _exit_fenced(message: str) -> None:
    log.error("event=shard_fenced %s", log_value(message))
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(FENCED_EXIT_CODE)


FENCED_EXIT_CODE = 75  # a superseded shard's exit status (EX_TEMPFAIL)


def _bind(add_port, port: int) -> int:
    """``add_port(port)`` (a gRPC server's), falling back to any free port if ``port`` is taken."""
    if port:
        try:
            return add_port(port)
        except RuntimeError:
            log.warning("port %d is taken: the restarted shard listens on another one", port)
    return add_port(0)
