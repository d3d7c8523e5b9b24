"""Shared pytest configuration. Server and Ray fixtures are session-scoped: one of each per run.

Fixtures other test files rely on (names are stable):
  ray_local: one local Ray instance for the whole run (``ray.init`` on loopback, no dashboard).
  server:    one embedded optserve server (coordinator + 2 shard actors) on a free 127.0.0.1 port,
             started in this process by :func:`optserve.server.app.start_server`; exposes
             ``.address`` ("127.0.0.1:PORT") and ``.config``.
  unique_name: a fresh session name per test (``"<test name>-<8 hex>"``).

``make test`` runs the suite in two passes: every module not marked ``serial`` on
pytest-xdist workers (``--dist loadscope``, which :func:`pytest_xdist_make_scheduler` turns into
:mod:`tests._scheduling`'s rules: a module with module-scoped fixtures whole on one worker, every
other test alone, longest first), then the ``serial`` modules alone (machine-wide memory, a mount
table copied into namespaces, bounds on latency under load).
"""

from __future__ import annotations

import os
import uuid

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# The suite's XLA compiles with the backend's (LLVM's) optimisation off, in this process and in every
# server, shard and worker it starts (they inherit the environment): its shapes are small, so most
# of a kernel test is compiling, which level 0 halves. Results may differ in the last bits from the
# default level's (no fused multiply-adds are formed), so every comparison in the suite is of two
# computations that both ran here, except against files a default-level server wrote, whose tests
# start their servers without this flag. `optserve serve`, the demo and the benchmarks compile at
# XLA's default.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the whole pytest run (started lazily, shut down at the end)."""
    import ray

    started_here = False
    if not ray.is_initialized():
        ray.init(
            address="local",  # a Ray of this process's own, whatever RAY_ADDRESS says
            include_dashboard=False,
            num_cpus=4,
            log_to_driver=False,
            configure_logging=False,
        )
        started_here = True
    yield ray
    if started_here:
        ray.shutdown()


@pytest.fixture(scope="session")
def server(ray_local):
    """One embedded server with 2 shards on a free loopback port, shared by every test."""
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig

    # min_shard_bytes=0: the tests' small models still spread over both shards (the multi-shard path).
    config = ServerConfig(host="127.0.0.1", port=0, shards=2, ray_address="local", vote_timeout_s=8.0,
                          min_shard_bytes=0)
    running = start_server(config)
    yield running
    running.stop()


@pytest.fixture
def unique_name(request) -> str:
    """A session name no other test uses."""
    return f"{request.node.name[:40]}-{uuid.uuid4().hex[:8]}"


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope`` (``make test``'s parallel pass): modules with module-scoped fixtures
    whole, every other test alone, longest first (:mod:`tests._scheduling`)."""
    if config.getoption("dist", None) != "loadscope":
        return None
    from tests._scheduling import make_scheduler

    return make_scheduler(config, log)
