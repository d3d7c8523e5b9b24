"""The demo's own optserve server: loopback, a free port, a local Ray (pulled in only when started)."""

from __future__ import annotations

import contextlib

from optserve.demo.config import DemoConfig
from optserve.server.domain.config import ServerConfig


@contextlib.contextmanager
def embedded_server(cfg: DemoConfig):
    """An optserve server on a free loopback port with ``cfg.shards`` shards on a local Ray (shut
    down afterwards unless Ray was running already); yields its address."""
    print(f"optserve demo: starting an embedded server (local Ray, {cfg.shards} shards) ...", flush=True)
    from optserve.server.app import start_server  # pulls ray and jax

    ray_was_running = _ray_is_initialized()
    # The demo's model is small (tens of KB): min_shard_bytes=0 spreads it over every shard anyway,
    # so the demo runs the multi-shard path (fan-out, cross-shard votes) a large model takes.
    server = start_server(ServerConfig(host="127.0.0.1", port=0, shards=cfg.shards, ray_address="local",
                                       min_shard_bytes=0))
    try:
        yield server.address
    finally:
        server.stop()
        if not ray_was_running:
            _shutdown_ray()


def _ray_is_initialized() -> bool:
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()


def _shutdown_ray() -> None:
    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    except ImportError:
        pass
