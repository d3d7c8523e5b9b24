"""The service on a GPU: shards and root workers sharing one GPU by fractions, each within its
memory budget, training exactly. Run by the GPU kit (``make gpu-check`` on a lent device, against a
Ray node that declares the GPU; ``make gpu-check-dry`` here, with the GPU rehearsed: JAX on the
CPU), which names the node in ``OPTSERVE_GPU_RAY_ADDRESS``; skipped without it.

On the device the in-process references run on the same GPU as the service (this process takes only
the memory it uses: the kit sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false``).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from _service_helpers import InProcess, make_grads, make_params, max_abs_diff
from bench.gpu import device_events, host_path, Server
from optserve.client import Client

RAY_ADDRESS = os.environ.get("OPTSERVE_GPU_RAY_ADDRESS", "")
REHEARSAL = os.environ.get("OPTSERVE_GPU_REHEARSAL") == "1"
pytestmark = pytest.mark.skipif(not RAY_ADDRESS, reason="the GPU kit runs these (make gpu-check; make gpu-check-dry)")

BACKEND = "cpu" if REHEARSAL else "gpu"
ROOT_OPTIMIZERS = {
    "shampoo": {"learning_rate": 0.01, "block_size": 8, "start_preconditioning_step": 2},
    "soap": {"learning_rate": 0.01, "precondition_frequency": 2, "max_precondition_dim": 12},
}


def test_two_shards_share_a_gpu_each_within_its_budget_and_train_exactly(tmp_path):
    with Server(RAY_ADDRESS, str(tmp_path), REHEARSAL, "--shards", "2", "--gpus-per-shard", "0.5") as server:
        with Client(server.address, timeout=120, shared_memory=True) as client:
            for shard in client.server_status():
                device = shard.device
                assert device.backend == BACKEND and device.rehearsal == REHEARSAL, device
                assert device.memory_fraction == pytest.approx(0.45) and len(device.gpu_ids) == 1, device
                if not REHEARSAL:
                    assert device.devices and all(d.startswith("cuda") for d in device.devices), device
            params = make_params(2)
            session = client.create_session("gpu-adam", params, optimizer={"name": "adam", "args": {
                "learning_rate": 0.01}})
            assert len(session.status().shards) == 2
            reference = InProcess("adam", {"learning_rate": 0.01}, params)
            for step in range(3):
                grads = make_grads(params, step)
                got, expected = session.push_pull(grads), reference.step(grads)
                assert max_abs_diff(got, expected) <= 1e-5, step
            bad = make_grads(params, 3)  # a NaN in one tensor (on one shard): checked on the device there
            name = sorted(bad)[-1]
            bad[name].reshape(-1)[5] = np.nan
            with pytest.raises(Exception, match="NaN or Inf"):
                session.push_pull(bad)
            assert max_abs_diff(session.pull(), got) == 0.0  # nothing applied on any shard
            assert max_abs_diff(session.push_pull(make_grads(params, 3)), reference.step(make_grads(params, 3))) <= 1e-5
            session.close()
    # a GPU shard maps its clients' regions for the device (the reply goes from the device into them)
    assert host_path(server.output(), REHEARSAL) == ("host-resident (CPU shard)" if REHEARSAL else
                                                     "host-resident, mapped"), server.output()[-2000:]


@pytest.fixture(scope="module")
def roots_server(tmp_path_factory):
    """One server with a shard and a preconditioner worker at half a GPU each, for every root
    optimizer (each test its own session)."""
    flags = ("--shards", "1", "--gpus-per-shard", "0.5", "--precond-workers", "1", "--gpus-per-precond-worker",
             "0.5", "--log-level", "info")
    with Server(RAY_ADDRESS, str(tmp_path_factory.mktemp("roots-server")), REHEARSAL, *flags) as server:
        yield server


@pytest.mark.parametrize("name", sorted(ROOT_OPTIMIZERS))
def test_roots_on_a_gpu_worker_beside_the_shard_reproduce_the_in_process_optimizer(roots_server, name):
    with Client(roots_server.address, timeout=120, shared_memory=True) as client:
        params = make_params(2)
        args = ROOT_OPTIMIZERS[name]
        session = client.create_session(f"gpu-{name}", params, optimizer={
            "name": name, "args": args, "preconditioners": {"max_age": 0}})
        reference = InProcess(name, args, params)
        for step in range(5):
            grads = make_grads(params, step)
            got, expected = session.push_pull(grads), reference.step(grads)
        assert max_abs_diff(got, expected) <= 1e-4
        assert session.status().shards[0].root_offload.roots_installed > 0
        session.close()
    worker = device_events(roots_server.output())["preconditioner-worker-0"]  # logged as the worker started
    assert worker["backend"] == BACKEND and worker["memory_fraction"] == "0.45", worker


@pytest.mark.skipif(REHEARSAL, reason="pinned host memory needs a GPU")
def test_parameters_come_back_through_pinned_host_memory_unchanged():
    import jax
    import numpy as np

    from optserve.server.compute.host_transfer import _pinned_target, to_host

    values = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "count": np.int32(7)}
    on_device = jax.device_put(values, jax.devices("gpu")[0])
    assert _pinned_target(on_device["w"]).memory_kind == "pinned_host"  # the path to_host takes for it
    host = to_host(on_device)
    assert np.array_equal(host["w"], values["w"]) and int(host["count"]) == 7


@pytest.mark.skipif(REHEARSAL, reason="a host link is a GPU's")
def test_host_link_copies_device_arrays_into_mapped_host_memory_exactly():
    import mmap

    import jax
    import numpy as np

    from optserve.server.compute.host_link import host_link

    link = host_link(jax.devices("gpu")[0])
    assert link is not None, "a CUDA device with cuda.bindings has a host link"
    region = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_SHARED)
    host = np.frombuffer(region, np.float32)
    address = host.ctypes.data
    link.map(address, len(region))
    try:
        values = jax.device_put(np.arange(1000, dtype=np.float32) * 0.5, jax.devices("gpu")[0])
        ones = jax.device_put(np.ones((7, 3), np.float32), jax.devices("gpu")[0])
        assert link.copy_down([(address + 4096, values), (address + 256, ones)]) == 4000 + 84
        assert np.array_equal(host[1024:2024], np.arange(1000, dtype=np.float32) * 0.5)
        assert np.array_equal(host[64:85], np.ones(21, np.float32)) and host[63] == 0 and host[85] == 0
        up = jax.device_put(host[1024:2024], jax.devices("gpu")[0])  # and up again, from the mapped range
        assert np.array_equal(np.asarray(up), np.asarray(values))
    finally:
        link.unmap(address)
        del host


@pytest.mark.skipif(REHEARSAL, reason="a GPU's state reaches the host as a copy; a CPU device's as views")
def test_a_gpu_shards_checkpoint_is_its_host_copy_written_without_waiting_and_restores_exactly(tmp_path):
    import jax
    import numpy as np

    from optserve.optim_kernels import build_optimizer
    from optserve.server.compute.updater import Updater
    from optserve.server.domain.durability import DurabilityConfig, ShardProgress
    from optserve.server.storage import ShardStore

    params = make_params(3, {"w": (256, 128), "b": (128,)})
    updater = Updater(build_optimizer("adam", {"learning_rate": 0.01}),
                      param_specs={k: (v.shape, v.dtype) for k, v in params.items()})
    updater.initialize(params)
    updater.apply(make_grads(params, 0), 1.0, lambda partial: partial)
    assert updater.device.platform == "gpu" and updater.host_state_is_copy
    store = ShardStore(str(tmp_path), "gpu", 0, DurabilityConfig(str(tmp_path), checkpoint_copy_max_bytes=0),
                       home=False)
    store.start_logs(None)
    saved_params, saved_state = updater.host_state()
    store.checkpoint(ShardProgress(1, 0, {}), saved_params, saved_state, copied=True)
    store.wait()
    abstract = {"params": saved_params, "opt_state": saved_state}
    restored = store.restore_arrays(store.latest(), abstract)
    assert max_abs_diff(restored["params"], updater.host_params()) == 0.0
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restored["opt_state"]),
                                                    jax.tree.leaves(saved_state)))
    store.close()
