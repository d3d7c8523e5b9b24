"""Small deterministic problems shared by the Shampoo tests (no test functions here)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def make_params(seed: int = 0) -> dict:
    """A matrix, a vector and a rank-3 tensor (f32)."""
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(rng.standard_normal((8, 6)), jnp.float32),
        "b": jnp.asarray(rng.standard_normal((6,)), jnp.float32),
        "k": jnp.asarray(rng.standard_normal((2, 3, 4)), jnp.float32),
    }


def _batch(step: int):
    rng = np.random.default_rng(1000 + step)
    x = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((16, 6)), jnp.float32)
    z = jnp.asarray(rng.standard_normal((16, 2, 3, 4)), jnp.float32)
    return x, y, z


def loss(params, batch):
    x, y, z = batch
    fit = jnp.mean((x @ params["w"] + params["b"] - y) ** 2)
    tensor = jnp.mean(jnp.einsum("nabc,abc->n", z, params["k"]) ** 2)
    return fit + tensor


def gradient(params, step: int):
    """Gradient on the minibatch of ``step`` (fresh random data each step)."""
    return jax.grad(loss)(params, _batch(step))


def run(tx, params, steps: int, *, between=None):
    """Runs ``steps`` jitted updates; returns the list of parameters after each step.

    ``between(state, grads) -> state`` (optional) runs before each update.
    """
    state = tx.init(params)
    update = jax.jit(tx.update)
    out = []
    for t in range(steps):
        g = gradient(params, t)
        if between is not None:
            state = between(state, g)
        u, state = update(g, state, params)
        params = jax.tree.map(lambda p, d: p + d, params, u)
        out.append(params)
    return out, state


def max_relative_difference(a_traj, b_traj) -> float:
    worst = 0.0
    for a, b in zip(a_traj, b_traj):
        for key in a:
            scale = float(jnp.max(jnp.abs(a[key])))
            worst = max(worst, float(jnp.max(jnp.abs(a[key] - b[key]))) / max(scale, 1e-30))
    return worst
