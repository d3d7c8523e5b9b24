"""Compute layer: the shard actor. A Ray actor that serves ShardData on its own gRPC port.

The coordinator reaches it over Ray (create / close sessions, status); clients reach it over
gRPC. Its sessions live in a :class:`~optserve.server.shard_servicer.ShardRegistry`.
"""

from __future__ import annotations

import logging
from concurrent import futures
from typing import Optional

from optserve.server.config import ServerConfig, SessionConfig

log = logging.getLogger(__name__)

GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.so_reuseport", 0),
    # Each stream may buffer this much beyond what the handler has read (default 64 KiB), so the
    # peer keeps sending chunks while this side copies the previous ones (~7% faster pushes).
    ("grpc.http2.lookahead_bytes", 16 << 20),
]


class ShardActor:
    """One shard: holds per-session :class:`ShardSession` state and serves its data plane.

    Args:
      index: shard index (0-based).
      config: the server's configuration (bind host, threads, timeouts).
      precond_pool: the server's :class:`~optserve.server.preconditioner_pool.PreconditionerPool`
        (``None``: no preconditioner workers).
    """

    def __init__(self, index: int, config: ServerConfig, precond_pool=None):
        import grpc
        import ray

        from optserve.protos.heap import retain_freed_memory
        from optserve.server.clock_endpoint import ClockEndpoint
        from optserve.server.shard_servicer import ShardRegistry, add_to_server

        retain_freed_memory()  # received chunks reuse freed memory instead of page-faulting fresh pages
        self._index = index
        self._config = config
        self._precond_pool = precond_pool.for_shard(index) if precond_pool is not None else None
        self._registry = ShardRegistry()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.grpc_threads), options=GRPC_OPTIONS)
        # ShardData with the copy-saving chunk codecs; half the threads at most for open PushPull
        # streams, the rest for everything else
        add_to_server(self._registry, self._server, max_open_streams=max(1, config.grpc_threads // 2))
        host = config.data_host
        port = self._server.add_insecure_port(f"{host}:0")
        self._server.start()
        advertised = ray.util.get_node_ip_address() if host in ("0.0.0.0", "::", "[::]", "") else host
        self._address = f"{advertised}:{port}"
        self._clocks = ClockEndpoint(host, advertised)  # clocks of the sessions this shard is home to
        self._node_id = ray.get_runtime_context().get_node_id()

    def address(self) -> str:
        return self._address

    def clock_address(self) -> str:
        """Where the other shards of the sessions this shard is home to reach their clocks."""
        return self._clocks.address

    def create_session(self, config: SessionConfig, tensor_names: list[str], participants: int,
                       home_clock: Optional[str] = None) -> None:
        """Holds ``tensor_names`` of a session spread over ``participants`` shards.

        ``home_clock``: the home shard's clock address; None: this shard is the session's home
        and keeps its clock.
        """
        from optserve.server.clock import LocalClock
        from optserve.server.clock_endpoint import PeerClock
        from optserve.server.shard_state import ShardSession

        if home_clock is None:
            clock = LocalClock(config, participants, reduce_timeout_s=self._config.step_timeout_s)
            if participants > 1:
                self._clocks.add(config.name, clock)
        else:
            clock = PeerClock(home_clock, config.name, reduce_timeout_s=self._config.step_timeout_s)
        self._registry.add(ShardSession(config, tensor_names, self._index, participants, clock,
                                        self._config.step_timeout_s, self._config.vote_timeout_s,
                                        precond_pool=self._precond_pool))

    def close_session(self, name: str) -> bool:
        self._clocks.remove(name)
        return self._registry.remove(name)

    def session_status(self, name: str) -> dict:
        status = self._registry.get(name).status()
        status["node_id"] = self._node_id
        return status

    def stop(self) -> None:
        self._server.stop(grace=0.5).wait()
        self._clocks.stop()
