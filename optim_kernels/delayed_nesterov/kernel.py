"""Delayed Nesterov (DN): the outer optimizer of asynchronous DiLoCo (Liu et al., 2024).

In asynchronous Local-SGD the server applies each worker's pseudo-gradient as it arrives, so a
Nesterov momentum updated on every arrival keeps accelerating along directions that are already
stale. DN keeps the momentum buffer still for ``N - 1`` arrivals, applying each pseudo-gradient with a
plain step of ``1/N`` of its size (plus, optionally, a fixed share ``c`` of the momentum), and
sums them; on every ``N``-th arrival it folds the mean of the ``N`` buffered pseudo-gradients into
the momentum and takes the Nesterov step.

Two pieces: :func:`scale_by_delayed_nesterov`, the direction (no learning rate), and
:func:`delayed_nesterov`, the direction times ``-learning_rate`` under the same state (one count
serves both the schedule and the ``N``-arrival cycle).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optserve.optim_kernels.delayed_nesterov.config import DelayedNesterovConfig

__all__ = [
    "DelayedNesterovState",
    "delayed_nesterov",
    "delayed_nesterov_from_config",
    "scale_by_delayed_nesterov",
]


class DelayedNesterovState(NamedTuple):
    """State of :func:`scale_by_delayed_nesterov` and :func:`delayed_nesterov`.

    Attributes:
      count: int32 scalar, the pseudo-gradients received so far (``t`` of Algorithm 3).
      momentum: the momentum buffer ``m``, a pytree like the params (``accumulator_dtype``, or
        each param's dtype); changes only on the arrivals with ``(t + 1) % N == 0``.
      accumulated: ``Delta``, the sum of the pseudo-gradients received since the last momentum
        update (same structure and dtypes as ``momentum``); zero right after one.
    """

    count: jax.Array
    momentum: Any
    accumulated: Any


def scale_by_delayed_nesterov(
    delay: int,
    momentum: float = 0.9,
    momentum_activation: float = 0.0,
    accumulator_dtype: Any | None = None,
) -> optax.GradientTransformation:
    """The delayed Nesterov direction ``u_t`` of one arriving pseudo-gradient ``g_t``.

    With ``N = delay``, ``beta = momentum``, ``c = momentum_activation``, and ``t`` the arrivals
    before this one::

        Delta <- Delta + g_t
        if (t + 1) % N == 0:                       # momentum-update arrival
            m     <- beta m + Delta / N
            u_t    = g_t / N + (1 - c N + c) beta m
            Delta <- 0
        else:                                      # m unchanged
            u_t    = g_t / N + c beta m

    Args:
      delay: ``N`` (integer >= 1), the arrivals per momentum update.
      momentum: ``beta`` in ``[0, 1)``.
      momentum_activation: ``c`` in ``[0, 1 / N]``, the share of ``beta m`` also applied on each
        arrival that does not update ``m``.
      accumulator_dtype: dtype of ``m`` and ``Delta``; ``None``: each param's dtype.

    Returns:
      A transformation whose updates are ``u_t`` in each gradient's dtype (not yet scaled by a
      learning rate) and whose state is a :class:`DelayedNesterovState`. Validation is the
      caller's (:class:`~.config.DelayedNesterovConfig`).
    """
    accumulator_dtype = None if accumulator_dtype is None else jnp.dtype(accumulator_dtype)
    update_share = (1.0 - momentum_activation * delay + momentum_activation) * momentum
    between_share = momentum_activation * momentum

    def init_fn(params):
        def zeros(p):
            return jnp.zeros(jnp.shape(p), jnp.asarray(p).dtype if accumulator_dtype is None else accumulator_dtype)

        return DelayedNesterovState(
            count=jnp.zeros([], jnp.int32),
            momentum=jax.tree.map(zeros, params),
            accumulated=jax.tree.map(zeros, params),
        )

    def update_fn(updates, state, params=None):
        del params
        updates_momentum = (state.count + 1) % delay == 0
        share = jnp.where(updates_momentum, update_share, between_share)

        summed = jax.tree.map(lambda acc, g: acc + g, state.accumulated, updates)
        new_momentum = jax.tree.map(
            lambda m, total: jnp.where(updates_momentum, momentum * m + total / delay, m), state.momentum, summed)
        directions = jax.tree.map(lambda g, m: (g / delay + share * m).astype(g.dtype), updates, new_momentum)
        new_momentum = jax.tree.map(lambda new, old: new.astype(old.dtype), new_momentum, state.momentum)
        new_accumulated = jax.tree.map(
            lambda total, old: jnp.where(updates_momentum, jnp.zeros_like(total), total).astype(old.dtype),
            summed, state.accumulated)
        new_state = DelayedNesterovState(optax.safe_increment(state.count), new_momentum, new_accumulated)
        return directions, new_state

    return optax.GradientTransformation(init_fn, update_fn)


def delayed_nesterov(
    learning_rate: optax.ScalarOrSchedule,
    momentum: float = 0.9,
    *,
    delay: int,
    momentum_activation: float = 0.0,
    accumulator_dtype: Any | None = None,
) -> optax.GradientTransformation:
    """Delayed Nesterov momentum (DN), Algorithm 3 of Liu et al. (2024), for asynchronous DiLoCo.

    The server's parameters ``theta`` take one update per *arriving* pseudo-gradient ``g_t``
    (a worker's ``theta_start - theta_local``, or a mean of a few that arrived together): with
    ``N = delay``, ``beta = momentum``, ``c = momentum_activation``, ``eps_t = learning_rate``
    (or ``learning_rate(t)``) and ``t = 0, 1, ...`` counting arrivals::

        Delta <- Delta + g_t
        if (t + 1) % N == 0:
            m     <- beta m + Delta / N                               # the delayed momentum update
            theta <- theta - eps_t (g_t / N + (1 - c N + c) beta m)   # Nesterov step
            Delta <- 0
        else:
            theta <- theta - eps_t (g_t / N + c beta m)               # plain step (c = 0)

    These are the two branches of the paper's Algorithm 3 ("Delayed Nesterov Update"), with
    ``m_0 = 0`` and ``Delta = 0``. With the default ``c = 0``, the ``N`` arrivals of one cycle
    move ``theta`` by ``-eps (mean(g) + beta m)`` in all: one Nesterov step on their mean, spread
    over the cycle so every worker still gets fresh parameters at once. With ``delay = 1`` it is
    exactly ``optax.sgd(learning_rate, momentum, nesterov=True)`` (whatever ``c``).

    Shapes: ``updates`` (the pseudo-gradients), the params and each state buffer are pytrees of
    the same structure and shapes; the returned update (the change of ``theta`` above) has each
    pseudo-gradient's dtype, and is added to the params (``optax.apply_updates``).

    Args:
      learning_rate: ``eps`` (> 0), or a schedule of the arrival count ``t``. Each arrival moves
        the params by ``eps / N`` times its pseudo-gradient, so keeping the per-arrival step of
        a plain outer SGD with rate ``eps'`` takes ``eps = N eps'`` (as the HALoS reference
        scripts scale it). DiLoCo's synchronous outer Nesterov uses 0.7.
      momentum: ``beta`` in ``[0, 1)``; 0.9 by default: DiLoCo's outer Nesterov momentum, the
        optimizer DN delays (and the value of the HALoS reference scripts).
      delay: ``N`` (integer >= 1), the arrivals per momentum update (the paper's buffer size);
        no default, as Algorithm 3 takes it as an input (implementations commonly use the
        number of workers).
      momentum_activation: ``c`` in ``[0, 1 / N]``; 0 by default, as in Algorithm 3. A positive
        ``c`` applies ``c beta m`` on every arrival that does not update ``m``, and the rest,
        ``(1 - c (N - 1)) beta m``, on the one that does.
      accumulator_dtype: dtype of the momentum and of the pseudo-gradient sum (a float dtype or
        its name); ``None``: each param's dtype (as ``optax.sgd``).

    Returns:
      An ``optax.GradientTransformation`` whose state is a :class:`DelayedNesterovState`
      ``(count, momentum, accumulated)``; ``update`` needs no params.

    Raises:
      ValueError: an option out of range (its message names it), including
        ``momentum_activation > 1 / delay``.

    Choices of ours:
      * One arrival is one ``update`` call: if the server averages pseudo-gradients that arrive
        together, their mean is one ``g_t``.
      * ``t`` counts from 0, so the first momentum update happens on the ``N``-th arrival, as in
        Algorithm 3's ``(t + 1) % N`` test; a schedule is evaluated at the same ``t``.
      * Other public "delayed Nesterov" servers differ: forgather's applies a full ``eps g_t``
        between momentum updates and then a standard Nesterov step on the mean; this kernel
        follows the paper's equations (the HALoS reference code, utnslab/halos, agrees).

    References:
      Liu, Chhaparia, Douillard, Kale, Rusu, Shen, Szlam, Ranzato, "Asynchronous Local-SGD
      Training for Language Modeling", 2024 (arXiv:2401.09135), Algorithm 3;
      Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
      2023 (arXiv:2311.08105). The same equations are in HALoS's reference code
      (utnslab/halos, ``src/halos/opt.py``, ``DelayedNesterovOptimizer``).
    """
    return delayed_nesterov_from_config(DelayedNesterovConfig(
        learning_rate=learning_rate,
        delay=delay,
        momentum=momentum,
        momentum_activation=momentum_activation,
        accumulator_dtype=accumulator_dtype,
    ))


def delayed_nesterov_from_config(config: DelayedNesterovConfig) -> optax.GradientTransformation:
    """The transformation of :func:`delayed_nesterov` for an already validated config."""
    direction = scale_by_delayed_nesterov(
        config.delay, config.momentum, config.momentum_activation, config.accumulator_dtype)
    learning_rate = config.learning_rate

    def update_fn(updates, state, params=None):
        rate = learning_rate(state.count) if callable(learning_rate) else learning_rate
        directions, new_state = direction.update(updates, state, params)
        steps = jax.tree.map(lambda u: u * jnp.asarray(-rate, u.dtype), directions)
        return steps, new_state

    return optax.GradientTransformation(direction.init, update_fn)
