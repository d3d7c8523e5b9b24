"""A GPU deployment proven where there is no GPU: a real Ray cluster that declares two logical GPUs
(``ray start --num-gpus 2`` on this CPU machine) and ``optserve serve`` joining it.

* ``--rehearse-gpus``: the shards (half a GPU each) and a root worker (a whole GPU) are placed by
  Ray's GPU resources; each actor is handed the GPUs Ray assigned it and a memory budget that follows
  its share (what its JAX would take on a real GPU); and training through them is exact.
* without it: an actor given a GPU that its JAX cannot use stops the start in one line naming the
  GPU it expected and the backends it found (it once ran on the CPU for minutes without a word).
"""

from __future__ import annotations

import sys
import time

import pytest

from bench.gpu import device_events
from bench.ray_cluster import driver_value, ray_cluster, Started, STOP_TIMEOUT_S
from _service_helpers import InProcess, make_grads, make_params, max_abs_diff
from optserve.client import Client
from optserve.server.compute.devices import DeviceRequest

pytestmark = pytest.mark.slow

SHAMPOO_ARGS = {"learning_rate": 0.01, "block_size": 8, "start_preconditioning_step": 2}


@pytest.fixture(scope="module")
def two_gpu_cluster():
    """One Ray node declaring 2 CPUs and 2 (logical) GPUs; yields its GCS address."""
    with ray_cluster(num_cpus=2, num_gpus=2) as address:
        yield address


def _serve(address: str, log_dir: str, *flags: str) -> Started:
    return Started("optserve", [sys.executable, "-m", "optserve.server.cli", "serve", "--port", "0",
                                "--ray-address", address, "--min-shard-bytes", "0", "--log-level", "info", *flags],
                   log_dir)


def _free_gpus(address: str) -> float:
    """The cluster's GPUs no actor holds, as a separate Ray driver sees them."""
    return driver_value(address, "ray.available_resources().get('GPU', 0.0)")


@pytest.mark.parametrize("gpus, fraction", [(0.25, 0.225), (0.5, 0.45), (1.0, 0.9), (2.0, 0.9)])
def test_an_actors_memory_budget_follows_its_share_of_a_gpu(gpus, fraction):
    request = DeviceRequest("shard 0", "--gpus-per-shard", gpus)
    assert request.ray_options() == {"num_gpus": gpus,
                                     "runtime_env": {"env_vars": {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{fraction:g}"}}}
    rehearsed = DeviceRequest("shard 0", "--gpus-per-shard", gpus, rehearsal=True).env()
    assert rehearsed == {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{fraction:g}", "JAX_PLATFORMS": "cpu"}
    assert DeviceRequest("shard 0", "--gpus-per-shard", 0.0).ray_options() == {}  # a CPU actor: as before


def test_rehearsed_gpus_place_shards_and_root_workers_by_gpu_and_hand_each_its_budget(two_gpu_cluster, tmp_path):
    server = _serve(two_gpu_cluster, str(tmp_path), "--shards", "2", "--gpus-per-shard", "0.5",
                    "--precond-workers", "1", "--gpus-per-precond-worker", "1", "--rehearse-gpus")
    try:
        address = server.wait_for("optserve listening on ").split()[-1]
        with Client(address, timeout=60) as client:
            shards = client.server_status()
            assert [s.index for s in shards] == [0, 1]
            for shard in shards:  # half a GPU each: 45% of its memory, JAX on the CPU
                device = shard.device
                assert device is not None and device.rehearsal and device.backend == "cpu", shard
                assert len(device.gpu_ids) == 1 and device.gpu_ids[0] in ("0", "1"), shard
                assert device.memory_fraction == pytest.approx(0.45), shard
            worker = device_events(server.output())["preconditioner-worker-0"]
            assert worker["memory_fraction"] == "0.9" and worker["rehearsal"] == "1", worker
            shard_gpus = {s.device.gpu_ids[0] for s in shards}
            assert len(shard_gpus) == 1 and {worker["gpus"]} | shard_gpus == {"0", "1"}, (worker, shard_gpus)
            assert _free_gpus(two_gpu_cluster) == 0.0  # 2 x 0.5 + 1: every declared GPU is reserved

            params = make_params(2)  # trains exactly, roots from the worker
            session = client.create_session("rehearsed", params, optimizer={
                "name": "shampoo", "args": SHAMPOO_ARGS, "preconditioners": {"max_age": 0}})
            reference = InProcess("shampoo", SHAMPOO_ARGS, params)
            for step in range(4):
                grads = make_grads(params, step)
                got, expected = session.push_pull(grads), reference.step(grads)
            assert max_abs_diff(got, expected) <= 1e-5
            assert any(s.root_offload.roots_installed > 0 for s in session.status().shards)
            session.close()
    finally:
        server.stop()


@pytest.mark.parametrize("flags, role, flag", [
    (["--gpus-per-shard", "0.5"], "shard 0", "--gpus-per-shard 0.5"),
    (["--precond-workers", "1", "--gpus-per-precond-worker", "0.5"], "preconditioner worker 0",
     "--gpus-per-precond-worker 0.5"),
])
def test_an_actor_given_a_gpu_its_jax_cannot_use_stops_the_start_in_one_line(two_gpu_cluster, tmp_path, flags, role,
                                                                              flag):
    started = time.monotonic()
    server = _serve(two_gpu_cluster, str(tmp_path), "--shards", "2", *flags)
    try:
        assert server.process.wait(timeout=STOP_TIMEOUT_S + 60) == 2, server.output()[-4000:]
    finally:
        server.stop()
    seconds = time.monotonic() - started
    output = server.output()
    lines = [line for line in output.splitlines() if line.startswith("optserve serve")]
    assert len(lines) == 1, output[-4000:]
    assert lines[0].startswith(f"optserve serve: could not start: {role} on node ")
    assert "was given GPU " in lines[0] and f"({flag}, CUDA_VISIBLE_DEVICES=" in lines[0], lines[0]
    assert "its JAX found no GPU backend (backends found: cpu)" in lines[0], lines[0]
    assert "Traceback" not in output and "listening" not in output
    assert seconds < 60, f"took {seconds:.0f} s to refuse"
    assert _free_gpus(two_gpu_cluster) == 2.0  # nothing left holding the cluster's GPUs
