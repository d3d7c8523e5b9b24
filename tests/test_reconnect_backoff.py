"""A whole durable server SIGKILLed and started again on the same port: a client that kept its
session steps again within seconds of the new server listening, however long the server was down.

gRPC's default reconnect backoff grows 1.6x per failed dial (from 1 s, up to 120 s), and a channel
waiting out its backoff fails every call at once without dialling: after half a minute down, the
first step came 7-22 s after the new server listened (measured with gRPC's defaults). The SDK's
channels dial at least once a second (``contract.RECONNECT_OPTIONS``), and a shard that serves at
a new address gets fresh shared-memory regions before the step is resent (its predecessor's are
unknown to it: one more refusal and backoff otherwise).
"""

from __future__ import annotations

import threading
import time

import pytest

from optserve.client import Client
from tests._server_process import ServerProcess, free_port
from tests._service_helpers import InProcess, make_grads, make_params, max_abs_diff

OPTIMIZER = {"name": "sgd", "args": {"learning_rate": 0.1}}
# Before the new server starts (it takes a few seconds more to listen): by then gRPC's default
# backoff leaves 10-17 s between dials (at about 16, 26 and 43 s down).
DOWNTIME_S = 20.0
FIRST_STEP_WITHIN_S = 5.0


def _server(port: int, checkpoint_dir: str) -> ServerProcess:
    return ServerProcess("--checkpoint-dir", checkpoint_dir, port=port)


def _kill_tree(server: ServerProcess) -> None:
    """SIGKILL of the server and every process under it, its shard actors included (Ray puts
    each worker in a process group of its own, which a signal to the server's group misses)."""
    import psutil

    tree = psutil.Process(server.process.pid).children(recursive=True)
    for process in tree:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    server.kill_group()
    psutil.wait_procs(tree, timeout=30)


@pytest.mark.slow
def test_a_client_steps_within_seconds_of_a_restarted_server_listening_after_a_long_downtime(tmp_path):
    port, checkpoint_dir = free_port(), str(tmp_path / "ckpt")
    params = make_params(3)
    reference = InProcess(OPTIMIZER["name"], OPTIMIZER["args"], params)
    first = _server(port, checkpoint_dir).wait_listening()
    second = None
    try:
        client = Client(f"127.0.0.1:{port}", timeout=180.0)
        session = client.create_session("restarts", params, optimizer=OPTIMIZER)
        for step in range(3):
            grads = make_grads(params, step)
            session.push_pull(grads)
            reference.step(grads)

        _kill_tree(first)
        acknowledged = {}
        grads = make_grads(params, 3)

        def step_through_the_outage():  # the SDK retries (and its channels dial) all along the outage
            got = session.push_pull(grads)
            acknowledged.update(at=time.monotonic(), params=got)

        stepping = threading.Thread(target=step_through_the_outage, daemon=True)
        stepping.start()
        time.sleep(DOWNTIME_S)
        second = _server(port, checkpoint_dir)
        second.wait_listening()
        listening_at = time.monotonic()
        stepping.join(timeout=120)
        assert "at" in acknowledged, "the step was not acknowledged:\n" + "".join(second.lines[-30:])
        took = acknowledged["at"] - listening_at
        assert took <= FIRST_STEP_WITHIN_S, f"first step {took:.1f} s after the restarted server listened"
        assert max_abs_diff(acknowledged["params"], reference.step(grads)) <= 1e-6  # applied once
        assert session.version == 4
        session.close()
        client.close()
    finally:
        for server in (first, second):
            if server is not None and server.process.poll() is None:
                _kill_tree(server)
