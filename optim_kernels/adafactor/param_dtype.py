"""Adafactor's last links: the float32 update turned into one in each param's dtype, so that
``optax.apply_updates`` lands on the float32 result rounded once (:func:`cast_to_param_dtype`),
or, for bfloat16 params, on its unbiased stochastic rounding (:func:`round_to_bfloat16_unbiased`).
Both need params.
"""

from __future__ import annotations

import zlib
from typing import Optional

import jax
import jax.numpy as jnp
import optax

from optserve.optim_kernels.adafactor import stochastic_rounding as sr
from optserve.optim_kernels.adafactor.links import ScheduleCountState
from optserve.optim_kernels.adafactor.tree_helpers import f32, flat


def _delta_in_dtype(new_value, param):
    """``new_value - param`` in the param dtype. For ``new_value`` already in that dtype and
    within a factor 2 of ``param`` the difference is exact (Sterbenz), so ``param + delta``
    in that dtype gives back exactly ``new_value``."""
    return (f32(new_value) - f32(param)).astype(jnp.asarray(param).dtype)


def cast_to_param_dtype() -> optax.GradientTransformation:
    """Returns each update in its param's dtype. For params narrower than float32 the update
    is ``round(param + u) - param`` (round-to-nearest of the float32 result, then the
    difference), so the param is rounded once, not once for the update and again on add.
    Needs params."""

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("cast_to_param_dtype: update needs params")

        def one(u, p):
            dtype = jnp.asarray(p).dtype
            if jnp.dtype(dtype).itemsize >= 4:
                return jnp.asarray(u).astype(dtype)
            return _delta_in_dtype((f32(p) + f32(u)).astype(dtype), p)

        return jax.tree.map(one, updates, params), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def round_to_bfloat16_unbiased(seed: Optional[int] = None) -> optax.GradientTransformation:
    """For bfloat16 params, replaces the update so that ``param + update`` is the unbiased
    stochastic rounding of the exact float32 result (tensor2tensor); other params untouched.

    ``seed=None`` uses tensor2tensor's per-step golden-ratio noise (one value per step for
    every element); an int seed draws independent noise per element from
    ``fold_in(fold_in(key(seed), count), crc32(path))``: a tensor's noise follows its path, so it
    is the same whichever other tensors share the update (a shard holds a subset of them).
    bf16 updates are returned in bfloat16 (see :func:`cast_to_param_dtype` for why
    ``optax.apply_updates`` then lands on the rounded value).
    """

    def init(params):
        return ScheduleCountState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("round_to_bfloat16_unbiased: update needs params")
        paths, leaves, treedef = flat(updates)
        p_leaves = treedef.flatten_up_to(params)
        out = []
        step_key = None if seed is None else jax.random.fold_in(jax.random.key(seed), state.count)
        for path, u, p in zip(paths, leaves, p_leaves):
            if jnp.asarray(p).dtype != jnp.bfloat16:
                out.append(u)
                continue
            if seed is None:
                noise = sr.golden_ratio_noise(state.count)
            else:
                key = jax.random.fold_in(step_key, zlib.crc32(path.encode()) & 0x7FFFFFFF)
                noise = sr.random_noise(key, jnp.shape(p))
            rounded = sr.to_bfloat16_unbiased(f32(p) + f32(u), noise)
            out.append(_delta_in_dtype(rounded, p))
        return treedef.unflatten(out), ScheduleCountState(state.count + 1)

    return optax.GradientTransformation(init, update)
