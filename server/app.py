"""Server startup as a function: Ray, the shard actors, and the Control gRPC server.

``start_server(config)`` works in-thread (tests, benchmarks) and under the CLI alike. What can be
checked without starting anything is checked first, in about a second: the checkpoint folder's
lock (one server per folder), the ports to listen on, and the Ray cluster to join
(:class:`~optserve.server.preflight.StartError`).

Ray, the shard fleet (Ray and, through the shard actor, JAX) and the metrics endpoint
(prometheus) are imported by the steps that start them, so importing this module stays light.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from concurrent import futures
from typing import Callable, Optional

import grpc

from optserve.protos import contract
from optserve.server.compute.preconditioner_pool import PoolConfig, PreconditionerPool, start_workers
from optserve.server.domain.config import ServerConfig
from optserve.server.domain.events import log_event
from optserve.server.domain.sessions import Coordinator
from optserve.server.ops.health import Health, enable_reflection
from optserve.server.ops.leases import SessionLeases
from optserve.server.ops.memory_trace import start_from_environment as start_memory_trace
from optserve.server.ops.replica_watch import ReplicaWatch
from optserve.server.ops.shard_watch import ShardWatch
from optserve.server.preflight import StartError, check_ports  # noqa: F401 - StartError: what start_server raises
from optserve.server.ray_lifecycle import join_or_start_ray, stop_started_ray
from optserve.server.storage import SessionCatalog
from optserve.server.storage.dir_lock import DirLock
from optserve.server.wire.control_servicer import ControlServicer, add_to_server as add_control_to_server
from optserve.server.wire.limits import server_options
from optserve.server.wire.security import ServerSecurity
from optserve.server.wire.thread_pool import ShrinkingThreadPool

log = logging.getLogger(__name__)

_ANY_INTERFACE = ("0.0.0.0", "", "::", "[::]")


@dataclasses.dataclass
class RunningServer:
    """A started server: ``address`` is the coordinator's "host:port"; ``stop()`` tears it down."""

    address: str
    config: ServerConfig
    shard_addresses: list[str]
    clock_addresses: list[str]  # the shards' internal endpoints (only server processes may call them)
    _stop: Callable[[], None]
    precond_workers: list = dataclasses.field(default_factory=list)  # Ray actor handles
    metrics_address: Optional[str] = None  # "host:port" serving /metrics (None: off)
    health_address: Optional[str] = None  # "host:port" of the plaintext health port (None: off)
    _drain: Callable[[], None] = lambda: None
    fleet: object = None  # the RayShardFleet (operators' and fault tests' handle on the shard actors)

    def drain(self) -> None:
        """Health checks answer NOT_SERVING on every port; calls are still served."""
        self._drain()

    def stop(self) -> None:
        self._stop()


def start_server(config: ServerConfig) -> RunningServer:
    """Starts the coordinator and ``config.shards`` shard actors; returns once all serve.

    Before Ray starts or anything is written, a durable server locks its checkpoint folder for its
    lifetime (released by ``stop()``), and the ports and the Ray cluster are checked.

    Raises:
      InvalidArgument: a TLS or token file cannot be read (naming the flag), before anything starts.
      DirectoryLocked: another live server holds ``--checkpoint-dir`` (naming its pid and host).
      StartError: a port cannot be listened on, the Ray cluster to join does not answer, or a shard
        placed on another machine than this one could not serve there: it would advertise a
        loopback address or listen on another machine's (``shard_placement.shard_host_refusal``).
      Any other error starting a part: what was started is stopped first.
    """
    security = ServerSecurity.from_config(config)
    teardown = contextlib.ExitStack()  # undone in reverse: by stop(), or at once if starting fails
    try:
        _check_and_lock(config, teardown)
        tracing = start_memory_trace("server")  # OPTSERVE_TRACEMALLOC_DIR: where a long run's memory goes
        if tracing is not None:
            teardown.callback(tracing.stop)
        pool = _start_precond_pool(config, teardown)
        fleet = _start_fleet(config, security, pool, teardown)
        coordinator = _start_coordinator(config, fleet, security, teardown)
        address, health = _serve_control(config, security, coordinator, teardown)
        health_address = _serve_health_port(config, health, teardown)
        metrics_address = _serve_metrics(config, fleet, coordinator, teardown)
        teardown.callback(health.draining)
        health.serving()
    except BaseException:
        teardown.close()
        raise
    _log_started(config, address, fleet)

    def drain():
        health.draining()
        fleet.drain()

    return RunningServer(address, config, list(fleet.addresses), list(fleet.clock_addresses), teardown.close,
                         pool.workers if pool is not None else [], metrics_address, health_address, drain, fleet)


