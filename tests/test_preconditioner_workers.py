"""Preconditioner workers and the per-shard offload logic, against the real kernel and a real local Ray.

A tiny stand-in for a shard's step loop drives :class:`OffloadedPreconditioners` exactly as
``ShardSession`` does (``before_update`` -> jitted update -> ``after_update``), so these tests pin
the offload schedule, the failure handling and the worker restarts without gRPC.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from _service_helpers import root_pool
from _shampoo_problems import gradient, make_params
from optserve.optim_kernels import build_optimizer
from optserve.server.compute.preconditioner_pool import PoolConfig, PreconditionerPool, batch_size, start_workers
from optserve.server.compute.root_offload import (
    OffloadedPreconditioners,
    ShardPreconditioners,
    build_shard_optimizer,
    required_source_step,
)

ARGS = {"learning_rate": 0.05, "block_size": 4, "start_preconditioning_step": 2}


@pytest.fixture(scope="module")
def pool(ray_local):
    yield from root_pool(ray_local)


def _shapes(params):
    return {k: v.shape for k, v in params.items()}


def _offloaded(pool, args, params, max_age) -> OffloadedPreconditioners:
    optimizer, po = build_shard_optimizer("shampoo", args, _shapes(params), pool, max_age=max_age)
    assert isinstance(po, OffloadedPreconditioners) and optimizer.args["inline_preconditioners"] is False
    po.transformation = optimizer.transformation  # what the updater would run with it
    return po


def _drive(po, params, steps, grads_fn=gradient, on_step=None):
    """What a shard does per step; returns (params after each step, final state)."""
    tx = po.transformation

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    out = []
    for t in range(steps):
        g = grads_fn(params, t)
        state = po.before_update(state, g, params)
        params, state = step(params, state, g)
        state = po.after_update(state)
        out.append(params)
        if on_step is not None:
            on_step(t, po, state)
    return out, state


def _in_process(args, params, steps, grads_fn=gradient):
    """The reference: the in-process kernel under the same jitted step as the shard's."""
    tx = build_optimizer("shampoo", args).transformation

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    out = []
    for t in range(steps):
        params, state = step(params, state, grads_fn(params, t))
        out.append(params)
    return out


def _max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x[k]) - np.asarray(y[k])))) for x, y in zip(a, b) for k in x)


def test_required_source_step_follows_the_kernel_schedule_and_the_bound():
    assert [required_source_step(t, 3, 0) for t in range(7)] == [0, 0, 0, 3, 3, 3, 6]
    assert [required_source_step(t, 1, 2) for t in range(4)] == [-2, -1, 0, 1]
    assert required_source_step(10, 5, 10) == 0
    assert batch_size(3, 32) == 4 and batch_size(100, 32) == 32 and batch_size(1, 8) == 1


@pytest.mark.parametrize("every", [1, 3])
def test_age_bound_zero_reproduces_in_process_shampoo(pool, every):
    args = {**ARGS, "preconditioning_compute_steps": every}
    params = make_params(0)
    po = _offloaded(pool, args, params, max_age=0)
    got, _ = _drive(po, params, 8)
    expected = _in_process(args, params, 8)
    assert _max_diff(got, expected) <= 1e-5
    assert po.roots_installed == len(range(0, 8, every))
    assert all(b.age == 7 % every and b.failures == 0 for b in po.status().blocks)


def test_asynchronous_roots_arrive_and_their_ages_stay_within_the_bound(pool):
    args = {**ARGS, "preconditioning_compute_steps": 2}
    params = make_params(1)
    seen = []
    po = _offloaded(pool, args, params, max_age=4)
    _drive(po, params, 12, on_step=lambda t, p, _: seen.append([b.age for b in p.status().blocks]))
    assert po.roots_installed >= 3 and po.status().max_age == 4
    assert all(age <= 4 for ages in seen for age in ages)
    assert all(age >= 1 for age in seen[-1])  # asynchronous: never the roots of the update's own step
    assert all(b.failures == 0 for b in po.status().blocks)


def test_nan_statistics_keep_the_previous_preconditioner_and_count_failures(pool):
    params = make_params(2)

    def grads(p, t):  # k's loss term is independent of w and b: only k's statistics turn NaN
        g = gradient(p, t)
        return {**g, "k": g["k"] * np.nan} if t == 3 else g

    po = _offloaded(pool, ARGS, params, max_age=0)
    kept = []

    def remember(t, _, state):
        if t == 2:
            kept.extend(np.asarray(x) for x in jax.tree.leaves(state.params["k"].preconditioners))

    _, state = _drive(po, params, 6, grads_fn=grads, on_step=remember)
    blocks = po.status().blocks
    k_blocks = [b for b in blocks if b.tensor == "k"]
    others = [b for b in blocks if b.tensor != "k"]
    assert k_blocks and all(b.failures == 3 and not np.isfinite(b.error) for b in k_blocks)
    assert all(b.age == 3 for b in k_blocks)  # still the roots of step 2, used by update 5
    assert all(b.failures == 0 and b.age == 0 for b in others)
    now = [np.asarray(x) for x in jax.tree.leaves(state.params["k"].preconditioners)]
    assert len(now) == len(kept) and all(np.array_equal(a, b) for a, b in zip(now, kept))


