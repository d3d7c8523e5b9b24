"""A durable server killed whole (SIGKILL of its process group) and started again with the same
``--checkpoint-dir`` on the same port: every session comes back, and clients resume as if nothing
happened (the existing session object retries its step; a fresh client attaches)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from optserve.client import Client
from tests._service_helpers import InProcess, make_grads, make_params, max_abs_diff

OPTIMIZER = {"name": "adafactor_hf", "args": {"lr": 0.01, "relative_step": False, "beta1": 0.9}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """``optserve serve`` in its own process group."""

    def __init__(self, port: int, checkpoint_dir: str):
        env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
        env.pop("RAY_ADDRESS", None)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "optserve.server.cli", "serve", "--port", str(port), "--shards", "2",
             "--min-shard-bytes", "0", "--checkpoint-dir", checkpoint_dir, "--checkpoint-every-steps", "3"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        self.lines: list[str] = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            if line.startswith("optserve listening on "):
                threading.Thread(target=self._drain, daemon=True).start()
                return
        raise AssertionError("server did not start:\n" + "".join(self.lines[-30:]))

    def _drain(self):
        for line in self.process.stdout:
            self.lines.append(line)

    def kill_group(self):
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
        return self.process.wait()


@pytest.mark.slow
def test_whole_server_sigkill_and_restart_restores_sessions_and_clients_resume_exactly(tmp_path):
    port, checkpoint_dir = _free_port(), str(tmp_path / "ckpt")
    address = f"127.0.0.1:{port}"
    params = make_params(7)
    reference = InProcess(OPTIMIZER["name"], OPTIMIZER["args"], params)
    first = _Server(port, checkpoint_dir)
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
        second = _Server(port, checkpoint_dir)
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
