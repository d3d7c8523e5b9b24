"""Shampoo's own behaviour: degenerate equivalences, the offload seam, convergence, options."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from _shampoo_problems import make_params, max_relative_difference, run
from optserve.optim_kernels import build_optimizer
from optserve.optim_kernels.shampoo import (
    ShampooState,
    compute_preconditioners,
    export_statistics,
    install_preconditioners,
    preconditioner_age,
    shampoo,
    shampoo_config,
)
from optserve.optim_kernels.shampoo.quantization import QuantizedMatrix, QuantizedTensor

STEPS = 12


def _manual(step_fn):
    """A GradientTransformation from ``step_fn(g, acc, mom) -> (update, acc, mom)`` per leaf."""

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return (zeros, zeros)

    def update(grads, state, params=None):
        del params
        out = jax.tree.map(step_fn, grads, *state)
        pick = lambda i: jax.tree.map(lambda _, o: o[i], grads, out)
        return pick(0), (pick(1), pick(2))

    return optax.GradientTransformation(init, update)


def _adagrad(lr, eps):
    def step(g, acc, mom):
        acc = acc + g * g
        return -lr * (g / (jnp.sqrt(acc) + eps)), acc, mom

    return _manual(step)


def _rmsprop_heavy_ball(lr, beta2, beta1, eps):
    def step(g, acc, mom):
        acc = beta2 * acc + (1.0 - beta2) * g * g
        mom = beta1 * mom + g / (jnp.sqrt(acc) + eps)
        return -lr * mom, acc, mom

    return _manual(step)


@pytest.mark.parametrize(
    "graft, kwargs, expected",
    [
        ("sgd", dict(beta1=0.9, nesterov=True), lambda: optax.sgd(0.05, momentum=0.9, nesterov=True)),
        ("adagrad", dict(beta1=0.0, nesterov=False), lambda: _adagrad(0.05, 1e-10)),
        ("rmsprop", dict(beta1=0.5, beta2=0.99, nesterov=False), lambda: _rmsprop_heavy_ball(0.05, 0.99, 0.5, 1e-10)),
    ],
)
def test_preconditioning_never_started_reproduces_the_grafted_optimizer(graft, kwargs, expected):
    params = make_params()
    tx = shampoo(0.05, block_size=4, graft_type=graft, start_preconditioning_step=10_000,
                 best_effort_shape_interpretation=False, **kwargs)
    ours, _ = run(tx, params, STEPS)
    theirs, _ = run(expected(), params, STEPS)
    assert max_relative_difference(theirs, ours) <= 1e-6


def _seam_config(**overrides):
    kwargs = dict(learning_rate=0.05, block_size=4, graft_type="adagrad", start_preconditioning_step=2,
                  preconditioning_compute_steps=2, best_effort_shape_interpretation=False)
    kwargs.update(overrides)
    return kwargs


def _offload(config):
    """export -> compute_preconditioners -> install, as a worker round trip."""
    export = jax.jit(lambda s, g: export_statistics(s, config, g))
    compute = jax.jit(lambda x: compute_preconditioners(
        x.statistics, x.exponents, sizes=x.sizes, matrix_epsilon=config.matrix_epsilon, method=config.method))
    install = jax.jit(lambda s, r, e, step: install_preconditioners(s, config, r, e, step))

    def round_trip(state, grads=None):
        exported = export(state, grads)
        roots, errors = compute(exported)
        return install(state, roots, errors, exported.step)

    return round_trip


@pytest.mark.parametrize("method", ["eigh", "coupled_newton"])
def test_offloaded_roots_installed_before_each_preconditioning_step_reproduce_the_in_process_run(method):
    kwargs = _seam_config(root_method=method)
    config = shampoo_config(**kwargs)
    round_trip = _offload(config)

    def between(state, grads):
        if int(state.count) % config.preconditioning_compute_steps == 0:
            state = round_trip(state, grads)
            assert np.all(np.asarray(preconditioner_age(state)) == 0)
        return state

    params = make_params()
    in_process, _ = run(shampoo(**kwargs), params, STEPS)
    offloaded, state = run(shampoo(**kwargs, inline_preconditioners=False), params, STEPS, between=between)
    assert max_relative_difference(in_process, offloaded) == 0.0
    assert int(jnp.sum(state.preconditioner_info.failures)) == 0


def test_offload_after_each_update_installs_roots_one_step_old():
    kwargs = _seam_config(preconditioning_compute_steps=1)
    config = shampoo_config(**kwargs)
    round_trip = _offload(config)
    tx = shampoo(**kwargs, inline_preconditioners=False)
    params = make_params()
    state = tx.init(params)
    update = jax.jit(tx.update)
    for t in range(4):
        g = jax.tree.map(lambda p: jnp.full_like(p, 0.1 * (t + 1)) + p, params)
        _, state = update(g, state, params)
        state = round_trip(state)  # statistics of update t, used by update t + 1
        np.testing.assert_array_equal(np.asarray(state.preconditioner_info.source_step), t)
        np.testing.assert_array_equal(np.asarray(preconditioner_age(state)), 1)


def test_without_installed_roots_the_offload_mode_takes_the_grafted_step():
    kwargs = _seam_config(graft_type="sgd")
    params = make_params()
    waiting, _ = run(shampoo(**kwargs, inline_preconditioners=False), params, STEPS)
    grafted, _ = run(shampoo(**dict(kwargs, start_preconditioning_step=10_000)), params, STEPS)
    assert max_relative_difference(grafted, waiting) <= 1e-6


def test_install_keeps_the_previous_root_for_failed_or_nan_errors_and_counts_failures():
    kwargs = _seam_config()
    config = shampoo_config(**kwargs)
    params = make_params()
    state = shampoo(**kwargs).init(params)
    exported = export_statistics(state, config)
    b, n = exported.statistics.shape[:2]
    roots = jnp.broadcast_to(2.0 * jnp.eye(n), (b, n, n))
    errors = jnp.zeros((b,)).at[0].set(0.5).at[1].set(jnp.nan)
    new = install_preconditioners(state, config, roots, errors, jnp.asarray(7))
    info = new.preconditioner_info
    np.testing.assert_array_equal(np.asarray(info.failures)[:3], [1, 1, 0])
    np.testing.assert_array_equal(np.asarray(info.source_step)[:3], [-1, -1, 7])
    # Export order: b (blocks of 4 and 2), then k (one block, dims 2, 3, 4), then w.
    b_roots, k_roots = new.params["b"].preconditioners, new.params["k"].preconditioners
    np.testing.assert_array_equal(np.asarray(b_roots[0]), np.eye(4))
    np.testing.assert_array_equal(np.asarray(b_roots[1]), np.eye(2))
    np.testing.assert_array_equal(np.asarray(k_roots[0]), 2.0 * np.eye(2))


def test_export_lists_every_block_in_a_stable_order_with_identity_padding():
    config = shampoo_config(0.1, block_size=3, best_effort_shape_interpretation=False)
    params = {"a": jnp.ones((3, 5)), "b": jnp.ones((4,)), "s": jnp.ones(())}
    state = shampoo(0.1, block_size=3, best_effort_shape_interpretation=False).init(params)
    exported = export_statistics(state, config)
    # a: blocks (3,3), (3,2) -> sizes 3,3,3,2 with p = 4; b: blocks (3,), (1,) with p = 2; s: skipped.
    np.testing.assert_array_equal(np.asarray(exported.sizes), [3, 3, 3, 2, 3, 1])
    np.testing.assert_array_equal(np.asarray(exported.exponents), [4, 4, 4, 4, 2, 2])
    assert exported.statistics.shape == (6, 3, 3) and int(exported.step) == -1
    last = np.asarray(exported.statistics[5])
    np.testing.assert_allclose(last, np.diag([1e-6, 1.0, 1.0]), rtol=1e-6)


@pytest.mark.parametrize("method", ["eigh", "coupled_newton"])
def test_identity_padding_of_the_stack_does_not_change_real_blocks(method):
    rng = np.random.default_rng(0)
    mats, sizes = [], [5, 3, 8]
    for d in sizes:
        x = rng.standard_normal((d, 2 * d))
        mats.append((x @ x.T / d).astype(np.float32))
    exps = np.array([2, 4, 6])
    alone = [compute_preconditioners(jnp.asarray(m)[None], jnp.asarray(exps[i:i + 1]), method=method)[0][0]
             for i, m in enumerate(mats)]
    stack = np.stack([np.eye(8, dtype=np.float32)] * 5)
    for i, m in enumerate(mats):
        stack[i, :m.shape[0], :m.shape[0]] = m
    roots, errors = compute_preconditioners(
        jnp.asarray(stack), jnp.asarray(np.concatenate([exps, [1, 1]])),
        sizes=jnp.asarray(sizes + [8, 8]), method=method)
    for i, d in enumerate(sizes):
        np.testing.assert_allclose(np.asarray(roots[i, :d, :d]), np.asarray(alone[i]), rtol=1e-5, atol=1e-6)
        assert np.all(np.asarray(roots[i, d:, :]) == 0)
    assert np.all(np.asarray(errors) < 1e-4)


def test_compute_preconditioners_runs_in_float64_when_x64_is_enabled():
    with jax.enable_x64(True):
        a = jnp.asarray(np.diag([4.0, 9.0, 1.0]))[None]
        roots, _ = jax.jit(lambda x: compute_preconditioners(x, jnp.asarray([2]), method="coupled_newton",
                                                             relative_matrix_epsilon=False,
                                                             matrix_epsilon=0.0))(a)
        assert roots.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(roots[0]), np.diag([0.5, 1 / 3, 1.0]), rtol=1e-12)


def test_shampoo_solves_a_small_least_squares_problem():
    rng = np.random.default_rng(3)
    a = jnp.asarray(rng.standard_normal((64, 12)) * np.geomspace(1, 30, 12), jnp.float32)
    target = jnp.asarray(rng.standard_normal((12, 3)), jnp.float32)
    b = a @ target
    loss = lambda w: jnp.mean((a @ w["w"] - b) ** 2)
    tx = shampoo(0.3, block_size=16, beta1=0.5, graft_type="adagrad", start_preconditioning_step=1)
    params = {"w": jnp.zeros((12, 3), jnp.float32)}
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        updates, state = tx.update(jax.grad(loss)(params), state, params)
        return optax.apply_updates(params, updates), state

    start = float(loss(params))
    for _ in range(150):
        params, state = step(params, state)
    assert float(loss(params)) < 1e-3 * start


def test_registry_builds_shampoo_from_json_arguments():
    for graft in ("rmsprop_normalized", 2, "SQRT_N"):
        built = build_optimizer("shampoo", {"learning_rate": 0.01, "block_size": 4, "graft_type": graft})
        params = make_params()
        updates, state = built.transformation.update(
            jax.tree.map(jnp.ones_like, params), built.transformation.init(params), params)
        assert isinstance(state, ShampooState)
        assert jax.tree.map(jnp.shape, updates) == jax.tree.map(jnp.shape, params)


@pytest.mark.parametrize(
    "args, option",
    [
        ({"beta1": 1.5}, "beta1"),
        ({"graft_type": "lion"}, "graft_type"),
        ({"block_size": -1}, "block_size"),
        ({"preconditioning_compute_steps": 0}, "preconditioning_compute_steps"),
        ({"root_method": "qr"}, "root_method"),
    ],
)
def test_bad_options_are_rejected_naming_the_option(args, option):
    with pytest.raises(ValueError, match=option):
        build_optimizer("shampoo", {"learning_rate": 0.1, **args})


def test_gradient_of_the_wrong_shape_is_rejected_naming_the_tensor():
    tx = shampoo(0.1)
    params = make_params()
    state = tx.init(params)
    bad = dict(params, w=jnp.ones((6, 8)))
    with pytest.raises(ValueError, match=r"\['w'\].*\(6, 8\)"):
        tx.update(bad, state, params)


def test_memory_reduction_stores_compact_state_and_tracks_the_full_precision_run():
    kwargs = dict(learning_rate=0.01, block_size=4, graft_type="adagrad", start_preconditioning_step=2,
                  best_effort_shape_interpretation=False)
    params = make_params()
    full, _ = run(shampoo(**kwargs), params, 8)
    compact, state = run(shampoo(**kwargs, best_effort_memory_usage_reduction=True), params, 8)
    w = state.params["w"]
    assert isinstance(w.momentum, QuantizedTensor) and w.momentum.values.dtype == jnp.int8
    assert isinstance(w.statistics[0], QuantizedMatrix) and w.statistics[0].values.dtype == jnp.int16
    assert isinstance(w.preconditioners[0], QuantizedMatrix)
    assert w.diagonal_statistics.dtype == jnp.bfloat16
    assert max_relative_difference(full, compact) < 2e-2
