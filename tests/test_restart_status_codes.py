"""While a shard restarts (a real SIGKILL of its actor process), control calls answer UNAVAILABLE,
which the SDK retries, never INTERNAL; and no status message a client sees carries a traceback or
terminal escape codes."""

from __future__ import annotations

import os
import signal
import time

import pytest

from optserve.client import Client
from optserve.client._retry import RetryPolicy
from optserve.client.errors import OptservError, UnavailableError
from tests._service_helpers import make_grads, make_params

OPTIMIZER = {"name": "adam", "args": {"learning_rate": 0.01}}


@pytest.fixture(scope="module")
def durable_server(ray_local, tmp_path_factory):
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig
    from optserve.server.domain.durability import DurabilityConfig

    running = start_server(ServerConfig(host="127.0.0.1", port=0, shards=2, min_shard_bytes=0, vote_timeout_s=8.0,
                                        durability=DurabilityConfig(str(tmp_path_factory.mktemp("codes")))))
    yield running
    running.stop()


def _clean(message: str) -> None:
    assert "Traceback" not in message and "\x1b[" not in message, message


def test_status_and_attach_during_a_shard_restart_are_unavailable_not_internal(durable_server, unique_name):
    params = make_params(5)
    with Client(durable_server.address, timeout=60.0) as client:
        session = client.create_session(unique_name, params, optimizer=OPTIMIZER)
        session.push_pull(make_grads(params, 0))
        os.kill(durable_server.fleet.pids()[1], signal.SIGKILL)
        seen = []
        with Client(durable_server.address, timeout=10.0, retry=RetryPolicy(attempts=1)) as impatient:
            deadline = time.monotonic() + 60
            recovered = False
            while time.monotonic() < deadline and not recovered:
                for call in (lambda: impatient.session(unique_name).status(), lambda: impatient.session(unique_name)):
                    try:
                        call()
                        recovered = len(seen) > 0
                    except OptservError as exc:
                        seen.append(exc)
                        _clean(str(exc))
                time.sleep(0.05)
        assert seen, "no call met the restart"
        assert all(isinstance(exc, UnavailableError) for exc in seen), [f"{type(e).__name__}: {e}" for e in seen]
        assert recovered
        session.push_pull(make_grads(params, 1))  # the SDK rides out what is left of the restart
        session.close()
