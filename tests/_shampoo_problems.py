"""Small deterministic problems shared by the Shampoo tests (no test functions here)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def make_params(seed: int = 0, *, rows: int = 8, cols: int = 6, tensor: tuple = (2, 3, 4)) -> dict:
    """A ``[rows, cols]`` matrix ``w``, a ``[cols]`` vector ``b`` and a rank-3 tensor ``k`` (f32).

    The defaults are the small problem most tests use; :data:`BLOCKED_PROBLEM` is one whose
    dimensions span several blocks of 16 and 32 and whose rank-3 tensor merges differently
    depending on ``merge_small_dims_block_size``.
    """
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(rng.standard_normal((rows, cols)), jnp.float32),
        "b": jnp.asarray(rng.standard_normal((cols,)), jnp.float32),
        "k": jnp.asarray(rng.standard_normal(tuple(tensor)), jnp.float32),
    }


# w [96, 40]: blocks of 16, 32 and 64 cut it, 128 does not. k [3, 8, 24]: merging small dims up
# to 16 keeps (3, 8, 24), up to 32, 64 or 128 gives (24, 24), up to 4096 gives (576,).
BLOCKED_PROBLEM = dict(rows=96, cols=40, tensor=(3, 8, 24))


def _batch(step: int, params: dict):
    rng = np.random.default_rng(1000 + step)
    rows, cols = params["w"].shape
    x = jnp.asarray(rng.standard_normal((16, rows)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((16, cols)), jnp.float32)
    z = jnp.asarray(rng.standard_normal((16, *params["k"].shape)), jnp.float32)
    return x, y, z


def loss(params, batch):
    x, y, z = batch
    fit = jnp.mean((x @ params["w"] + params["b"] - y) ** 2)
    tensor = jnp.mean(jnp.einsum("nabc,abc->n", z, params["k"]) ** 2)
    return fit + tensor


def gradient(params, step: int):
    """Gradient on the minibatch of ``step`` (fresh random data each step)."""
    return jax.grad(loss)(params, _batch(step, params))


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
