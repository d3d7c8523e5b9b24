"""tensor2tensor adafactor: default schedules, factoring of matrices only, unbiased bf16 rounding."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from transformers.optimization import Adafactor as TorchAdafactor

from optserve.optim_kernels.adafactor import schedules
from optserve.optim_kernels.adafactor import adafactor_t2t
from optserve.optim_kernels.adafactor.second_moment import FactoredRmsState


def _find(state, kind):
    return next(s for s in state if isinstance(s, kind))


def _step_fn(tx):
    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


@pytest.mark.parametrize("beta1", [0.0, 0.9])
def test_defaults_equal_huggingface_defaults_on_vectors_and_matrices(beta1):
    # Both use min(1/sqrt(step+1), 1e-2) * max(rms(param), 1e-3), decay 1 - t**-0.8, clip 1.0.
    shapes = {"v": (6,), "m": (5, 3)}
    rng = np.random.default_rng(0)
    init = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    ref_params = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in init.items()}
    ref = TorchAdafactor(list(ref_params.values()), beta1=beta1 or None)
    tx = adafactor_t2t(beta1=beta1)
    params = {k: jnp.asarray(v) for k, v in init.items()}
    state, step = tx.init(params), _step_fn(tx)
    for _ in range(30):
        grads = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
        for k, g in grads.items():
            ref_params[k].grad = torch.tensor(g)
        ref.step()
        params, state = step(params, state, {k: jnp.asarray(g) for k, g in grads.items()})
    for k in shapes:
        np.testing.assert_allclose(np.asarray(params[k]), ref_params[k].detach().numpy(), rtol=1e-5, atol=1e-7)


def test_only_rank_two_params_are_factored():
    tx = adafactor_t2t()
    state = _find(tx.init({"m": jnp.zeros((1, 3)), "t": jnp.zeros((2, 3, 4))}), FactoredRmsState)
    assert state.v_row["m"].shape == (1,) and state.v_col["m"].shape == (3,)
    assert state.v["t"].shape == (2, 3, 4) and state.v_row["t"] is None


@pytest.mark.parametrize("scale, expected_lr", [(True, 0.01), (False, 0.01 * 0.05)])
def test_first_step_size_is_the_default_relative_step(scale, expected_lr):
    # Step 0: decay 0, so v = g^2 and the update direction is sign(g) with rms 1 (no clipping).
    params = {"w": jnp.array([3.0, -4.0, 0.0, 0.0])}  # rms 2.5
    grads = {"w": jnp.array([0.5, -2.0, 1e-3, -7.0])}
    tx = adafactor_t2t(multiply_by_parameter_scale=scale)
    updates, _ = tx.update(grads, tx.init(params), params)
    magnitude = expected_lr * (2.5 if scale else 1.0)
    np.testing.assert_allclose(np.asarray(updates["w"]), -magnitude * np.sign(grads["w"]), rtol=1e-6)


def test_schedules_match_their_formulas():
    pow_decay, adam_decay = schedules.decay_rate_pow(0.8), schedules.decay_rate_adam(0.9)
    for count in [0, 1, 5, 99]:
        t = count + 1.0
        assert float(pow_decay(count)) == pytest.approx(1 - t**-0.8, rel=1e-6, abs=1e-7)
        assert float(adam_decay(count)) == pytest.approx(0.9 * (1 - 0.9 ** (t - 1)) / (1 - 0.9**t), abs=1e-6)
        assert float(schedules.relative_step_t2t(False)(count)) == pytest.approx(min(t**-0.5, 0.01) * 0.05)
        assert float(schedules.relative_step_hf(True)(count)) == pytest.approx(min(1e-6 * t, t**-0.5))
    assert float(schedules.decay_rate_pow(0.8, offset=5)(5)) == 0.0  # T5X step_offset restarts


def test_adam_decay_type_uses_the_bias_corrected_beta2():
    params = {"w": jnp.ones(3)}
    g1, g2 = np.array([1.0, 2.0, 3.0]), np.array([-2.0, 0.5, 1.0])
    tx = adafactor_t2t(decay_type="adam", beta2=0.9)
    state = tx.init(params)
    for g in (g1, g2):
        _, state = tx.update({"w": jnp.asarray(g, jnp.float32)}, state, params)
    d = 0.9 * (1 - 0.9) / (1 - 0.9**2)  # second step; the first has decay 0
    expected = d * g1**2 + (1 - d) * g2**2
    np.testing.assert_allclose(np.asarray(_find(state, FactoredRmsState).v["w"]), expected, rtol=1e-6)


@pytest.mark.parametrize("seed", [None, 0], ids=["golden_ratio_noise", "random_noise"])
def test_bf16_params_drift_by_sub_ulp_updates_only_with_stochastic_rounding(seed):
    # Each step moves a bf16 1.0 down by 2**-10, a quarter of its ulp: round-to-nearest never moves.
    lr, steps = 2.0**-10, 100
    params = {"w": jnp.ones(256, jnp.bfloat16)}
    grads = {"w": jnp.ones(256, jnp.bfloat16)}
    kw = dict(learning_rate=lr, multiply_by_parameter_scale=False, rounding_seed=seed)
    results = {}
    for rounding in (True, False):
        tx = adafactor_t2t(stochastic_rounding=rounding, **kw)
        p, state, step = params, tx.init(params), _step_fn(tx)
        for _ in range(steps):
            p, state = step(p, state, grads)
        assert p["w"].dtype == jnp.bfloat16
        results[rounding] = np.asarray(p["w"].astype(jnp.float32), np.float64)
    assert np.all(results[False] == 1.0)
    expected = 1.0 - steps * lr
    assert abs(results[True].mean() - expected) < 0.1 * steps * lr


def test_seeded_rounding_noise_of_a_tensor_does_not_depend_on_the_other_tensors():
    # A sharded session updates each shard's subset of the tensors: the noise that rounds a
    # tensor must follow its name, not its position among whichever tensors share its update.
    lr, steps = 2.0**-10, 20
    b = jnp.ones(256, jnp.bfloat16)
    tx = adafactor_t2t(learning_rate=lr, multiply_by_parameter_scale=False, rounding_seed=0)
    trees = {"alone": {"b": b}, "with_another": {"a": jnp.ones(64, jnp.bfloat16), "b": b}}
    results = {}
    for label, params in trees.items():
        grads = jax.tree.map(jnp.ones_like, params)
        p, state, step = params, tx.init(params), _step_fn(tx)
        for _ in range(steps):
            p, state = step(p, state, grads)
        results[label] = np.asarray(p["b"].astype(jnp.float32))
    assert not np.all(results["alone"] == 1.0)  # the rounding did move some entries
    np.testing.assert_array_equal(results["alone"], results["with_another"])


def test_unknown_decay_type_raises_naming_the_option():
    with pytest.raises(ValueError, match="decay_type"):
        adafactor_t2t(decay_type="linear")
