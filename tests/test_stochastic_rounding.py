"""Unbiased float32 -> bfloat16 rounding."""

import jax
import jax.numpy as jnp
import numpy as np

from optserve.optim_kernels.adafactor import stochastic_rounding as sr

ONE_QUARTER_ULP_ABOVE_ONE = 1.0 + 2.0**-9  # bf16 neighbours: 1 and 1 + 2**-7


def test_result_is_always_one_of_the_two_bfloat16_neighbours():
    x = jax.random.normal(jax.random.key(0), (4096,), jnp.float32) * 10.0
    out = np.asarray(sr.to_bfloat16_unbiased(x, sr.random_noise(jax.random.key(1), x.shape)).astype(jnp.float32))
    xs = np.asarray(x)
    bits = xs.view(np.uint32)
    down = (bits & 0xFFFF0000).view(np.float32)  # toward zero
    up = ((bits & 0xFFFF0000) + 0x10000).view(np.float32)  # away from zero
    assert np.all((out == down) | (out == up))


def test_random_noise_is_unbiased_where_round_to_nearest_is_biased():
    x = jnp.full((200_000,), ONE_QUARTER_ULP_ABOVE_ONE, jnp.float32)
    nearest = x.astype(jnp.bfloat16).astype(jnp.float32)
    assert float(jnp.mean(nearest)) == 1.0  # round-to-nearest always loses the 2**-9
    noise = sr.random_noise(jax.random.key(7), x.shape)
    stochastic = sr.to_bfloat16_unbiased(x, noise).astype(jnp.float32)
    bias = float(np.mean(np.asarray(stochastic, np.float64))) - ONE_QUARTER_ULP_ABOVE_ONE
    assert abs(bias) < 2.0**-9 / 20  # 5% of round-to-nearest's bias (about 8 standard errors)


def test_golden_ratio_noise_is_unbiased_over_steps_for_negative_values():
    x = jnp.float32(-ONE_QUARTER_ULP_ABOVE_ONE)
    steps = jnp.arange(4000)
    rounded = jax.vmap(lambda c: sr.to_bfloat16_unbiased(x, sr.golden_ratio_noise(c)))(steps)
    mean = float(np.mean(np.asarray(rounded.astype(jnp.float32), np.float64)))
    assert abs(mean - float(x)) < 2.0**-9 / 20


def test_golden_ratio_noise_is_the_fractional_part_of_phi_times_step_plus_one():
    phi = (5**0.5 - 1) / 2
    for count in [0, 1, 2, 10, 12345, 2**30]:
        expected = int(((phi * (count + 1)) % 1.0) * 2**16)
        assert abs(int(sr.golden_ratio_noise(jnp.int32(count))) - expected) <= 1


def test_representable_and_non_finite_values_pass_through_unchanged():
    x = jnp.array([0.0, -0.0, 1.0, -2.5, 65280.0, jnp.inf, -jnp.inf, jnp.nan], jnp.float32)
    for noise in [0, 0xFFFF]:
        out = sr.to_bfloat16_unbiased(x, jnp.uint32(noise)).astype(jnp.float32)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(x))
