"""A real Ray cluster on this machine, started as a user starts one (``ray start``): for the tests
that need a cluster (several nodes, logical GPUs) and for the GPU kit.

Each node is ``ray start --block`` in its own process group and its own ``--temp-dir`` (so
neither the test process's own local Ray nor the default ``/tmp/ray`` sees it). Stopping stops
exactly those: each node's ``ray start --block`` (SIGTERM: it stops its node's processes), then any
process still naming the cluster's temp dir. It never runs ``ray stop``, which would stop every
Ray on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Iterator

RAY = [sys.executable, "-m", "ray.scripts.scripts"]  # the `ray` command of this interpreter's Ray
ADAM = {"name": "adam", "args": {"learning_rate": 0.01}}
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


_PORT_BLOCK = 2000  # ports a process draws from: its own block below the ephemeral range
_next_port = [0]


def free_port() -> int:
    """A loopback TCP port free now, for a server that will listen on it (and may be restarted on
    it after a kill). Drawn below the kernel's ephemeral range, which every port-0 bind (a Ray
    daemon, a shard, another test's server) draws from, so nothing else takes it meanwhile; from a
    block of its own for each pytest-xdist worker (``PYTEST_XDIST_WORKER``), starting at a random
    place in it so that separate runs rarely meet."""
    import random

    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    base = 12000 + _PORT_BLOCK * (int(worker[2:]) % 8 if worker[2:].isdigit() else 0)
    if not _next_port[0]:
        _next_port[0] = random.randrange(_PORT_BLOCK)
    for _ in range(_PORT_BLOCK):
        port = base + _next_port[0] % _PORT_BLOCK
        _next_port[0] += 1
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {base}..{base + _PORT_BLOCK - 1}")


def ray_env() -> dict:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1",
               RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0")  # SIGTERM stops a node at once (no drain wait)
    env.pop("RAY_ADDRESS", None)  # the address is always given explicitly
    return env


def processes_naming(text: str) -> list[int]:
    """Pids of this machine's processes whose command line contains ``text``."""
    me = os.getpid()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    pids.append(int(entry))
        except OSError:
            pass
    return pids


class Started:
    """A subprocess in its own process group, its output in a file."""

    def __init__(self, name: str, argv: list[str], log_dir: str):
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=ray_env(), start_new_session=True, text=True)

    def output(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_for(self, text: str, timeout_s: float = START_TIMEOUT_S) -> str:
        """The first output line containing ``text``; fails if the process exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.output().splitlines():
                if text in line:
                    return line
            if self.process.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} did not print {text!r} (exit code {self.process.poll()}):\n"
                           f"{self.output()[-4000:]}")

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM, then SIGKILL to its process group after ``timeout_s``; waits for it."""
        try:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    warnings.warn(f"{self.name} ignored SIGTERM for {timeout_s:.0f} s: killed")
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=timeout_s)
        except ProcessLookupError:
            pass
        finally:
            self._log.close()


def driver_value(address: str, expression: str):
    """``expression`` (Python, with ``ray`` imported and connected) evaluated by a separate Ray
    driver joining the cluster at ``address``; its value must be JSON.

    Raises:
      RuntimeError: the driver failed (its output in the message).
    """
    script = ("import json, ray; ray.init(address=%r, log_to_driver=False, include_dashboard=False); "
              "print('VALUE', json.dumps(%s))" % (address, expression))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ray_env(),
                            timeout=START_TIMEOUT_S)
    lines = [line for line in result.stdout.splitlines() if line.startswith("VALUE ")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"a Ray driver on {address} failed: {result.stdout[-2000:]}{result.stderr[-4000:]}")
    return json.loads(lines[-1].split(" ", 1)[1])


@contextlib.contextmanager
def ray_cluster(node_resources: tuple = ({}, ), num_cpus: int = 1, num_gpus: int = 0) -> Iterator[str]:
    """A head node and ``len(node_resources) - 1`` worker nodes, each with ``num_cpus`` CPUs, ``num_gpus``
    logical GPUs (Ray declares them; no GPU is needed) and its custom resources; yields the head's
    GCS address. Every node's processes are stopped on exit, also after a failure."""
    # short and unique: Ray's socket paths live under it (a Unix socket path has 107 bytes at most)
    temp_dir = tempfile.mkdtemp(prefix="osrc", dir="/tmp")
    gcs_port = free_port()
    address = f"127.0.0.1:{gcs_port}"
    common = ["--block", "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}", f"--num-gpus={num_gpus}",
              "--object-store-memory=100000000", "--min-worker-port=0", "--max-worker-port=0",
              "--disable-usage-stats"]
    nodes = []
    try:
        for index, resources in enumerate(node_resources):
            extra = ["--resources=" + json.dumps(resources)] if resources else []
            if index == 0:
                argv = [*RAY, "start", "--head", f"--port={gcs_port}", "--include-dashboard=false",
                        f"--ray-client-server-port={free_port()}"]
            else:
                argv = [*RAY, "start", f"--address={address}"]
            argv += [f"--dashboard-agent-listen-port={free_port()}",
                     f"--temp-dir={os.path.join(temp_dir, f'node{index}')}", *extra, *common]
            node = Started(f"ray-node{index}", argv, temp_dir)
            nodes.append(node)
            node.wait_for("Ray runtime started")  # a worker prints it once registered with the head
        yield address
    finally:
        for node in reversed(nodes):  # the workers first, then the head (its GCS)
            node.stop()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while processes_naming(temp_dir) and time.monotonic() < deadline:
            time.sleep(0.5)
        leftovers = processes_naming(temp_dir)
        for pid in leftovers:  # only processes of these nodes name the temp dir
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if leftovers:
            warnings.warn(f"{len(leftovers)} Ray processes outlived their node's `ray start --block`: killed")
        shutil.rmtree(temp_dir, ignore_errors=True)
