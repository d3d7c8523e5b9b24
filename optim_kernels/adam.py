"""Adam and AdamW whose decay rates may change between steps (optax's names, defaults and state).

:func:`adam` and :func:`adamw` take the options of ``optax.adam`` / ``optax.adamw`` and keep their
state (``optax.ScaleByAdamState`` in the same chain), so a checkpoint of either loads into the
other. What differs is how a decay rate ``b1`` / ``b2`` may be given: a number, as in optax, or a
:class:`~optserve.optim_kernels.hyperparams.Decay` ``(rate, complement)``, which is how a server's
step receives it (both traced, so a scheduler may change them without recompiling; see the
module docstring of :mod:`~optserve.optim_kernels.hyperparams` for why the complement travels
beside the rate).

Semantics of one step ``t`` (counting from 1), with the rates ``b1``, ``b2`` and complements
``c1 = 1 - b1``, ``c2 = 1 - b2`` in force at that step::

    m = c1 * g + b1 * m
    v = c2 * g * g + b2 * v
    m_hat = m / (1 - b1 ** t)                     (nesterov: b1 * m / (1 - b1 ** (t + 1))
                                                              + c1 * g / (1 - b1 ** t))
    v_hat = v / (1 - b2 ** t)
    update = -lr * (m_hat / (sqrt(v_hat + eps_root) + eps) [+ weight_decay * params, AdamW])

A number ``b`` gives ``c = 1 - b`` in Python's double precision, then each is rounded to the
moment's dtype where it multiplies: the numbers optax uses for a constant rate, in the same order
of operations, so a session whose rates never change equals ``optax.adam`` bit for bit. When a
rate changes mid-run the moments keep their values and the bias correction of step ``t`` uses
the rate in force at ``t`` (its history is not replayed): what ``torch.optim.Adam`` / ``AdamW`` do
when a scheduler cycles ``betas`` (``OneCycleLR``), and what optax does given a new ``b1``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import optax

from optserve.optim_kernels.hyperparams import Decay

__all__ = ["DECAY_RATES", "adam", "adamw", "scale_by_adam"]

DECAY_RATES = ("b1", "b2")  # the options of adam / adamw that may be given as a Decay

# The annotations are optax's (the registry reads them to check a value's type): a Decay is for callers
# inside a step, never a value a spec holds.
ArrayLike = jax.typing.ArrayLike
Rate = Union[ArrayLike, Decay]


def scale_by_adam(b1: Rate = 0.9, b2: Rate = 0.999, eps: ArrayLike = 1e-8, eps_root: ArrayLike = 0.0,
                  mu_dtype: Optional[Any] = None, *, nesterov: bool = False) -> optax.GradientTransformation:
    """Adam's rescaling (the module docstring's ``m_hat / (sqrt(v_hat + eps_root) + eps)``), with
    the state of ``optax.scale_by_adam``. ``b1`` / ``b2``: a number or a :class:`Decay`."""
    rate1, complement1 = Decay.of(b1)
    rate2, complement2 = Decay.of(b2)
    mu_dtype = None if mu_dtype is None else jax.dtypes.canonicalize_dtype(jnp.dtype(mu_dtype))

    def init(params):
        return optax.ScaleByAdamState(
            count=jnp.zeros([], jnp.int32),
            mu=jax.tree.map(lambda p: jnp.zeros_like(p, dtype=mu_dtype), params),
            nu=jax.tree.map(jnp.zeros_like, params))

    def update(updates, state, params=None):
        del params
        mu = jax.tree.map(lambda g, m: complement1 * g + rate1 * m, updates, state.mu)
        nu = jax.tree.map(lambda g, v: complement2 * (g * g) + rate2 * v, updates, state.nu)
        count = optax.safe_increment(state.count)
        if nesterov:
            mu_hat = jax.tree.map(lambda m, g: rate1 * m + complement1 * g,
                                  _bias_corrected(mu, rate1, optax.safe_increment(count)),
                                  _bias_corrected(updates, rate1, count))
        else:
            mu_hat = _bias_corrected(mu, rate1, count)
        nu_hat = _bias_corrected(nu, rate2, count)
        scaled = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + eps_root) + eps), mu_hat, nu_hat)
        if mu_dtype is not None:
            mu = jax.tree.map(lambda m: m.astype(mu_dtype), mu)
        nu = jax.tree.map(lambda v, old: v.astype(old.dtype), nu, state.nu)
        return scaled, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init, update)


@functools.partial(jax.jit, inline=True)
def _bias_corrected(moment, rate, count):
    """``moment / (1 - rate ** count)``, the correction taken in float32 (``rate ** count`` in a
    low-precision dtype would round to 1) and cast to each leaf's dtype. Jitted (inlined) so that
    ``rate ** count`` is the same power whether ``count`` is traced or concrete."""
    correction = 1 - rate ** count
    return jax.tree.map(lambda leaf: leaf / correction.astype(leaf.dtype), moment)


def adam(learning_rate: optax.ScalarOrSchedule, b1: ArrayLike = 0.9, b2: ArrayLike = 0.999, eps: ArrayLike = 1e-8,
         eps_root: ArrayLike = 0.0, mu_dtype: Optional[Any] = None, *,
         nesterov: bool = False) -> optax.GradientTransformationExtraArgs:
    """Adam (Kingma & Ba, Algorithm 1; ``nesterov``: Dozat's NAdam): ``optax.adam``'s options,
    defaults and state; ``b1`` / ``b2`` may also be a :class:`Decay` (see the module docstring)."""
    return optax.chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
                       optax.scale_by_learning_rate(learning_rate))


def adamw(learning_rate: optax.ScalarOrSchedule, b1: ArrayLike = 0.9, b2: ArrayLike = 0.999, eps: ArrayLike = 1e-8,
          eps_root: ArrayLike = 0.0, mu_dtype: Optional[Any] = None, weight_decay: optax.ScalarOrSchedule = 1e-4,
          mask: Optional[Union[Any, Callable[[optax.Params], Any]]] = None, *,
          nesterov: bool = False) -> optax.GradientTransformationExtraArgs:
    """AdamW (Loshchilov & Hutter): Adam's update plus ``weight_decay * params`` (where ``mask``
    is true), the sum scaled by ``-learning_rate``, so the decay is multiplied by the learning rate
    as in ``torch.optim.AdamW`` (a rate of 0 leaves the parameters as they are). ``optax.adamw``'s
    options, defaults and state; ``b1`` / ``b2`` may also be a :class:`Decay`."""
    return optax.chain(scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov),
                       optax.add_decayed_weights(weight_decay, mask),
                       optax.scale_by_learning_rate(learning_rate))