def _check_and_lock(config: ServerConfig, teardown: contextlib.ExitStack) -> None:
    """A durable server's checkpoint folder locked (first, and released last: after the final
    checkpoints), the ports checked, and Ray joined or started (stopped at teardown if started here)."""
    if config.durability is not None:
        teardown.callback(DirLock.acquire(config.durability.checkpoint_dir).release)
    check_ports(config)
    if join_or_start_ray(config.ray_address, log_to_driver=config.log_level is not None):
        teardown.callback(stop_started_ray)


def _start_precond_pool(config: ServerConfig, teardown: contextlib.ExitStack) -> Optional[PreconditionerPool]:
    """The preconditioner workers (None: ``--precond-workers 0``); a durable server's on a
    cluster are detached, so they outlive this coordinator."""
    if config.precond_workers <= 0:
        return None
    import ray

    from optserve.server.shard_fleet import DETACHED_NAMESPACE, detached_prefix

    pool_config = PoolConfig(config.precond_workers, config.gpus_per_precond_worker, config.precond_f64,
                             rehearsal=config.gpu_rehearsal)
    detached = None
    if config.durability is not None and config.ray_address != "local":  # outlive this coordinator
        detached = (detached_prefix(config), DETACHED_NAMESPACE)
    pool = PreconditionerPool(start_workers(pool_config, detached), pool_config)
    teardown.callback(lambda: [ray.kill(worker) for worker in pool.workers])
    return pool


def _start_fleet(config: ServerConfig, security: ServerSecurity, pool: Optional[PreconditionerPool],
                 teardown: contextlib.ExitStack):
    """The shard actors, started (stopped at teardown)."""
    from optserve.server.shard_fleet import start_shards

    fleet = start_shards(config, security, pool)
    teardown.callback(fleet.stop)
    return fleet


def _start_coordinator(config: ServerConfig, fleet, security: ServerSecurity,
                       teardown: contextlib.ExitStack) -> Coordinator:
    """The coordinator over ``fleet`` (a durable one with every saved session restored), and the
    operator threads that watch the shards and end idle sessions (stopped at teardown)."""
    catalog = None
    if config.durability is not None:
        catalog = SessionCatalog(config.durability.checkpoint_dir)
        teardown.callback(_final_checkpoints, fleet)  # after the servers stopped, before the fleet
    coordinator = Coordinator(fleet, min_shard_bytes=config.min_shard_bytes, catalog=catalog, limits=config.limits,
                              precond_workers=config.precond_workers > 0)
    if catalog is not None:
        restored = coordinator.restore_all()
        for index in range(config.shards):
            fleet.recovered(index)
        log.warning("event=sessions_restored count=%d lost=%d", len(restored), len(coordinator.lost_sessions()))
    watch = ShardWatch(fleet, coordinator).start()  # stopped before the fleet (teardown runs in reverse)
    teardown.callback(watch.stop)
    if fleet.replicated:
        pairs = ReplicaWatch(fleet, coordinator, watch, security.internal, config.replica_silence_s).start()
        teardown.callback(pairs.stop)
    if config.session_idle_s is not None:
        leases = SessionLeases(coordinator, config.session_idle_s).start()
        teardown.callback(leases.stop)
    return coordinator


