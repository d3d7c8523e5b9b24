"""A real two-node Ray cluster on this machine, started as a user starts one (``ray start``), and
``optserve serve --ray-address HEAD`` joining it: the shards land on both nodes, and training
through them equals the kernel run in process.

Everything runs in subprocesses: the two Ray nodes (``ray start --block``, each in its own process
group and its own ``--temp-dir``, so neither this pytest process's own local Ray nor the default
``/tmp/ray`` sees them) and the server. Teardown stops exactly those: the server (SIGTERM, then
SIGKILL), each node's ``ray start --block`` (SIGTERM: it stops its node's processes), and then any
process still naming the test's temp dir. It never runs ``ray stop``, which would stop every Ray
on the machine.
"""

from __future__ import annotations

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

import pytest

from _service_helpers import InProcess, make_grads, make_params, max_abs_diff
from optserve.client import Client

pytestmark = pytest.mark.slow

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
ADAM = {"name": "adam", "args": {"learning_rate": 0.01}}
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1",
               RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0")  # SIGTERM stops a node at once (no drain wait)
    env.pop("RAY_ADDRESS", None)  # the address is always given explicitly
    return env


def _processes_naming(text: str) -> list[int]:
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


class _Started:
    """A subprocess in its own process group, its output in a file."""

    def __init__(self, name: str, argv: list[str], log_dir: str):
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=_env(), start_new_session=True, text=True)

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
        pytest.fail(f"{self.name} did not print {text!r} (exit code {self.process.poll()}):\n"
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


@pytest.fixture(scope="module")
def two_node_cluster():
    """A head and a worker node (``ray start``), one CPU each; yields the head's GCS address."""
    # short and unique: Ray's socket paths live under it (a Unix socket path has 107 bytes at most)
    temp_dir = tempfile.mkdtemp(prefix="osmn", dir="/tmp")
    gcs_port = _free_port()
    address = f"127.0.0.1:{gcs_port}"
    common = ["--block", "--node-ip-address=127.0.0.1", "--num-cpus=1", "--num-gpus=0",
              "--object-store-memory=100000000", "--min-worker-port=0", "--max-worker-port=0",
              "--disable-usage-stats"]
    nodes = []
    try:
        head = _Started("ray-head", [RAY, "start", "--head", f"--port={gcs_port}", "--include-dashboard=false",
                                     f"--ray-client-server-port={_free_port()}",
                                     f"--dashboard-agent-listen-port={_free_port()}",
                                     f"--temp-dir={os.path.join(temp_dir, 'head')}",
                                     "--resources=" + json.dumps({"node_a": 1}), *common], temp_dir)
        nodes.append(head)
        head.wait_for("Ray runtime started")
        worker = _Started("ray-worker", [RAY, "start", f"--address={address}",
                                         f"--dashboard-agent-listen-port={_free_port()}",
                                         f"--temp-dir={os.path.join(temp_dir, 'worker')}",
                                         "--resources=" + json.dumps({"node_b": 1}), *common], temp_dir)
        nodes.append(worker)
        worker.wait_for("Ray runtime started")  # printed once the node is registered with the head
        yield address
    finally:
        for node in reversed(nodes):  # the worker first, then the head (its GCS)
            node.stop()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while _processes_naming(temp_dir) and time.monotonic() < deadline:
            time.sleep(0.5)
        leftovers = _processes_naming(temp_dir)
        for pid in leftovers:  # only processes of this test's nodes name its temp dir
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if leftovers:
            warnings.warn(f"{len(leftovers)} Ray processes outlived their node's `ray start --block`: killed")
        shutil.rmtree(temp_dir, ignore_errors=True)


def _placement_groups(address: str) -> list[dict]:
    """The cluster's placement groups, as a separate Ray driver sees them."""
    script = ("import json, ray; ray.init(address=%r, log_to_driver=False, include_dashboard=False); "
              "print('PLACEMENT', json.dumps(list(ray.util.placement_group_table().values())))" % address)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_env(),
                            timeout=START_TIMEOUT_S)
    lines = [line for line in result.stdout.splitlines() if line.startswith("PLACEMENT ")]
    assert result.returncode == 0 and lines, result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads(lines[-1].split(" ", 1)[1])


