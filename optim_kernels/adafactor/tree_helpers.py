"""Pytree and per-leaf helpers shared by Adafactor's links (pure; no state, no options)."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from optserve.optim_kernels.adafactor import factoring as fct


def flat(tree):
    """(paths, leaves, treedef) of a pytree; paths '/'-joined (:func:`.factoring.path_string`)."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [fct.path_string(p) for p, _ in with_path], [x for _, x in with_path], treedef


def leaves_up_to(treedef, tree, what: str) -> list:
    """Leaves of ``tree`` at ``treedef``'s leaf positions (``None`` entries allowed); ValueError
    naming ``what`` when ``tree`` does not have that structure."""
    try:
        return treedef.flatten_up_to(tree)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{what} does not have the structure of the params: {exc}") from None


def factor_spec(factoring: Optional[fct.Factoring], path: str, shape) -> fct.FactorSpec:
    """The :class:`.factoring.FactorSpec` of the param at ``path``; ``factoring=None``: unfactored."""
    return fct.unfactored(shape) if factoring is None else factoring(path, tuple(shape))


def f32(x):
    """``x`` as a float32 array."""
    return jnp.asarray(x).astype(jnp.float32)


def mean_square(x, axes):
    """``mean(x * x)`` over ``axes``, keepdims (float32)."""
    return jnp.mean(x * x, axis=tuple(axes), keepdims=True)