def _serve_control(config: ServerConfig, security: ServerSecurity, coordinator: Coordinator,
                   teardown: contextlib.ExitStack) -> tuple[str, Health]:
    """The Control gRPC server, started; returns its "host:port" and its health service."""
    server = grpc.server(ShrinkingThreadPool(config.grpc_threads, thread_name_prefix="optserve-control"),
                         options=contract.SERVER_OPTIONS + server_options(config.limits),
                         interceptors=security.interceptors(open_services=Health.OPEN_SERVICES))
    add_control_to_server(ControlServicer(coordinator, security.tokens), server)
    health = Health(server, ("optserve.v1.Control",))
    enable_reflection(server, ("optserve.v1.Control",))
    port = security.add_port(server, f"{config.host}:{config.port}")
    server.start()
    teardown.callback(lambda: server.stop(grace=0.5).wait())
    return f"{_advertised_host(config)}:{port}", health


def _serve_health_port(config: ServerConfig, health: Health, teardown: contextlib.ExitStack) -> Optional[str]:
    """``--health-port``: plaintext, health only, for probes that cannot speak TLS; its "host:port"
    (None: off)."""
    if config.health_port is None:
        return None
    health_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=contract.SERVER_OPTIONS)
    health.serve_also_on(health_server)
    port = health_server.add_insecure_port(f"{config.host}:{config.health_port}")
    health_server.start()
    teardown.callback(lambda: health_server.stop(grace=0.5).wait())
    return f"{_advertised_host(config)}:{port}"


def _serve_metrics(config: ServerConfig, fleet, coordinator: Coordinator,
                   teardown: contextlib.ExitStack) -> Optional[str]:
    """``--metrics-port``: Prometheus metrics of every shard and the coordinator; its "host:port"
    (None: off)."""
    if config.metrics_port is None:
        return None
    from optserve.server.ops.metrics import FleetCollector, serve_metrics

    collector = FleetCollector(lambda: [f for f in fleet.shard_reports("metrics") if f is not None],
                               lambda: len(coordinator.list_all()))
    metrics_server, metrics_port = serve_metrics(config.metrics_host, config.metrics_port, collector)
    teardown.callback(metrics_server.server_close)
    teardown.callback(metrics_server.shutdown)
    metrics_address = f"{config.metrics_host}:{metrics_port}"
    log.info("optserve metrics at http://%s/metrics", metrics_address)
    return metrics_address


def _advertised_host(config: ServerConfig) -> str:
    """The host clients on this machine reach ``--host`` at (loopback for any interface)."""
    return "127.0.0.1" if config.host in _ANY_INTERFACE else config.host


def _log_started(config: ServerConfig, address: str, fleet) -> None:
    log_event(log, logging.INFO, "server_started", address=address, shards=",".join(fleet.addresses))
    for report in fleet.devices:
        if report.gpu_ids or report.backend != "cpu":
            log_event(log, logging.INFO, "device", **report.fields())
    if config.durability is None:
        log.warning("sessions are not durable: a shard process that dies loses the sessions it holds "
                    "(they answer DATA_LOSS), and a server restart loses every session (see --checkpoint-dir)")
    else:
        d = config.durability
        log.info("sessions are durable in %s: checkpoints every %d steps or %g s, step log fsync at %s",
                 d.checkpoint_dir, d.every_steps, d.every_s, d.fsync.value)


def _final_checkpoints(fleet) -> None:
    """Durable servers, stopping: a checkpoint of every session with steps since its last one."""
    try:
        written = fleet.checkpoint_all()
        log.info("event=final_checkpoints written=%d", written)
    except Exception:  # noqa: BLE001 - the step logs still hold every acknowledged step
        log.exception("event=final_checkpoints_failed")