def test_serve_on_a_two_node_cluster_spreads_its_shards_and_trains_like_the_kernel(two_node_cluster, tmp_path):
    server = _Started("optserve", [sys.executable, "-m", "optserve.server.cli", "serve", "--port", "0",
                                   "--shards", "4", "--ray-address", two_node_cluster, "--min-shard-bytes", "0"],
                      str(tmp_path))
    try:
        address = server.wait_for("optserve listening on ").split()[-1]
        params = make_params()  # 4 tensors: one on each shard
        with Client(address, timeout=60) as client:
            session = client.create_session("multinode", params, optimizer=ADAM)
            shards = session.status().shards
            assert [s.index for s in shards] == [0, 1, 2, 3]
            nodes = [s.node_id for s in shards]
            assert all(nodes) and sorted(nodes.count(n) for n in set(nodes)) == [2, 2], nodes  # 2 per node

            # the shards run in one SPREAD placement group, a bundle each, on the nodes they report
            (group,) = [g for g in _placement_groups(two_node_cluster) if g["state"] == "CREATED"]
            assert group["strategy"] == "SPREAD" and len(group["bundles"]) == 4, group
            assert sorted(group["bundles_to_node_id"].values()) == sorted(nodes), group

            reference = InProcess(ADAM["name"], ADAM["args"], params)
            for step in range(3):
                grads = make_grads(params, step)
                got = session.push_pull(grads)
                assert max_abs_diff(got, reference.step(grads)) <= 1e-6
            status = session.status()
            assert (status.version, status.steps_applied) == (3, 3)
            session.close()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=STOP_TIMEOUT_S + 30) == 0, server.output()[-4000:]
        assert "optserve shutting down" in server.output()
    finally:
        server.stop()


def test_a_durable_coordinator_killed_on_a_cluster_reattaches_to_its_running_shards(two_node_cluster, tmp_path):
    """``--ray-address`` + ``--checkpoint-dir``: the shard actors are named and detached, so they
    outlive a coordinator killed with SIGKILL; the next coordinator with the same checkpoint folder
    re-attaches to them (same addresses, nothing restored) and training goes on exactly."""
    port = _free_port()
    argv = [sys.executable, "-m", "optserve.server.cli", "serve", "--port", str(port), "--shards", "2",
            "--ray-address", two_node_cluster, "--min-shard-bytes", "0", "--precond-workers", "1",
            "--checkpoint-dir", str(tmp_path / "checkpoints")]
    first = _Started("optserve-first", argv, str(tmp_path))
    second = None
    try:
        address = first.wait_for("optserve listening on ").split()[-1]
        params = make_params(2)
        reference = InProcess(ADAM["name"], ADAM["args"], params)
        client = Client(address, timeout=120)
        session = client.create_session("reattach", params, optimizer=ADAM)
        shampoo_args = {"learning_rate": 0.01, "block_size": 8, "start_preconditioning_step": 2}
        shampoo_reference = InProcess("shampoo", shampoo_args, params)
        shampoo = client.create_session("reattach-shampoo", params, optimizer={  # roots from the worker
            "name": "shampoo", "args": shampoo_args, "preconditioners": {"max_age": 0}})
        for step in range(3):
            grads = make_grads(params, step)
            got, expected = session.push_pull(grads), reference.step(grads)
            shampoo.push_pull(grads), shampoo_reference.step(grads)
        before = [s.address for s in session.status().shards]

        os.killpg(first.process.pid, signal.SIGKILL)  # the coordinator only: the Ray nodes keep running
        first.process.wait(timeout=STOP_TIMEOUT_S)
        second = _Started("optserve-second", argv, str(tmp_path))
        second.wait_for("optserve listening on ")
        assert "event=shards_reattached shards=0,1" in second.output(), second.output()[-4000:]
        status = session.status()
        assert [s.address for s in status.shards] == before
        assert [s.durability.recoveries for s in status.shards] == [0, 0]  # kept in memory, not reloaded
        for step in range(3, 6):
            grads = make_grads(params, step)
            got, expected = session.push_pull(grads), reference.step(grads)
            shampoo_got, shampoo_expected = shampoo.push_pull(grads), shampoo_reference.step(grads)
        assert max_abs_diff(got, expected) <= 1e-6
        assert max_abs_diff(shampoo_got, shampoo_expected) <= 1e-5  # the re-attached worker computes its roots
        assert all(s.root_offload.roots_installed > 0 for s in shampoo.status().shards)
        shampoo.close()
        session.close()
        client.close()
        second.process.send_signal(signal.SIGTERM)
        assert second.process.wait(timeout=STOP_TIMEOUT_S + 30) == 0, second.output()[-4000:]
    finally:
        for server in (first, second):
            if server is not None:
                server.stop()
