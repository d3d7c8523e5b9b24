"""gRPC health checking (``grpc.health.v1.Health``) and reflection on optserve's servers.

NOT_SERVING while a server starts and while it drains, SERVING in between. Health and reflection
answer without a token (probes and ``grpcurl``-style tools carry none): they reveal no session.
"""

from __future__ import annotations

import asyncio
from typing import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc


_LOOP_CALL_S = 10.0


class Health:
    """The health service of one gRPC server, for ``services`` (and the server as a whole, "")."""

    OPEN_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                     "grpc.reflection.v1.ServerReflection")

    def __init__(self, server: grpc.Server, services: Sequence[str]):
        # a server on an event loop (LoopServer: its `loop`) gets the asyncio servicer, whose
        # Watch holds no thread of its pool however long a watcher stays
        self._loop = getattr(server, "loop", None)
        self._servicer = health.HealthServicer() if self._loop is None else self._on_loop(_async_servicer)
        self._services = ("",) + tuple(services)
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
        self._set(health_pb2.HealthCheckResponse.NOT_SERVING)

    def _on_loop(self, coroutine_function, *args):
        return asyncio.run_coroutine_threadsafe(coroutine_function(*args), self._loop).result(_LOOP_CALL_S)

    def serve_also_on(self, server: grpc.Server) -> None:
        """Answers health checks on ``server`` too (e.g. a plaintext port for probes that cannot
        speak TLS), with the same status."""
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)

    def _set(self, status) -> None:
        for service in self._services:
            if self._loop is None:
                self._servicer.set(service, status)
            elif self._loop.is_running():
                self._on_loop(self._servicer.set, service, status)

    def serving(self) -> None:
        self._set(health_pb2.HealthCheckResponse.SERVING)

    def draining(self) -> None:
        self._set(health_pb2.HealthCheckResponse.NOT_SERVING)


async def _async_servicer():
    return health.aio.HealthServicer()


def enable_reflection(server: grpc.Server, services: Sequence[str]) -> None:
    """Lets tools list and describe ``services`` (full names) and the health service."""
    from grpc_reflection.v1alpha import reflection

    reflection.enable_server_reflection(tuple(services) + (health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                                           reflection.SERVICE_NAME), server)
