"""An elastic session on a durable server killed whole (SIGKILL) and started again: its history
(participants, scales, timings, why each round committed) and its parameters continue exactly."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

from optserve.client import Client
from tests._server_process import ServerProcess, free_port
from tests._service_helpers import make_params
from tests.test_elastic_sync import SGD, replay, worker_grads


def _server(port: int, checkpoint_dir: str) -> ServerProcess:
    return ServerProcess("--checkpoint-dir", checkpoint_dir, "--checkpoint-every-steps", "3", port=port).wait_listening()


def _rounds(sessions, params, count):
    with concurrent.futures.ThreadPoolExecutor(len(sessions)) as pool:
        for _ in range(count):
            for f in [pool.submit(s.push_pull, worker_grads(params, s.worker_id, s.version)) for s in sessions]:
                f.result()


@pytest.mark.slow
def test_elastic_history_and_params_survive_a_server_sigkill(tmp_path):
    port, checkpoint_dir = free_port(), str(tmp_path / "ckpt")
    address = f"127.0.0.1:{port}"
    params = make_params(31)
    first = _server(port, checkpoint_dir)
    second = None
    try:
        with Client(address, timeout=120.0) as client:
            owner = client.create_session("elastic", params, SGD, num_workers=3, min_workers=2)
            a, b = (client.session("elastic", worker_id=w) for w in ("a", "b"))
            _rounds([a, b], params, 5)  # a checkpoint at 3, rounds 4-5 in the logs and the journal
            before = a.history()
            assert [r.version for r in before] == [1, 2, 3, 4, 5]
            for s in (owner, a, b):
                s.detach()
        first.kill_group()
        second = _server(port, checkpoint_dir)
        with Client(address, timeout=120.0) as client:
            a, b = (client.session("elastic", worker_id=w) for w in ("a", "b"))
            assert a.version == 5
            assert a.history() == before  # exact: timings and reasons came back from the journal
            _rounds([a, b], params, 3)
            history = a.history()
            assert [r.version for r in history] == list(range(1, 9))
            got, want = a.pull(), replay(params, history)
            assert max(float(np.max(np.abs(got[n] - want[n]))) for n in params) < 1e-6
            a.detach(), b.detach()
        assert second.stop() == 0
    finally:
        for server in (first, second):
            if server is not None and server.process.poll() is None:
                server.kill_group()