def test_singular_statistics_fail_and_the_block_keeps_the_grafted_fallback(pool):
    params = make_params(3)
    args = {**ARGS, "matrix_epsilon": 0.0}

    def grads(p, t):
        g = gradient(p, t)
        return {**g, "b": np.zeros_like(g["b"])}  # b's statistic stays exactly zero: singular

    po = _offloaded(pool, args, params, max_age=0)
    _drive(po, params, 4, grads_fn=grads)
    b_blocks = [b for b in po.status().blocks if b.tensor == "b"]
    assert b_blocks and all(b.failures == 4 and b.fallback_steps == 4 and b.age == -1 for b in b_blocks)
    # the other statistics become full rank after a few gradients and then get roots
    assert all(b.age == 0 and b.failures < 4 for b in po.status().blocks if b.tensor != "b")


def test_in_process_sessions_keep_the_kernel_and_report_block_status():
    params = make_params(4)
    built, po = build_shard_optimizer("shampoo", ARGS, _shapes(params), pool=None)
    assert type(po) is ShardPreconditioners and built.args == ARGS
    po.transformation = built.transformation
    assert build_shard_optimizer("adam", {"learning_rate": 0.1}, _shapes(params), None)[1] is None
    _drive(po, params, 3)
    assert all(b.age == 0 and b.failures == 0 for b in po.status().blocks)


def test_killed_workers_fail_no_step_and_roots_keep_arriving(ray_local):
    import ray

    config = PoolConfig(workers=2, batch_blocks=2)
    workers = start_workers(config)
    pool = PreconditionerPool(workers, config)
    params = make_params(5)
    pids = ray.get([w.info.remote() for w in workers])
    installed = {}

    def chaos(t, po, _):
        if t == 1:
            ray.kill(workers[0], no_restart=False)  # Ray restarts it
        if t == 4:
            installed["after_restart"] = po.roots_installed
            ray.get(workers[0].info.remote())  # worker 0 is back (its restart done) ...
            ray.kill(workers[1])  # ... and worker 1 gone for good: its batches go to worker 0
    try:
        po = _offloaded(pool, ARGS, params, max_age=0)
        got, _ = _drive(po, params, 8, on_step=chaos)
        expected = _in_process(ARGS, params, 8)
        assert _max_diff(got, expected) <= 1e-5  # no update lost or changed
        assert po.roots_installed == 8 and installed["after_restart"] == 5
        assert po.status().resubmits >= 1
        restarted = ray.get(workers[0].info.remote())
        assert restarted["pid"] != pids[0]["pid"] and restarted["batches"] > 0
    finally:
        for w in workers:
            ray.kill(w)


def test_f64_workers_compute_in_float64_and_return_float32_roots(ray_local, pool):
    import ray

    from optserve.optim_kernels import OPTIMIZERS
    from optserve.server.compute.preconditioner_worker import RootComputation

    config = PoolConfig(workers=1, f64=True)
    (worker,) = start_workers(config)
    try:
        rng = np.random.default_rng(0)
        a = rng.standard_normal((2, 12, 12))
        spd = a @ a.transpose(0, 2, 1) + 1e-3 * np.eye(12)
        seam = OPTIMIZERS["shampoo"].root_offload
        kernel = seam.config(learning_rate=0.1, matrix_epsilon=0.0, relative_matrix_epsilon=False, root_method="eigh")
        options = RootComputation(seam.compute_roots, seam.root_config(kernel))
        args = (spd.astype(np.float32), np.array([2, 4], np.int32), np.array([12, 12], np.int32), options)
        roots, errors = ray.get(worker.compute.remote(*args))
        assert ray.get(worker.info.remote())["x64"] and not ray.get(pool.workers[0].info.remote())["x64"]
        assert roots.dtype == np.float32 and errors.shape == (2,)
        for root, matrix, p in zip(roots, spd.astype(np.float32).astype(np.float64), (2, 4)):
            w, v = np.linalg.eigh(matrix)
            exact = (v * w ** (-1.0 / p)) @ v.T
            assert np.max(np.abs(root - exact)) <= 1e-5 * np.max(np.abs(exact))
    finally:
        ray.kill(worker)
