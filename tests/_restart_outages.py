"""The outage checks of ``test_durability_restart``'s one whole-server restart that look at the
server rather than a session's numbers: a client that kept its session steps again within seconds
of the new server listening (restarts), one server per checkpoint folder (locked), and a server down
named by the address the user gave (gone). Each has the test's four moments: ``before_kill``,
``while_down``, ``after_restart`` (and ``Locked.after_stop``)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from optserve.client import Client
from optserve.client.errors import UnavailableError
from optserve.server.storage.dir_lock import DirLock
from tests._server_process import ServerProcess
from tests._service_helpers import InProcess, make_grads, make_params, max_abs_diff

SURVIVOR_OPTIMIZER = {"name": "adafactor_hf", "args": {"lr": 0.01, "relative_step": False, "beta1": 0.9}}


# --- restarts: a client steps within seconds of the restarted server listening, after a long downtime

RECONNECT_OPTIMIZER = {"name": "sgd", "args": {"learning_rate": 0.1}}
# Before the new server starts (it takes a few seconds more to listen): by then gRPC's default
# backoff leaves 10-17 s between dials (at about 16, 26 and 43 s down).
DOWNTIME_S = 20.0
FIRST_STEP_WITHIN_S = 5.0


class Reconnect:
    def __init__(self):
        self.params = make_params(3)
        self.reference = InProcess(RECONNECT_OPTIMIZER["name"], RECONNECT_OPTIMIZER["args"], self.params)

    def before_kill(self, address: str) -> None:
        self.client = Client(address, timeout=180.0)
        self.session = self.client.create_session("restarts", self.params, optimizer=RECONNECT_OPTIMIZER)
        for step in range(3):
            grads = make_grads(self.params, step)
            self.session.push_pull(grads)
            self.reference.step(grads)

    def while_down(self) -> None:
        self.acknowledged = {}
        self.grads = make_grads(self.params, 3)

        def step_through_the_outage():  # the SDK retries (and its channels dial) all along the outage
            got = self.session.push_pull(self.grads)
            self.acknowledged.update(at=time.monotonic(), params=got)

        self.stepping = threading.Thread(target=step_through_the_outage, daemon=True)
        self.stepping.start()
        self.down_since = time.monotonic()

    def wait_out_the_downtime(self) -> None:
        time.sleep(max(0.0, DOWNTIME_S - (time.monotonic() - self.down_since)))

    def after_restart(self, address: str, server: ServerProcess, sessions: list[str]) -> None:
        self.stepping.join(timeout=120)
        assert "at" in self.acknowledged, "the step was not acknowledged:\n" + "".join(server.lines[-30:])
        took = self.acknowledged["at"] - self.listening_at
        assert took <= FIRST_STEP_WITHIN_S, f"first step {took:.1f} s after the restarted server listened"
        assert max_abs_diff(self.acknowledged["params"], self.reference.step(self.grads)) <= 1e-6  # applied once
        assert self.session.version == 4
        self.session.close()
        self.client.close()


# --- locked: one server per checkpoint folder; a killed server's lock is taken over -----------------


class Locked:
    def __init__(self, checkpoint_dir: str):
        self.checkpoint_dir = checkpoint_dir
        self.params = make_params(5)
        self.reference = InProcess(SURVIVOR_OPTIMIZER["name"], SURVIVOR_OPTIMIZER["args"], self.params)

    def _argv(self) -> list[str]:
        return [sys.executable, "-m", "optserve.server.cli", "serve", "--port", "0", "--shards", "1",
                "--checkpoint-dir", self.checkpoint_dir, "--checkpoint-every-steps", "3"]

    def before_kill(self, address: str) -> None:
        # A second server on the folder is refused at once, naming the first; the first is untouched.
        env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
        env.pop("RAY_ADDRESS", None)
        env.pop("GRPC_VERBOSITY", None)
        started = time.monotonic()
        second = subprocess.run(self._argv(), capture_output=True, text=True, timeout=120, env=env)
        elapsed = time.monotonic() - started
        shown = f"stdout:\n{second.stdout[-3000:]}\nstderr:\n{second.stderr[-3000:]}"
        assert second.returncode == 2, shown
        assert second.stdout == "" and len(second.stderr.splitlines()) == 1, shown
        line = second.stderr.strip()
        assert line.startswith("optserve serve: could not start: ") and self.checkpoint_dir in line, line
        assert f"pid {self.first_pid} on host {socket.gethostname()}" in line, line
        assert elapsed < 10.0, f"{elapsed:.1f} s"

        with Client(address, timeout=120.0) as client:
            session = client.create_session("locked", self.params, optimizer=SURVIVOR_OPTIMIZER)
            for step in range(4):  # a checkpoint at 3, step 4 in the log
                grads = make_grads(self.params, step)
                got, expected = session.push_pull(grads), self.reference.step(grads)
                assert max_abs_diff(got, expected) <= 1e-6

    def while_down(self) -> None:
        pass

    def after_restart(self, address: str, server: ServerProcess, sessions: list[str]) -> None:
        # The first died without releasing: the next server took the lock over and restored the session.
        taken_over = [line for line in server.lines if "event=checkpoint_dir_lock_taken_over" in line]
        assert taken_over and f"previous_pid={self.first_pid}" in taken_over[0], "".join(server.lines[-30:])
        with Client(address, timeout=120.0) as fresh_client:
            fresh = fresh_client.session("locked")
            assert fresh.version == 4
            for step in range(4, 6):
                grads = make_grads(self.params, step)
                got, expected = fresh.push_pull(grads), self.reference.step(grads)
            assert max_abs_diff(got, expected) <= 1e-6
            fresh.detach()

    def after_stop(self) -> None:
        with DirLock.acquire(self.checkpoint_dir) as after:  # released at shutdown, cleanly
            assert after.previous is None


# --- gone: a server down is named by the address the user gave, and said while retrying --------------


def _reachable(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False


class Gone:
    def __init__(self, caplog):
        self.caplog = caplog

    def before_kill(self, address: str) -> None:
        self.address = address
        self.client = Client(address, timeout=4.0, shared_memory=False)
        self.session = self.client.create_session("gone", {"w": np.ones(4, np.float32)},
                                                  {"name": "sgd", "args": {"learning_rate": 0.5}})
        self.session.push({"w": np.ones(4, np.float32)})

    def while_down(self) -> None:
        deadline = time.monotonic() + 30  # the shard processes go when their raylet has gone
        while time.monotonic() < deadline and _reachable(self.session._shards[0].address):
            time.sleep(0.2)
        self.caplog.set_level(logging.WARNING, logger="optserve.client._fanout")
        with pytest.raises(UnavailableError) as raised:
            self.session.push({"w": np.ones(4, np.float32)})
        self.client.close()
        # the address the user gave, not a shard's internal port; and said once while retrying
        assert raised.value.details.startswith(f"server {self.address}: session 'gone' was not served within")
        assert any(f"server {self.address} does not serve session 'gone' now" in r.getMessage()
                   for r in self.caplog.records)

    def after_restart(self, address: str, server: ServerProcess, sessions: list[str]) -> None:
        pass
