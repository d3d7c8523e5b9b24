"""Process host of a shard: the Ray actor that serves ShardData, and the coordinator's handle on
all of them (:class:`RayShardFleet`).

A composition root: it builds each session's compute side (optimizer, updater, roots), its
domain side (the shard session and its clock) and serves them on the wire (data plane and clock
endpoint). The coordinator reaches the actors over Ray; clients reach them over gRPC.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent import futures
from typing import Sequence

from optserve.server.domain.config import ServerConfig
from optserve.server.domain.coordinator import ShardOpening
from optserve.server.domain.errors import unwrap
from optserve.server.domain.shard_session import ShardSessionStatus

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
    """

    def __init__(self, index: int, config: ServerConfig, security, precond_pool=None):
        import grpc
        import ray

        from optserve.protos import contract
        from optserve.protos.heap import retain_freed_memory
        from optserve.server.domain.shard_session import ShardRegistry
        from optserve.server.wire.clock_service import ClockServer
        from optserve.server.wire.shard_servicer import add_to_server

        retain_freed_memory()  # received chunks reuse freed memory instead of page-faulting fresh pages
        self._index = index
        self._config = config
        self._precond_pool = precond_pool.for_shard(index) if precond_pool is not None else None
        self._registry = ShardRegistry()
        self._security = security
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.grpc_threads),
                                   options=contract.SERVER_OPTIONS, interceptors=security.interceptors())
        # half the threads at most for open PushPull streams, the rest for everything else
        add_to_server(self._registry, self._server, max_open_streams=max(1, config.grpc_threads // 2),
                      tokens=security.tokens)
        host = config.data_host
        port = security.add_port(self._server, f"{host}:0")
        self._server.start()
        advertised = ray.util.get_node_ip_address() if host in ("0.0.0.0", "::", "[::]", "") else host
        self._address = f"{advertised}:{port}"
        self._clocks = ClockServer(host, advertised, security.internal)  # clocks of the sessions this shard is home to
        self._node_id = ray.get_runtime_context().get_node_id()

    def address(self) -> str:
        return self._address

    def clock_address(self) -> str:
        """Where the other shards of the sessions this shard is home to reach their clocks."""
        return self._clocks.address

    def open_session(self, opening: ShardOpening) -> None:
        """Holds ``opening.tensor_names`` of a session: builds its optimizer (once), updater,
        clock (home shard) or clock handle (others), and registers it on the data plane."""
        from optserve.server.compute.root_offload import build_shard_optimizer
        from optserve.server.compute.updater import Updater
        from optserve.server.domain.clock import LocalClock
        from optserve.server.domain.shard_session import ShardSession
        from optserve.server.wire.clock_service import PeerClock

        config = opening.config
        by_name = config.spec_by_name
        optimizer, preconditioners = build_shard_optimizer(
            config.optimizer_name, config.optimizer_args, {n: by_name[n].shape for n in opening.tensor_names},
            self._precond_pool, in_process=config.preconditioners.in_process,
            max_age=config.preconditioners.max_age)
        if opening.home_clock is None:
            clock = LocalClock(config, opening.participants, reduce_timeout_s=self._config.step_timeout_s)
            if opening.participants > 1:
                self._clocks.add(config.name, clock)
        else:
            clock = PeerClock(opening.home_clock, config.name, self._security.internal,
                              reduce_timeout_s=self._config.step_timeout_s)
        self._registry.add(ShardSession(config, list(opening.tensor_names), opening.shard_index, clock,
                                        Updater(optimizer, preconditioners), self._config.step_timeout_s,
                                        self._config.vote_timeout_s, owner=opening.owner, creator=opening.creator))

    def close_session(self, name: str) -> bool:
        self._clocks.remove(name)
        return self._registry.remove(name)

    def session_status(self, name: str) -> ShardSessionStatus:
        return dataclasses.replace(self._registry.get(name).status(), node_id=self._node_id)

    def stop(self) -> None:
        self._server.stop(grace=0.5).wait()
        self._clocks.stop()


class RayShardFleet:
    """The coordinator's :class:`~optserve.server.domain.coordinator.ShardFleet` over Ray actors.

    Args:
      actors: shard actor handles, index = position.
    """

    def __init__(self, actors: list):
        import ray

        self.actors = actors
        self.addresses = ray.get([a.address.remote() for a in actors])
        self.clock_addresses = ray.get([a.clock_address.remote() for a in actors])

    def open_session(self, openings: Sequence[ShardOpening]) -> None:
        _ray_get([self.actors[o.shard_index].open_session.remote(o) for o in openings])

    def close_session(self, name: str) -> None:
        _ray_get([a.close_session.remote(name) for a in self.actors])

    def session_status(self, name: str, shard_indices: Sequence[int]) -> list[ShardSessionStatus]:
        return _ray_get([self.actors[i].session_status.remote(name) for i in shard_indices])


def _ray_get(refs):
    import ray

    try:
        return ray.get(refs)
    except Exception as exc:  # re-raise the domain error inside a RayTaskError
        raise unwrap(exc) from None


def start_shards(config: ServerConfig, security, precond_pool=None) -> RayShardFleet:
    """Starts ``config.shards`` shard actors (actor options in one place); returns once all serve."""
    import ray

    options = {"num_cpus": 0, "max_concurrency": 16}
    if config.gpus_per_shard > 0:  # the actor's JAX then sees (only) the GPUs Ray assigned it
        options["num_gpus"] = config.gpus_per_shard
    cls = ray.remote(ShardActor).options(**options)
    return RayShardFleet([cls.remote(i, config, security, precond_pool) for i in range(config.shards)])
