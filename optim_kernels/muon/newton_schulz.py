"""Newton–Schulz orthogonalisation: the matrix function at the core of Muon.

For a matrix ``G = U S V^T`` (SVD), Muon wants ``U V^T``: the same singular vectors with every
singular value replaced by one. A quintic polynomial iteration

    X <- a X + (b A + c A A) X,   A = X X^T

applied to ``X`` scaled so that its singular values lie in ``(0, 1]`` pushes each singular value
``s`` towards the fixed-point band of ``p(s) = a s + b s^3 + c s^5`` while leaving the singular
vectors alone (the polynomial acts on singular values only). With the published coefficients
``(3.4445, -4.7750, 2.0315)`` (steepest slope at 0, ``a``, that keeps the band bounded) five
steps bring every ``s`` in ``(0, 1]`` that is not tiny (each step multiplies a small ``s`` by about
``a``) into roughly ``[0.7, 1.2]``: not exactly ``U V^T``, which Muon does not need.

Everything here is pure: coefficients are static Python floats, the input is a stack of
matrices ``(..., m, n)``, each orthogonalised on its own. The iteration runs on the wide
orientation (``m <= n``), so the Gram matrix ``A`` is the smaller ``m x m`` one; since
``p(X^T) = p(X)^T`` this only changes the cost.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

__all__ = [
    "DION_COEFFS",
    "PRECONDITIONINGS",
    "PRESETS",
    "STANDARD_COEFFS",
    "Coefficients",
    "coefficient_schedule",
    "orthogonalize",
]

Coefficients = tuple[float, float, float]

STANDARD_COEFFS: Coefficients = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic: steepest slope at 0 that still keeps every singular value bounded."""

DION_COEFFS: tuple[Coefficients, ...] = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)
"""A five-step schedule (one triple per step) from the Dion paper (Ahn et al., 2025)."""

PRESETS: dict[str, Coefficients | tuple[Coefficients, ...]] = {
    "standard": STANDARD_COEFFS,
    "dion": DION_COEFFS,
}

PRECONDITIONINGS = ("frobenius", "spectral", "aol", "schatten")
"""How the input is brought inside the iteration's basin before the first step:

* ``frobenius``: divide by ``||X||_F + eps`` (an upper bound of the spectral norm);
* ``spectral``: divide by ``||X||_2 + eps`` (exact; one SVD per matrix, expensive);
* ``aol``: the first step scales row ``i`` of ``X`` by ``1 / sqrt(sum_j |A_ij|)`` (``A = X X^T``,
  each sum floored at ``eps``), which bounds the spectral norm by 1 and reuses ``A`` (Boissin et
  al., 2025, "Turbo-Muon");
* ``schatten``: the first step divides ``X`` by ``sqrt(||A||_F)`` (floored at ``eps``), the
  Schatten-4 norm of ``X``, a tighter bound than Frobenius at no extra matmul (Grishina et al.,
  2025).
"""


def coefficient_schedule(
    ns_coeffs: str | Sequence[float] | Sequence[Sequence[float]], ns_steps: int
) -> tuple[Coefficients, ...]:
    """The ``(a, b, c)`` of each iteration, as static floats.

    Args:
      ns_coeffs: a preset name (:data:`PRESETS`), one triple used for all ``ns_steps``
        iterations, or a list of triples, one per iteration (then ``ns_steps`` only bounds its
        length: optax.contrib.muon refuses more triples than ``ns_steps`` and runs one
        iteration per triple).
      ns_steps: number of iterations for a single triple (an integer >= 1).

    Returns:
      A tuple with one triple per iteration (at least one).

    Raises:
      ValueError: an unknown preset, a malformed triple, an empty list, or a list longer than
        ``ns_steps``.
    """
    if isinstance(ns_coeffs, str):
        key = ns_coeffs.lower()
        if key not in PRESETS:
            raise ValueError(f"unknown ns_coeffs preset {ns_coeffs!r}; presets: {sorted(PRESETS)}")
        ns_coeffs = PRESETS[key]
    items = list(ns_coeffs)
    if not items:
        raise ValueError("ns_coeffs is empty")
    if all(_is_number(v) for v in items):
        return (_triple(items),) * int(ns_steps)
    schedule = tuple(_triple(row) for row in items)
    if len(schedule) > ns_steps:
        raise ValueError(f"ns_coeffs has {len(schedule)} triples, more than ns_steps = {ns_steps}")
    return schedule


def orthogonalize(
    x: jax.Array,
    schedule: Sequence[Coefficients],
    preconditioning: str = "frobenius",
    eps: float = 1e-8,
) -> jax.Array:
    """Approximately ``U V^T`` of each trailing matrix of ``x``, in ``x``'s dtype.

    Args:
      x: ``(..., m, n)`` floating point; leading axes are independent matrices.
      schedule: one ``(a, b, c)`` per iteration (:func:`coefficient_schedule`).
      preconditioning: one of :data:`PRECONDITIONINGS`.
      eps: floor of the scaling denominators (a zero matrix stays zero).

    Returns:
      ``(..., m, n)``: same shape and dtype as ``x``.
    """
    if x.ndim < 2:
        raise ValueError(f"orthogonalize needs matrices (..., m, n), got shape {x.shape}")
    if preconditioning not in PRECONDITIONINGS:
        raise ValueError(f"unknown preconditioning {preconditioning!r}; choose one of {PRECONDITIONINGS}")
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = _t(x)
    if preconditioning == "frobenius":
        x = x / (jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True)) + eps)
    elif preconditioning == "spectral":
        x = x / (jnp.linalg.norm(x, ord=2, axis=(-2, -1), keepdims=True) + eps)
    for step, coeffs in enumerate(schedule):
        gram = x @ _t(x)
        if step == 0 and preconditioning in ("aol", "schatten"):
            x, gram = _rescale_first(x, gram, preconditioning, eps)
        x = _quintic(x, gram, coeffs)
    return _t(x) if tall else x


def _rescale_first(x: jax.Array, gram: jax.Array, preconditioning: str, eps: float) -> tuple[jax.Array, jax.Array]:
    """``(X, A)`` rescaled before the first iteration by AOL row scales or the Schatten-4 norm."""
    if preconditioning == "aol":
        row = jax.lax.rsqrt(jnp.maximum(jnp.sum(jnp.abs(gram), axis=-1), eps))[..., :, None]
        return x * row, gram * row * _t(row)
    scale = jax.lax.rsqrt(jnp.maximum(jnp.sqrt(jnp.sum(jnp.square(gram), axis=(-2, -1), keepdims=True)), eps))
    return x * scale, gram * jnp.square(scale)


def _quintic(x: jax.Array, gram: jax.Array, coeffs: Coefficients) -> jax.Array:
    """One iteration ``a X + (b A + c A A) X`` given ``A = X X^T``."""
    a, b, c = coeffs
    poly = b * gram + (c * gram) @ gram
    return a * x + poly @ x


def _t(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, -1, -2)


def _is_number(value) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, (int, float)) or (hasattr(value, "shape") and getattr(value, "ndim", 1) == 0)


def _triple(row) -> Coefficients:
    try:
        values = [float(v) for v in row] if not isinstance(row, (str, bytes)) else None
    except (TypeError, ValueError):
        values = None
    if values is None:
        raise ValueError(f"an ns_coeffs triple must be three numbers, got {row!r}")
    if len(values) != 3 or not all(abs(v) < float("inf") for v in values):
        raise ValueError(f"an ns_coeffs triple must be three finite numbers, got {row!r}")
    return values[0], values[1], values[2]
