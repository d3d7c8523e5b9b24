"""Shampoo sessions whose inverse roots come from the server's preconditioner workers (issue 6).

One server for this module: 2 shards and 2 preconditioner workers on the shared local Ray, on
loopback; sessions are driven by the real client over gRPC. The in-process kernel (the same
jitted step over the whole model in this process) is the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _service_helpers import InProcess, make_grads, make_params, max_abs_diff
from optserve.client import Client
from optserve.client.errors import InvalidArgumentError

SHAPES = {"embed": (16, 12), "hidden/w": (12, 10), "hidden/b": (10,), "out/w": (10, 6)}
ARGS = {"learning_rate": 0.01, "block_size": 8, "start_preconditioning_step": 3}


@pytest.fixture(scope="module")
def precond_server(ray_local):
    """An embedded server with 2 shards and 2 preconditioner workers (module-scoped: only this
    file uses it, and its 5 actors are freed as soon as the file is done)."""
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig

    running = start_server(ServerConfig(host="127.0.0.1", port=0, shards=2, ray_address="local", precond_workers=2,
                                         min_shard_bytes=0))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(precond_server):
    with Client(precond_server.address, timeout=120) as c:
        yield c


def _blocks(status) -> list:
    return [b for shard in status.shards for b in shard.preconditioners]


def test_age_bound_zero_reproduces_in_process_shampoo_on_two_shards(client, unique_name):
    params = make_params(seed=4, shapes=SHAPES)
    reference = InProcess("shampoo", ARGS, params)
    session = client.create_session(
        unique_name, params, optimizer={"name": "shampoo", "args": ARGS, "preconditioners": {"max_age": 0}})
    try:
        assert len(session.info.shards) == 2
        worst = 0.0
        for step in range(12):
            grads = make_grads(params, step, seed=7)
            worst = max(worst, max_abs_diff(session.push_pull(grads), reference.step(grads)))
        assert worst <= 1e-5, f"max abs difference {worst:.3g}"
        status = session.status()
        for shard in status.shards:
            assert shard.root_offload.offloaded and shard.root_offload.max_age == 0
            assert shard.root_offload.roots_installed == 12
        assert _blocks(status) and all(b.age == 0 and b.failures == 0 for b in _blocks(status))
    finally:
        session.close()


def _least_squares():
    rng = np.random.default_rng(10)
    x = rng.standard_normal((128, 16)).astype(np.float32) * np.linspace(0.5, 2.0, 16).astype(np.float32)
    y = (x @ rng.standard_normal((16, 8)) + rng.standard_normal((128, 8))).astype(np.float32)
    params = {"w": np.zeros((16, 8), np.float32), "b": np.zeros((8,), np.float32)}
    return params, lambda p: jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def _mlp():
    rng = np.random.default_rng(11)
    x = rng.standard_normal((128, 8)).astype(np.float32)
    teacher = np.tanh(x @ rng.standard_normal((8, 16))) @ (0.3 * rng.standard_normal((16, 4)))
    y = (teacher + 0.3 * rng.standard_normal((128, 4))).astype(np.float32)
    params = {"w1": (rng.standard_normal((8, 16)) * 0.3).astype(np.float32), "b1": np.zeros((16,), np.float32),
              "w2": (rng.standard_normal((16, 4)) * 0.3).astype(np.float32), "b2": np.zeros((4,), np.float32)}
    return params, lambda p: jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"] - y) ** 2)


CONVERGENCE_ARGS = {"block_size": 16, "start_preconditioning_step": 10, "preconditioning_compute_steps": 2}
CONVERGENCE_STEPS = 100


@pytest.mark.parametrize("problem, optimizer_args", [
    (_least_squares, {"learning_rate": 0.03, "graft_type": "adagrad"}),
    (_mlp, {"learning_rate": 0.02, "graft_type": "sgd"}),
], ids=["least_squares", "mlp"])
def test_asynchronous_roots_converge_like_in_process_shampoo_with_ages_within_the_bound(
        client, unique_name, problem, optimizer_args):
    args = {**CONVERGENCE_ARGS, **optimizer_args}
    params, loss = problem()
    grad = jax.jit(jax.grad(loss))
    reference = InProcess("shampoo", args, params)
    expected = params
    for _ in range(CONVERGENCE_STEPS):
        expected = reference.step({k: np.asarray(v) for k, v in grad(expected).items()})
    session = client.create_session(unique_name, params, optimizer={"name": "shampoo", "args": args})
    try:
        got, ages = params, []
        for step in range(CONVERGENCE_STEPS):
            got = session.push_pull({k: np.asarray(v) for k, v in grad(got).items()})
            if step % 5 == 4:
                ages += [b.age for b in _blocks(session.status())]
        status = session.status()
        bound = 2 * CONVERGENCE_ARGS["preconditioning_compute_steps"]  # the default max_age
        assert all(s.root_offload.max_age == bound and s.root_offload.roots_installed > 0
                   for s in status.shards)
        assert ages and max(ages) <= bound and min(ages) >= 0
        final, reference_final, initial = float(loss(got)), float(loss(expected)), float(loss(params))
        assert reference_final < 0.25 * initial  # the reference really converged
        assert abs(final - reference_final) <= 0.05 * reference_final, (final, reference_final)
    finally:
        session.close()


def test_killing_a_worker_mid_run_fails_no_push_and_new_roots_arrive(client, precond_server, unique_name):
    import ray

    params = make_params(seed=5, shapes=SHAPES)
    reference = InProcess("shampoo", ARGS, params)
    victim = precond_server.precond_workers[0]
    before = ray.get(victim.info.remote())
    session = client.create_session(
        unique_name, params, optimizer={"name": "shampoo", "args": ARGS, "preconditioners": {"max_age": 0}})
    try:
        worst = 0.0
        for step in range(10):
            if step == 3:
                ray.kill(victim, no_restart=False)  # Ray restarts it; the shards wait or resubmit
            grads = make_grads(params, step, seed=8)
            worst = max(worst, max_abs_diff(session.push_pull(grads), reference.step(grads)))
        assert session.version == 10 and worst <= 1e-5  # no push failed, no update lost or changed
        status = session.status()
        assert status.rejected.get("aborted", 0) == 0
        assert all(s.root_offload.roots_installed == 10 for s in status.shards)
        after = ray.get(victim.info.remote())
        assert after["pid"] != before["pid"] and after["batches"] > 0  # restarted, and computing roots again
    finally:
        session.close()


def test_failing_statistics_keep_the_old_preconditioner_and_count_failures_in_status(client, unique_name):
    params = make_params(seed=6, shapes=SHAPES)
    session = client.create_session(
        unique_name, params, optimizer={"name": "shampoo", "args": ARGS, "preconditioners": {"max_age": 0}},
        allow_nonfinite=True)
    try:
        for step in range(6):
            grads = make_grads(params, step, seed=9)
            if step == 3:
                grads["hidden/w"] = np.full_like(grads["hidden/w"], np.nan)
            session.push(grads)
        blocks = _blocks(session.status())
        broken = [b for b in blocks if b.tensor == "hidden/w"]
        healthy = [b for b in blocks if b.tensor != "hidden/w"]
        assert broken and healthy
        # steps 3-5 offered NaN roots: refused, counted, and the roots of step 2 kept (age 3 at step 5)
        assert all(b.failures == 3 and not np.isfinite(b.error) and b.age == 3 for b in broken)
        assert all(b.failures == 0 and b.age == 0 and b.fallback_steps == 0 for b in healthy)
    finally:
        session.close()


def test_in_process_option_keeps_roots_inside_the_update(client, unique_name):
    params = make_params(seed=7, shapes=SHAPES)
    session = client.create_session(
        unique_name, params, optimizer={"name": "shampoo", "args": ARGS, "preconditioners": {"in_process": True}})
    try:
        session.push(make_grads(params, 0))
        status = session.status()
        assert not any(s.root_offload.offloaded for s in status.shards)
        assert _blocks(status) and all(b.age == 0 for b in _blocks(status))
    finally:
        session.close()


def test_negative_max_age_is_rejected_naming_the_option(client, unique_name):
    with pytest.raises(InvalidArgumentError, match="max_age"):
        client.create_session(unique_name, make_params(seed=8, shapes=SHAPES),
                              optimizer={"name": "shampoo", "args": ARGS, "preconditioners": {"max_age": -1}})


def test_a_session_started_from_a_saved_state_with_offloaded_roots_continues_as_the_uninterrupted_one(
        client, unique_name):
    params = make_params(seed=6, shapes=SHAPES)
    optimizer = {"name": "shampoo", "args": {**ARGS, "preconditioning_compute_steps": 2},
                 "preconditioners": {"max_age": 0}}
    original = client.create_session(f"{unique_name}-a", params, optimizer=optimizer)
    restored = None
    try:
        for step in range(5):
            original.push_pull(make_grads(params, step, seed=8))
        saved = original.state()
        assert {"params.statistics.0", "params.preconditioners.0", "preconditioner_info.source_step"} <= set(
            saved["tensors"]["embed"])
        restored = client.create_session(f"{unique_name}-b", state=saved)
        for step in range(5, 9):
            grads = make_grads(params, step, seed=8)
            uninterrupted, continued = original.push_pull(grads), restored.push_pull(grads)
            assert max_abs_diff(continued, uninterrupted) <= 1e-6, step
        final_a, final_b = original.state(), restored.state()
        assert final_a["version"] == final_b["version"] == 9
        for tensor, leaves in final_a["tensors"].items():
            for path, value in leaves.items():
                np.testing.assert_allclose(final_b["tensors"][tensor][path], value, rtol=1e-6, atol=1e-6,
                                           err_msg=f"{tensor} {path}")
        assert all(s.root_offload.offloaded for s in restored.status().shards)
    finally:
        original.close()
        if restored is not None:
            restored.close()
