"""Properties every Adafactor variant shares: dtypes, one compile per tree, donation, descent."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from optserve.optim_kernels.adafactor import second_moment
from optserve.optim_kernels.adafactor import adafactor, adafactor_hf, adafactor_t2t
from optserve.optim_kernels.adafactor.factoring import FactorSpec

VARIANTS = {
    "t5x": lambda: adafactor(learning_rate=0.05, beta1=0.9, weight_decay_rate=1e-3, min_dim_size_to_factor=2),
    "hf": lambda: adafactor_hf(beta1=0.9, weight_decay=1e-3),
    "t2t": lambda: adafactor_t2t(beta1=0.9, stochastic_rounding=False),
}
SHAPES = {"w": (4, 6), "b": (6,)}


def _tree(dtype, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(rng.normal(size=s) * scale, dtype) for k, s in SHAPES.items()}


def _step(tx):
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_low_precision_params_are_computed_in_f32_and_rounded_once_to_their_dtype(variant, dtype):
    tx = VARIANTS[variant]()
    params, grads = _tree(dtype), _tree(dtype, seed=1)
    new_params, state = jax.jit(_step(tx))(params, tx.init(params), grads)
    updates, _ = tx.update(grads, tx.init(params), params)
    assert all(u.dtype == dtype for u in jax.tree.leaves(updates))  # optax: update dtype = param dtype
    # Same math on the float32 upcasts, rounded once at the end.
    up = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)  # noqa: E731
    ref, ref_state = jax.jit(_step(tx))(up(params), tx.init(up(params)), up(grads))
    for k in SHAPES:
        assert new_params[k].dtype == dtype
        np.testing.assert_array_equal(np.asarray(new_params[k]), np.asarray(ref[k].astype(dtype)))
    for leaf in jax.tree.leaves(state):
        if jnp.issubdtype(leaf.dtype, jnp.floating) and variant != "t2t":
            assert leaf.dtype == jnp.float32  # t2t stores momentum in the param dtype


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_jit_traces_once_per_tree_structure(variant):
    tx = VARIANTS[variant]()
    traces = []

    def counted(params, state, grads):
        traces.append(1)
        return _step(tx)(params, state, grads)

    step = jax.jit(counted)
    params = _tree(jnp.float32)
    state = tx.init(params)
    for seed in range(3):
        params, state = step(params, state, _tree(jnp.float32, seed=seed + 1))
    assert len(traces) == 1
    other = {"only": jnp.ones((3, 2))}
    step(other, tx.init(other), other)
    assert len(traces) == 2


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_params_and_state_buffers_can_be_donated(variant):
    tx = VARIANTS[variant]()
    step = jax.jit(_step(tx), donate_argnums=(0, 1))
    params = _tree(jnp.float32)
    state = tx.init(params)
    params, state = step(params, state, _tree(jnp.float32, seed=1))  # warm up
    old = jax.tree.leaves((params, state))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Some donated buffers were not usable" would raise
        params, state = step(params, state, _tree(jnp.float32, seed=2))
    assert all(leaf.is_deleted() for leaf in old)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_descends_on_a_quadratic(variant):
    tx = VARIANTS[variant]()
    target = _tree(jnp.float32, seed=3, scale=0.5)
    loss = lambda p: sum(jnp.sum((p[k] - target[k]) ** 2) for k in p)  # noqa: E731

    @jax.jit
    def run(params):
        def body(carry, _):
            params, state = carry
            return _step(tx)(params, state, jax.grad(loss)(params)), None

        (params, _), _ = jax.lax.scan(body, (params, tx.init(params)), None, length=300)
        return params

    start = _tree(jnp.float32, seed=4, scale=0.5)
    assert float(loss(run(start))) < 0.5 * float(loss(start))


_CLIP_SPECS = {
    "matrix": ((6, 9), FactorSpec((0,), (1,), (0, 1))),
    "leading axis kept, rms over all (HF)": ((3, 5, 7), FactorSpec((1,), (2,), (0, 1, 2))),
    "BATCH axis 0 and NONE axis 2 (T5X rules)": ((3, 5, 4, 6), FactorSpec((1,), (3,), (1, 2, 3))),
    "two column axes": ((5, 2, 3), FactorSpec((0,), (1, 2), (0, 1, 2))),
}


@pytest.mark.parametrize("case", sorted(_CLIP_SPECS))
def test_update_clipping_of_a_factored_block_equals_clipping_the_written_out_update(case):
    # The link reads rms(u) off g and the factors; this computes u first and clips it directly.
    shape, spec = _CLIP_SPECS[case]
    rng = np.random.default_rng(3)
    grads = {"w": jnp.asarray(rng.normal(size=shape) * rng.uniform(0.1, 10, size=shape), jnp.float32)}
    factoring = lambda path, s: spec  # noqa: E731
    clipped = second_moment.scale_by_factored_rms(factoring, 0.5, 1e-30, clipping_threshold=0.3)
    unclipped = second_moment.scale_by_factored_rms(factoring, 0.5, 1e-30)
    got, _ = jax.jit(clipped.update)(grads, clipped.init(grads))
    u, _ = jax.jit(unclipped.update)(grads, unclipped.init(grads))
    u = np.asarray(u["w"], np.float64)
    rms = np.sqrt(np.mean(u * u, axis=spec.averaging_axes, keepdims=True))
    expected = u / np.maximum(1.0, rms / 0.3)
    assert np.all(rms / 0.3 > 1.0)  # clipping is active in every block
    np.testing.assert_allclose(np.asarray(got["w"]), expected, rtol=2e-6, atol=0)
