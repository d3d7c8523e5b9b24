"""A durable server killed whole (SIGKILL of its process group) and started again with the same
``--checkpoint-dir`` on the same port: every session comes back, and clients resume as if nothing
happened (the existing session object retries its step; a fresh client attaches)."""

from __future__ import annotations

import threading

import pytest

from optserve.client import Client
from tests._server_process import ServerProcess, free_port
from tests._service_helpers import InProcess, make_grads, make_params, max_abs_diff

OPTIMIZER = {"name": "adafactor_hf", "args": {"lr": 0.01, "relative_step": False, "beta1": 0.9}}


def _server(port: int, checkpoint_dir: str) -> ServerProcess:
    """``optserve serve`` in its own process group, on ``port``, waited for."""
    return ServerProcess("--checkpoint-dir", checkpoint_dir, "--checkpoint-every-steps", "3", port=port).wait_listening()


@pytest.mark.slow
def test_whole_server_sigkill_and_restart_restores_sessions_and_clients_resume_exactly(tmp_path):
    port, checkpoint_dir = free_port(), str(tmp_path / "ckpt")
    address = f"127.0.0.1:{port}"
    params = make_params(7)
    reference = InProcess(OPTIMIZER["name"], OPTIMIZER["args"], params)
    first = _server(port, checkpoint_dir)
    second = None
    try:
        client = Client(address, timeout=150.0)
        session = client.create_session("survivor", params, optimizer=OPTIMIZER)
        for step in range(5):  # a checkpoint at 3, steps 4-5 in the logs
            grads = make_grads(params, step)
            got, expected = session.push_pull(grads), reference.step(grads)
        assert max_abs_diff(got, expected) <= 1e-6

        first.kill_group()
        # The same session object steps while the server is down: it waits and is served once the
        # restarted server restored the session (new shard addresses, read from the coordinator).
        result = {}
        grads = make_grads(params, 5)
        stepping = threading.Thread(target=lambda: result.update(params=session.push_pull(grads)))
        stepping.start()
        second = _server(port, checkpoint_dir)
        stepping.join(timeout=150)
        assert not stepping.is_alive() and "params" in result, "".join(second.lines[-30:])
        assert max_abs_diff(result["params"], reference.step(grads)) <= 1e-6

        with Client(address, timeout=60.0) as fresh_client:  # a fresh client attaches and trains on
            assert fresh_client.list_sessions() == ["survivor"]
            fresh = fresh_client.session("survivor")
            assert fresh.version == 6
            for step in range(6, 9):
                grads = make_grads(params, step)
                got, expected = fresh.push_pull(grads), reference.step(grads)
            assert max_abs_diff(got, expected) <= 1e-6
            status = fresh.status()
            assert status.version == 9
            assert [s.durability.recoveries for s in status.shards] == [1, 1]
            fresh.detach()
        client.close()
        assert second.stop() == 0
    finally:
        for server in (first, second):
            if server is not None and server.process.poll() is None:
                server.kill_group()
