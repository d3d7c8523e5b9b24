"""SOAP through the service: sharded sessions reproduce the in-process kernel, and its eigenbases
come from the preconditioner workers through the root offload seam.

* the shared 2-shard server (no workers: each shard refreshes its bases inside its update) must
  equal 20 jitted in-process steps over the whole model to 1e-6;
* the per-shard offload loop (``OffloadedPreconditioners`` driven as a shard drives it, real
  workers on the local Ray, no gRPC) with ``max_age=0`` must equal the in-process kernel, and
  asynchronous bases must stay within the age bound;
* a server with 2 shards and 2 workers: the same equality over gRPC, and ``session.status()``
  shows every basis' age.

Shapes are small and every statistic full rank (square matrices, a one-sided matrix, vectors
without a basis), so each shard's padded refresh gives the bases of the whole-model refresh.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from _service_helpers import InProcess, make_grads, make_params, max_abs_diff, root_pool
from optserve.client import Client
from optserve.optim_kernels import build_optimizer
from optserve.server.compute.root_offload import (
    OffloadedPreconditioners,
    ShardPreconditioners,
    build_shard_optimizer,
    required_source_step,
)

STEPS = 20
SHAPES = {"embed": (16, 12), "hidden/w": (12, 12), "hidden/b": (12,), "out/w": (6, 6), "gain": ()}
# embed's 16 > max_precondition_dim: one-sided; four refreshes in 20 steps
ARGS = {"learning_rate": 0.01, "precondition_frequency": 4, "max_precondition_dim": 12}


def _blocks(status) -> list:
    return [b for shard in status.shards for b in shard.preconditioners]


# ------------------------------------------------------------------------- in-update refresh, 2 shards


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address, timeout=120) as c:
        yield c


def test_sync_two_shards_match_the_in_process_kernel_for_20_steps(client, unique_name):
    params = make_params(seed=4, shapes=SHAPES)
    reference = InProcess("soap", ARGS, params)
    session = client.create_session(unique_name, params, optimizer={"name": "soap", "args": ARGS})
    try:
        assert len(session.info.shards) == 2
        worst = 0.0
        for step in range(STEPS):
            grads = make_grads(params, step, seed=7)
            got = session.push_pull(grads)
            worst = max(worst, max_abs_diff(got, reference.step(grads)))
        assert session.version == STEPS
        assert worst <= 1e-6, f"max abs difference {worst:.3g} over {STEPS} steps"
        assert max_abs_diff(got, params) > 1e-2  # the optimizer really moved the parameters
        status = session.status()
        assert not any(s.root_offload.offloaded for s in status.shards)
        # after update 19 the bases are those of the refresh at step 16: 3 steps old
        assert len(_blocks(status)) == 5 and all(b.age == 3 and b.failures == 0 for b in _blocks(status))
    finally:
        session.close()


# ------------------------------------------------------------------------- the offload loop, real workers


@pytest.fixture(scope="module")
def pool(ray_local):
    yield from root_pool(ray_local)


def _params(seed):
    return {k: jax.numpy.asarray(v) for k, v in make_params(seed=seed, shapes=SHAPES).items()}


def _drive(po, tx, params, steps, on_step=None):
    """What a shard does per step (``before_update`` -> jitted update -> ``after_update``)."""

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    out = []
    for t in range(steps):
        grads = {k: jax.numpy.asarray(v) for k, v in make_grads(params, t, seed=9).items()}
        state = po.before_update(state, grads, params)
        params, state = step(params, state, grads)
        state = po.after_update(state)
        out.append(params)
        if on_step is not None:
            on_step(t, po)
    return out, state


def _offloaded(pool, max_age):
    params = _params(5)
    optimizer, po = build_shard_optimizer("soap", ARGS, {k: v.shape for k, v in params.items()}, pool,
                                          max_age=max_age)
    assert isinstance(po, OffloadedPreconditioners) and optimizer.args["inline_bases"] is False
    return po, optimizer.transformation, params


def _max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x[k]) - np.asarray(y[k])))) for x, y in zip(a, b) for k in x)


def test_required_source_step_of_a_lagging_seam_is_the_previous_refresh():
    # SOAP (lag 1) updates with the bases refreshed at the end of the last refresh step before them
    assert [required_source_step(t, 4, 0, lag=1) for t in range(10)] == [-4, 0, 0, 0, 0, 4, 4, 4, 4, 8]
    assert [required_source_step(t, 4, 6, lag=1) for t in range(8, 11)] == [2, 3, 4]


def test_age_bound_zero_reproduces_in_process_soap_with_workers(pool):
    po, tx, params = _offloaded(pool, max_age=0)
    got, _ = _drive(po, tx, params, 13)
    in_process, _ = _drive(ShardPreconditioners(po.seam, po.config, po.labels),
                           build_optimizer("soap", ARGS).transformation, params, 13)
    assert _max_diff(got, in_process) <= 1e-6
    assert po.roots_installed == len(range(0, 12, 4))  # the refreshes of steps 0, 4 and 8
    # after update 12 the bases are those of step 8 (step 12's are still on their way)
    assert all(b.age == 4 and b.failures == 0 for b in po.status().blocks)


def test_asynchronous_bases_arrive_and_their_ages_stay_within_the_bound(pool):
    po, tx, params = _offloaded(pool, max_age=8)
    ages = []
    _drive(po, tx, params, 24, on_step=lambda t, p: ages.append([b.age for b in p.status().blocks]))
    assert po.roots_installed >= 3 and po.status().max_age == 8
    assert all(age <= 8 for step_ages in ages for age in step_ages)
    assert all(age >= 0 for step_ages in ages[8:] for age in step_ages)  # -1: no basis yet (identity)
    assert all(b.failures == 0 for b in po.status().blocks)


def test_a_batch_computed_on_the_shard_gets_the_bases_in_use_too(pool):
    # the local fallback (workers unreachable or late) runs the same computation, previous included
    from optserve.optim_kernels import OPTIMIZERS

    seam = OPTIMIZERS["soap"].root_offload
    po, tx, params = _offloaded(pool, max_age=0)
    _, state = _drive(po, tx, params, 6)  # bases of step 4 installed: the next refresh is a QR step
    exported = seam.export(state, po.config)
    job = pool.submit(np.asarray(exported.statistics), np.asarray(exported.exponents), np.asarray(exported.sizes),
                      int(exported.step), po._computation, previous=np.asarray(exported.previous))
    pool.finish_locally(job)
    local, local_errors = pool.result(job)
    expected, _ = seam.compute_roots(exported.statistics, exported.exponents, exported.sizes,
                                     seam.root_config(po.config), exported.previous)
    assert set(np.asarray(exported.exponents).tolist()) == {1}  # REFRESH_POWER: previous is read
    np.testing.assert_allclose(local, np.asarray(expected), atol=1e-5)
    assert np.all(local_errors < 1e-4)


# ------------------------------------------------------------------------- over gRPC, with workers


@pytest.fixture(scope="module")
def precond_client(ray_local):
    """An embedded server with 2 shards and 2 preconditioner workers (module-scoped)."""
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig

    running = start_server(ServerConfig(host="127.0.0.1", port=0, shards=2, ray_address="local", precond_workers=2,
                                         min_shard_bytes=0))
    try:
        with Client(running.address, timeout=120) as c:
            yield c
    finally:
        running.stop()


def test_offloaded_bases_reproduce_in_process_soap_on_two_shards_and_status_shows_their_ages(
        precond_client, unique_name):
    params = make_params(seed=6, shapes=SHAPES)
    reference = InProcess("soap", ARGS, params)
    session = precond_client.create_session(
        unique_name, params, optimizer={"name": "soap", "args": ARGS, "preconditioners": {"max_age": 0}})
    try:
        assert len(session.info.shards) == 2
        worst = 0.0
        for step in range(10):
            grads = make_grads(params, step, seed=7)
            worst = max(worst, max_abs_diff(session.push_pull(grads), reference.step(grads)))
        assert worst <= 1e-6, f"max abs difference {worst:.3g}"
        status = session.status()
        assert all(s.root_offload.offloaded and s.root_offload.max_age == 0 for s in status.shards)
        assert sum(s.root_offload.roots_installed for s in status.shards) >= 2 * 2  # steps 0 and 4, per shard
        blocks = _blocks(status)
        # one basis per preconditioned axis: embed's 12-side, hidden/w's two, out/w's two
        assert sorted((b.tensor, b.dim, b.size) for b in blocks) == [
            ("embed", 1, 12), ("hidden/w", 0, 12), ("hidden/w", 1, 12), ("out/w", 0, 6), ("out/w", 1, 6)]
        # after update 9: the bases of step 8 (the refresh of step 8, installed before update 9);
        # update 0 (a zero update) is the one that ran without a basis
        assert all(b.age == 1 and b.failures == 0 and b.fallback_steps == 1 for b in blocks)
    finally:
        session.close()
