"""Delayed Nesterov (Liu et al. 2024, Algorithm 3): the degenerate case, the paper's equations, the options.

* ``delay = 1`` is Nesterov SGD: the trajectory of ``optax.sgd(lr, momentum, nesterov=True)``.
* ``delay = 3`` follows a NumPy transcription of Algorithm 3 (float64, a list of buffered
  pseudo-gradients, written from the paper's pseudo-code rather than from the kernel).
* With ``c = 0`` every cycle of ``N`` arrivals ends where one Nesterov step on their mean ends.
* A bad option is a ValueError naming it, through the registry and from the constructor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optserve.optim_kernels.delayed_nesterov import (
    DelayedNesterovState,
    delayed_nesterov,
)
from optserve.optim_kernels.registry import build_optimizer

SHAPES = {"w": (4, 3), "b": (3,), "s": ()}


def _normal(rng, shape):
    """float64 values that float32 holds exactly: the kernel and the reference see the same inputs."""
    return rng.normal(size=shape).astype(np.float32).astype(np.float64)


def _pseudo_gradients(steps, seed=0):
    rng = np.random.default_rng(seed)
    return [{name: _normal(rng, shape) for name, shape in SHAPES.items()} for _ in range(steps)]


def _initial_params(seed=1):
    rng = np.random.default_rng(seed)
    return {name: _normal(rng, shape) for name, shape in SHAPES.items()}


def _run(tx, params, pseudo_gradients):
    """Params (float64 NumPy) after each arrival, the transformation run jitted in float32."""
    params = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
    state = tx.init(params)

    @jax.jit
    def step(params, state, g):
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    trajectory = []
    for g in pseudo_gradients:
        params, state = step(params, state, jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), g))
        trajectory.append(jax.tree.map(lambda p: np.asarray(p, np.float64), params))
    return trajectory, state


def _max_difference(a, b):
    return max(float(np.max(np.abs(np.asarray(a[k]) - np.asarray(b[k])))) for k in a)


# ------------------------------------------------------------------------- delay 1


@pytest.mark.parametrize("momentum_activation", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_delay_one_reproduces_optax_nesterov_sgd_over_30_steps(momentum, momentum_activation):
    pseudo_gradients, params = _pseudo_gradients(30), _initial_params()
    ours, _ = _run(delayed_nesterov(0.1, momentum, delay=1, momentum_activation=momentum_activation),
                   params, pseudo_gradients)
    reference, _ = _run(optax.sgd(0.1, momentum, nesterov=True), params, pseudo_gradients)
    for step, (a, b) in enumerate(zip(ours, reference)):
        assert _max_difference(a, b) <= 1e-6, f"step {step}: {_max_difference(a, b)}"


def test_delay_one_reproduces_optax_nesterov_sgd_under_a_schedule():
    schedule = optax.linear_schedule(0.2, 0.02, transition_steps=30)
    pseudo_gradients, params = _pseudo_gradients(30), _initial_params()
    ours, _ = _run(delayed_nesterov(schedule, delay=1), params, pseudo_gradients)
    reference, _ = _run(optax.sgd(schedule, 0.9, nesterov=True), params, pseudo_gradients)
    assert _max_difference(ours[-1], reference[-1]) <= 1e-6


# ------------------------------------------------------------------------- Algorithm 3


def _algorithm_3(theta, pseudo_gradients, *, lr, beta, n, c):
    """Liu et al. (2024), Algorithm 3, one parameter dict at a time, in float64.

    ``lr`` is a function of t. Returns theta after each received pseudo-gradient.
    """
    theta = {k: np.array(v, np.float64) for k, v in theta.items()}
    m = {k: np.zeros_like(v) for k, v in theta.items()}
    buffered = []  # the pseudo-gradients received since the last momentum update
    out = []
    for t, g in enumerate(pseudo_gradients):
        buffered.append(g)
        eps = lr(t)
        if (t + 1) % n == 0:
            for k in theta:
                delta = sum(b[k] for b in buffered)
                m[k] = beta * m[k] + delta / n
                theta[k] = theta[k] - eps * ((1 - c * n + c) * beta * m[k] + g[k] / n)
            buffered = []
        else:
            for k in theta:
                theta[k] = theta[k] - eps * (c * beta * m[k] + g[k] / n)
        out.append({k: v.copy() for k, v in theta.items()})
    return out


@pytest.mark.parametrize("momentum_activation", [0.0, 0.25, 1 / 3])
def test_delay_three_follows_algorithm_3_of_the_paper_over_20_steps(momentum_activation):
    pseudo_gradients, params = _pseudo_gradients(20), _initial_params()
    ours, state = _run(delayed_nesterov(0.2, 0.9, delay=3, momentum_activation=momentum_activation),
                       params, pseudo_gradients)
    reference = _algorithm_3(params, pseudo_gradients, lr=lambda t: 0.2, beta=0.9, n=3, c=momentum_activation)
    for step, (a, b) in enumerate(zip(ours, reference)):
        assert _max_difference(a, b) <= 1e-6, f"step {step}: {_max_difference(a, b)}"
    assert int(state.count) == 20


def test_delay_three_evaluates_a_schedule_at_the_arrival_count():
    schedule = optax.exponential_decay(0.3, transition_steps=1, decay_rate=0.9)
    pseudo_gradients, params = _pseudo_gradients(20, seed=2), _initial_params(seed=3)
    ours, _ = _run(delayed_nesterov(schedule, 0.8, delay=3), params, pseudo_gradients)
    reference = _algorithm_3(params, pseudo_gradients, lr=lambda t: 0.3 * 0.9**t, beta=0.8, n=3, c=0.0)
    assert max(_max_difference(a, b) for a, b in zip(ours, reference)) <= 1e-6


def test_each_cycle_of_n_arrivals_ends_where_one_nesterov_step_on_their_mean_ends():
    n, cycles = 4, 5
    pseudo_gradients, params = _pseudo_gradients(n * cycles, seed=4), _initial_params(seed=5)
    ours, _ = _run(delayed_nesterov(0.3, 0.9, delay=n), params, pseudo_gradients)
    means = [{k: np.mean([g[k] for g in pseudo_gradients[i * n:(i + 1) * n]], axis=0) for k in SHAPES}
             for i in range(cycles)]
    nesterov, _ = _run(optax.sgd(0.3, 0.9, nesterov=True), params, means)
    for cycle in range(cycles):
        assert _max_difference(ours[(cycle + 1) * n - 1], nesterov[cycle]) <= 1e-6, cycle


# ------------------------------------------------------------------------- state


def test_state_keeps_momentum_still_between_momentum_updates_and_empties_the_sum_after_one():
    tx = delayed_nesterov(0.1, 0.9, delay=3)
    params = {"w": jnp.zeros((2, 2))}
    state = tx.init(params)
    assert isinstance(state, DelayedNesterovState) and int(state.count) == 0
    g = {"w": jnp.ones((2, 2))}
    momenta, sums = [], []
    for _ in range(6):
        _, state = tx.update(g, state)
        momenta.append(float(state.momentum["w"][0, 0]))
        sums.append(float(state.accumulated["w"][0, 0]))
    # m moves on arrivals 3 and 6 only: m = 0.9 * 0 + 3/3, then 0.9 * 1 + 3/3.
    np.testing.assert_allclose(momenta, [0, 0, 1, 1, 1, 1.9], rtol=1e-6)
    np.testing.assert_allclose(sums, [1, 2, 0, 1, 2, 0])
    assert int(state.count) == 6


def test_accumulator_dtype_sets_the_state_dtype_and_updates_keep_the_param_dtype():
    tx = delayed_nesterov(0.1, delay=2, accumulator_dtype="float32")
    params = {"w": jnp.ones((3,), jnp.bfloat16)}
    state = tx.init(params)
    assert state.momentum["w"].dtype == state.accumulated["w"].dtype == jnp.float32
    updates, state = jax.jit(tx.update)({"w": jnp.ones((3,), jnp.bfloat16)}, state)
    assert updates["w"].dtype == jnp.bfloat16 and state.momentum["w"].dtype == jnp.float32


# ------------------------------------------------------------------------- options


@pytest.mark.parametrize("args, option", [
    ({"learning_rate": -0.1, "delay": 2}, "learning_rate"),
    ({"learning_rate": float("inf"), "delay": 2}, "learning_rate"),
    ({"learning_rate": 0.1, "delay": 2, "momentum": 1.0}, "momentum"),
    ({"learning_rate": 0.1, "delay": 2, "momentum": -0.1}, "momentum"),
    ({"learning_rate": 0.1, "delay": 0}, "delay"),
    ({"learning_rate": 0.1, "delay": 2.5}, "delay"),
    ({"learning_rate": 0.1, "delay": 2.0}, "delay"),
    ({"learning_rate": 0.1, "delay": True}, "delay"),
    ({"learning_rate": 0.1, "delay": 2, "momentum_activation": -0.1}, "momentum_activation"),
    ({"learning_rate": 0.1, "delay": 4, "momentum_activation": 0.3}, "momentum_activation"),
    ({"learning_rate": 0.1, "delay": 2, "accumulator_dtype": "int32"}, "accumulator_dtype"),
    ({"learning_rate": 0.1}, "delay"),
    ({"learning_rate": 0.1, "delay": 2, "nesterov": True}, "nesterov"),
])
def test_a_bad_option_is_a_value_error_naming_it_through_the_registry(args, option):
    with pytest.raises(ValueError, match=rf"optimizer 'delayed_nesterov'.*'{option}'"):
        build_optimizer("delayed_nesterov", args)


def test_momentum_activation_admits_exactly_up_to_one_over_delay():
    build_optimizer("delayed_nesterov", {"learning_rate": 0.1, "delay": 4, "momentum_activation": 0.25})
    with pytest.raises(ValueError, match=r"'momentum_activation' = 0.26 .*<= 1 / delay = 0.25"):
        build_optimizer("delayed_nesterov", {"learning_rate": 0.1, "delay": 4, "momentum_activation": 0.26})


@pytest.mark.parametrize("kwargs, option", [
    ({"delay": 0}, "delay"),
    ({"delay": 2, "momentum": 1.5}, "momentum"),
    ({"delay": 2, "momentum_activation": 0.75}, "momentum_activation"),
])
def test_the_constructor_called_directly_refuses_the_same_values(kwargs, option):
    with pytest.raises(ValueError, match=rf"'{option}'"):
        delayed_nesterov(0.1, **kwargs)


def test_registry_builds_it_from_json_values():
    built = build_optimizer("delayed_nesterov", {"learning_rate": 1, "momentum": 0.9, "delay": 4,
                                                 "momentum_activation": 0.1, "accumulator_dtype": "float32"})
    assert built.name == "delayed_nesterov" and built.partial_statistic is None and built.root_offload is None
    built.transformation.init({"w": jnp.ones((2, 3))})
