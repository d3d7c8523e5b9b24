"""Properties every registered optimizer must have (in the manner of optax's ``alias_test``).

Each optimizer in :func:`optimizer_names` is built through :func:`build_optimizer` with the
small, fast arguments of :data:`ARGS` and must:

* converge on a noiseless, well-conditioned least-squares problem: the optimum has loss 0,
  so after 300 steps the loss must be below 1% of its starting value; a stalled or wrongly
  scaled step stays far above that, while constant-step adaptive methods, which hover at a
  distance of order ``lr`` from the optimum, end well below it (measured: adafactor
  variants near 0.1%, the others below 1e-6);
* converge on a 2-layer tanh MLP regressing a teacher MLP of the same architecture: the
  teacher is representable (loss 0 reachable), and predicting the mean gives about the
  starting loss (3.45 vs 3.41), so below 2% of it after 400 steps means the network explains
  98% of the target variance (measured: every registered optimizer ends below 0.4%);
* keep each parameter's dtype (f32 and bf16), and actually move the parameters;
* return updates in each parameter's dtype (optax's preserve-dtype contract);
* trace its jitted step once: the state an update returns has the init state's tree
  structure, shapes and dtypes (no recompilation on the second call);
* reject an unknown option with a ValueError that names it.

A registry entry without test arguments in :data:`ARGS` fails
:func:`test_every_optimizer_has_test_args`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from optserve.optim_kernels import build_optimizer, optimizer_names

ARGS = {
    "adam": dict(learning_rate=0.03),
    "adamw": dict(learning_rate=0.03, weight_decay=1e-4),
    "sgd": dict(learning_rate=0.1, momentum=0.9),
    "scaled_adam": dict(lr=0.05, clipping_scale=2.0, clipping_update_period=20),
    "adafactor": dict(learning_rate=0.05),
    "adafactor_hf": dict(lr=0.05, relative_step=False),
    "adafactor_t2t": dict(learning_rate=0.05),
    "muon": dict(learning_rate=0.02),
    "soap": dict(learning_rate=0.03, precondition_frequency=5),
    "delayed_nesterov": dict(learning_rate=0.2, delay=3),
    "shampoo": dict(
        learning_rate=0.05,
        block_size=4,
        start_preconditioning_step=3,
        preconditioning_compute_steps=2,
    ),
}
NAMES = optimizer_names()


def _build(name):
    return build_optimizer(name, ARGS[name]).transformation


def _train(tx, loss_fn, params, steps):
    """Runs ``steps`` jitted steps in one ``lax.scan``; returns (initial loss, final loss)."""

    def step(carry, _):
        params, state = carry
        grads = jax.grad(loss_fn)(params)
        updates, state = tx.update(grads, state, params)
        return (optax.apply_updates(params, updates), state), None

    @jax.jit
    def run(params):
        (params, _), _ = jax.lax.scan(step, (params, tx.init(params)), None, length=steps)
        return loss_fn(params)

    return float(loss_fn(params)), float(run(params))


def _least_squares():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(64, 8)), jnp.float32)
    w_true = jnp.asarray(rng.normal(size=(8, 2)), jnp.float32)
    b_true = jnp.asarray(rng.normal(size=(2,)), jnp.float32)
    y = x @ w_true + b_true

    def loss(p):
        return 0.5 * jnp.mean(jnp.square(x @ p["w"] + p["b"] - y))

    # Random (not zero) start: parameter-scaled methods step in proportion to the RMS.
    params = {
        "w": jnp.asarray(0.5 * rng.normal(size=(8, 2)), jnp.float32),
        "b": jnp.asarray(0.5 * rng.normal(size=(2,)), jnp.float32),
    }
    return loss, params


def _mlp_params(rng, n_in=4, hidden=16, scale=1.0):
    return {
        "hidden": {
            "w": jnp.asarray(scale * rng.normal(size=(n_in, hidden)) / np.sqrt(n_in), jnp.float32),
            "b": jnp.asarray(0.1 * rng.normal(size=(hidden,)), jnp.float32),
        },
        "out": {
            "w": jnp.asarray(scale * rng.normal(size=(hidden, 1)) / np.sqrt(hidden), jnp.float32),
            "b": jnp.asarray(0.1 * rng.normal(size=(1,)), jnp.float32),
        },
    }


def _mlp_apply(p, x):
    h = jnp.tanh(x @ p["hidden"]["w"].astype(jnp.float32) + p["hidden"]["b"].astype(jnp.float32))
    return h @ p["out"]["w"].astype(jnp.float32) + p["out"]["b"].astype(jnp.float32)


def _mlp():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(128, 4)), jnp.float32)
    y = _mlp_apply(_mlp_params(rng, scale=2.0), x)

    def loss(p):
        return 0.5 * jnp.mean(jnp.square(_mlp_apply(p, x) - y))

    return loss, _mlp_params(rng)


def test_every_optimizer_has_test_args():
    assert sorted(ARGS) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_converges_on_least_squares(name):
    loss, params = _least_squares()
    start, end = _train(_build(name), loss, params, steps=300)
    assert np.isfinite(end) and end < 0.01 * start, f"{name}: loss {start:.4g} -> {end:.4g}"


@pytest.mark.parametrize("name", NAMES)
def test_converges_on_two_layer_mlp(name):
    loss, params = _mlp()
    start, end = _train(_build(name), loss, params, steps=400)
    assert np.isfinite(end) and end < 0.02 * start, f"{name}: loss {start:.4g} -> {end:.4g}"


DTYPES = pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])


@functools.lru_cache(maxsize=None)
def _mlp_step(name):
    """``(tx, jitted step, traces)`` for the MLP; ``traces`` gets the param dtype per trace.

    Shared by the dtype and recompilation tests, so each optimizer compiles once per dtype.
    """
    loss, _ = _mlp()
    tx = _build(name)
    traces = []

    def step(params, state):
        traces.append(jax.tree_util.tree_leaves(params)[0].dtype)
        grads = jax.grad(loss)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), updates, state

    return tx, jax.jit(step), traces


@functools.lru_cache(maxsize=None)
def _three_steps(name, dtype):
    """Three jitted MLP steps on params of ``dtype``: (params, new params, last updates)."""
    _, params = _mlp()
    params = jax.tree_util.tree_map(lambda p: p.astype(dtype), params)
    tx, step, _ = _mlp_step(name)
    state = tx.init(params)
    new, updates = params, None
    for _ in range(3):
        new, updates, state = step(new, state)
    return params, new, updates


@DTYPES
@pytest.mark.parametrize("name", NAMES)
def test_keeps_param_dtypes_and_moves_params(name, dtype):
    params, new, _ = _three_steps(name, dtype)
    for before, after in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(new)):
        assert after.dtype == dtype and after.shape == before.shape
    moved = [
        not np.array_equal(np.asarray(b, np.float32), np.asarray(a, np.float32))
        for b, a in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(new))
    ]
    assert all(moved), f"{name}: some parameter did not change in 3 steps: {moved}"


@DTYPES
@pytest.mark.parametrize("name", NAMES)
def test_updates_have_the_param_dtype(name, dtype):
    # optax's contract (alias_test's preserve-dtype check): a bf16 param gets a bf16 update,
    # so no f32 copy of the model travels back from a shard.
    _, _, updates = _three_steps(name, dtype)
    wrong = {
        jax.tree_util.keystr(path): str(u.dtype)
        for path, u in jax.tree_util.tree_flatten_with_path(updates)[0]
        if u.dtype != dtype
    }
    assert not wrong, f"{name}: updates not in {jnp.dtype(dtype)}: {wrong}"


def _signature(tree):
    leaves = jax.tree_util.tree_leaves(tree)
    return jax.tree_util.tree_structure(tree), [
        (tuple(x.shape), jnp.result_type(x), getattr(x, "weak_type", False)) for x in leaves
    ]


@pytest.mark.parametrize("name", NAMES)
def test_jitted_step_traces_once_and_state_signature_is_stable(name):
    _, params = _mlp()
    tx, step, traces = _mlp_step(name)
    state = tx.init(params)
    initial = _signature(state)
    for _ in range(6):  # past shampoo's start_preconditioning_step and a root computation
        params, _, state = step(params, state)
        assert _signature(state) == initial
    f32_traces = [d for d in traces if d == jnp.float32]
    assert len(f32_traces) == 1, f"{name}: the f32 step was traced {len(f32_traces)} times"


@pytest.mark.parametrize("name", NAMES)
def test_unknown_option_is_rejected_naming_it(name):
    with pytest.raises(ValueError, match="no_such_option"):
        build_optimizer(name, {**ARGS[name], "no_such_option": 1})
