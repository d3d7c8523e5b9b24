"""Inverse p-th roots of symmetric positive semi-definite matrices: ``(A + r I)^(-1/p)``.

Two methods, both pure and jittable, both usable under ``jax.vmap`` with a traced exponent, chosen
by the typed method of a :class:`~optserve.optim_kernels.linalg.root_config.RootConfig`
(:func:`inverse_pth_root`, batched :func:`inverse_pth_roots`) or by name
(:func:`matrix_inverse_pth_root`):

* ``CoupledNewtonConfig`` / ``"coupled_newton"``: the coupled Newton iteration (Higham,
  *Functions of Matrices*, eq. 7.18 and Guo & Higham 2006). Only matrix products, so it suits
  accelerators. Iterates ``T = ((p + 1) I - M) / p``, ``M <- T^p M``, ``X <- X T`` from
  ``M0 = z A``, ``X0 = z^(1/p) I`` with ``z = (1 + p) / (2 ||A||_F)``, until ``max|M - I|`` drops
  below the tolerance or grows by more than 20% in one step (the previous iterate is then kept).
* ``EigenConfig`` / ``"eigh"``: one symmetric eigendecomposition ``A = U diag(e) U^T``; the root is
  ``U diag((max(e, 0) + r)^(-1/p)) U^T``. Exact for every integer ``p`` by construction.

The ridge ``r`` is ``ridge_epsilon * lambda_max(A)`` when ``relative_epsilon`` is set (the
seed's "relative matrix epsilon"; ``lambda_max`` comes from power iteration for coupled Newton and
from the decomposition itself for eigh), else ``ridge_epsilon``.

Both return ``(root, error)``: ``error`` is a scale-free f32 residual, ``max|M - I|`` at the
returned iterate for coupled Newton, ``max|U^T A U - diag(e)| / max|e|`` for eigh. Any non-finite
input or result reports ``error = +inf`` so callers can compare against a threshold directly.

Precision: the computation runs in float64 whenever ``jax_enable_x64`` is on, else in float32;
the root is returned in the input's dtype.

Padding: ``size`` (optionally traced) says that only the leading ``size x size`` block is real.
Rows and columns past it are ignored (whatever they hold, e.g. identity padding) and come back
zero, so a padded matrix gives the same root for its real block as the unpadded one.
"""

from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp
from jax import lax

from optserve.optim_kernels.linalg.root_config import (
    EigenConfig,
    RootConfig,
    RootMethodConfig,
    root_method_config,
)

__all__ = [
    "compute_dtype",
    "default_error_tolerance",
    "inverse_pth_root",
    "inverse_pth_roots",
    "matrix_inverse_pth_root",
    "matrix_power",
    "power_iteration",
]

# Guards divisions by a zero largest eigenvalue.
_TINY = 1e-25
# Coupled Newton stops when the residual grows by more than this factor in one step.
_MAX_ERROR_RATIO = 1.2
# Coupled Newton retries with a 10x larger ridge while its residual is above this, this many times.
_RETRY_ERROR = 0.05
_NUM_TRIES = 6

Exponent = Union[int, jax.Array]


def compute_dtype() -> jnp.dtype:
    """float64 when ``jax_enable_x64`` is on, else float32."""
    return jnp.float64 if jax.config.jax_enable_x64 else jnp.float32


def default_error_tolerance(dtype) -> float:
    """Stopping residual for coupled Newton: 1e-6 in float32 (the seed's), 1e-13 in float64."""
    return 1e-13 if jnp.dtype(dtype) == jnp.float64 else 1e-6


def _size_mask(n: int, size, dtype) -> jax.Array:
    """[n] vector: 1 for real rows (index < size), 0 for padding."""
    if size is None:
        return jnp.ones((n,), dtype)
    return (jnp.arange(n) < size).astype(dtype)


def _start_vector(n: int, dtype) -> jax.Array:
    """A fixed pseudo-random start vector whose i-th entry depends on i only (not on n)."""
    i = jnp.arange(n, dtype=dtype)
    x = jnp.sin(i * 12.9898 + 1.0) * 43758.5453
    return x - jnp.floor(x) - 0.5 + 1e-3


def power_iteration(
    matrix: jax.Array,
    *,
    num_iters: int = 100,
    tolerance: Optional[float] = None,
    mask: Optional[jax.Array] = None,
    precision=lax.Precision.HIGHEST,
) -> jax.Array:
    """Largest eigenvalue of a symmetric PSD ``matrix`` [n, n] by power iteration.

    Stops after ``num_iters`` steps or when the Rayleigh quotient changes by less than
    ``tolerance`` (relative; default 1e-6 in float32, 1e-14 in float64). ``mask`` [n] restricts
    the start vector to the real rows of a padded matrix. Returns a scalar of ``matrix.dtype``.
    """
    n = matrix.shape[-1]
    dtype = matrix.dtype
    if tolerance is None:
        tolerance = 1e-14 if dtype == jnp.float64 else 1e-6
    v0 = _start_vector(n, dtype)
    if mask is not None:
        v0 = v0 * mask

    def cond(state):
        i, _, _, delta = state
        return jnp.logical_and(i < num_iters, delta > tolerance)

    def body(state):
        i, v, value, _ = state
        v = v / jnp.maximum(jnp.linalg.norm(v), _TINY)
        w = jnp.matmul(matrix, v, precision=precision)
        new_value = jnp.dot(v, w, precision=precision)
        delta = jnp.abs(new_value - value) / jnp.maximum(jnp.abs(new_value), _TINY)
        return i + 1, w, new_value, delta

    init = (jnp.asarray(0), v0, jnp.zeros((), dtype), jnp.asarray(jnp.inf, dtype))
    _, _, value, _ = lax.while_loop(cond, body, init)
    return value


def matrix_power(matrix: jax.Array, p: Exponent, precision=lax.Precision.HIGHEST) -> jax.Array:
    """``matrix^p`` for an integer ``p >= 0`` by repeated squaring.

    A Python ``int`` unrolls at trace time; a traced integer runs a ``while_loop`` over its bits.
    """
    mm = lambda a, b: jnp.matmul(a, b, precision=precision)
    identity = jnp.eye(matrix.shape[-1], dtype=matrix.dtype)
    if isinstance(p, int):
        if p < 0:
            raise ValueError(f"p: matrix_power needs p >= 0, got {p}")
        result, base = None, matrix
        while p:
            if p & 1:
                result = base if result is None else mm(result, base)
            p >>= 1
            if p:
                base = mm(base, base)
        return identity if result is None else result

    def cond(state):
        k, _, _ = state
        return k > 0

    def body(state):
        k, result, base = state
        result = jnp.where(k % 2 == 1, mm(result, base), result)
        return k // 2, result, mm(base, base)

    _, result, _ = lax.while_loop(cond, body, (jnp.asarray(p, jnp.int32), identity, matrix))
    return result


def matrix_inverse_pth_root(
    matrix: jax.Array,
    p: Exponent,
    *,
    method: Union[str, RootMethodConfig] = "coupled_newton",
    ridge_epsilon: float = 1e-6,
    relative_epsilon: bool = True,
    error_tolerance: Optional[float] = None,
    num_iters: int = 100,
    size: Optional[Union[int, jax.Array]] = None,
    precision=lax.Precision.HIGHEST,
) -> tuple[jax.Array, jax.Array]:
    """``(matrix + r I)^(-1/p)`` of a symmetric PSD matrix, and the method's residual.

    The keyword form of :func:`inverse_pth_root`.

    Args:
      matrix: [n, n] symmetric PSD matrix (any float dtype).
      p: positive integer exponent (Python int or traced int scalar).
      method: ``"coupled_newton"``, ``"eigh"``, ``"auto"`` (resolved for this process's backend)
        or a typed method (:mod:`~optserve.optim_kernels.linalg.root_config`).
      ridge_epsilon: ridge added before the root; relative to the largest eigenvalue when
        ``relative_epsilon`` is set.
      relative_epsilon: scale the ridge by the largest eigenvalue.
      error_tolerance: coupled Newton's stopping residual (default by dtype, see
        :func:`default_error_tolerance`).
      num_iters: maximum coupled Newton iterations.
      size: real size of a padded matrix (rows/columns past it are ignored and returned as 0).
      precision: matmul precision.

    Returns:
      ``(root, error)``: root [n, n] in ``matrix.dtype``; error an f32 scalar (``inf`` when the
      input or result is not finite).
    """
    config = RootConfig(root_method_config(method, num_iters, error_tolerance), ridge_epsilon, relative_epsilon)
    return inverse_pth_root(matrix, p, config, size=size, precision=precision)


def inverse_pth_root(
    matrix: jax.Array,
    p: Exponent,
    root_config: RootConfig,
    *,
    size: Optional[Union[int, jax.Array]] = None,
    precision=lax.Precision.HIGHEST,
) -> tuple[jax.Array, jax.Array]:
    """``(matrix + r I)^(-1/p)`` with the method and ridge of ``root_config``; see the module docstring.

    Args:
      matrix: [n, n] symmetric PSD matrix (any float dtype).
      p: positive integer exponent (Python int or traced int scalar).
      root_config: the method (an ``AutoRootConfig`` is resolved for this process's backend) and ridge.
      size: real size of a padded matrix (rows/columns past it are ignored and returned as 0).
      precision: matmul precision.

    Returns:
      ``(root, error)`` as :func:`matrix_inverse_pth_root`.
    """
    if not isinstance(root_config, RootConfig):
        raise ValueError(f"root_config: expected a RootConfig, got {root_config!r}")
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"matrix: expected a square [n, n] matrix, got shape {matrix.shape}")
    if isinstance(p, int) and p < 1:
        raise ValueError(f"p: expected a positive integer exponent, got {p}")
    method = root_config.resolved().method
    out_dtype = matrix.dtype
    dtype = compute_dtype()
    a = matrix.astype(dtype)
    n = a.shape[0]
    mask = _size_mask(n, size, dtype)
    a = a * mask[:, None] * mask[None, :]
    ridge = (root_config.matrix_epsilon, root_config.relative_matrix_epsilon)
    if isinstance(method, EigenConfig):
        root, error = _eigh_root(a, p, mask, *ridge, precision)
    else:
        tolerance = method.error_tolerance
        if tolerance is None:
            tolerance = default_error_tolerance(dtype)
        root, error = _coupled_newton_root(a, p, mask, *ridge, tolerance, method.num_iters, precision)
    root = root * mask[:, None] * mask[None, :]
    error = error.astype(jnp.float32)
    finite = jnp.logical_and(jnp.all(jnp.isfinite(root)), jnp.isfinite(error))
    error = jnp.where(finite, error, jnp.inf)
    if size is not None:
        error = jnp.where(jnp.asarray(size) == 0, 0.0, error)
    return root.astype(out_dtype), error


def inverse_pth_roots(
    statistics: jax.Array,
    exponents: jax.Array,
    sizes: Optional[jax.Array],
    root_config: RootConfig,
    *,
    precision=lax.Precision.HIGHEST,
) -> tuple[jax.Array, jax.Array]:
    """Inverse p-th roots of a stack of matrices: the pure function preconditioner workers run.

    ``root_config`` is static (hashable): a closure or ``functools.partial`` over it jits once per
    (stack shape, config). An ``AutoRootConfig`` resolves for the backend of the process that
    traces this function.

    Args:
      statistics: [B, n, n] symmetric PSD matrices (padding rows/columns arbitrary when ``sizes``
        is given, e.g. identity).
      exponents: int [B], the root of each matrix.
      sizes: int [B] real sizes, or ``None`` when every matrix is fully real.
      root_config: method and ridge.
      precision: matmul precision.

    Returns:
      ``(roots, errors)``: [B, n, n] in the input dtype (zero past each size) and f32 [B] errors
      (``inf`` for non-finite input).
    """
    if statistics.ndim != 3 or statistics.shape[1] != statistics.shape[2]:
        raise ValueError(f"statistics: expected [B, n, n], got shape {statistics.shape}")
    if exponents.shape != statistics.shape[:1]:
        raise ValueError(f"exponents: expected shape {statistics.shape[:1]}, got {exponents.shape}")
    if sizes is not None and sizes.shape != statistics.shape[:1]:
        raise ValueError(f"sizes: expected shape {statistics.shape[:1]}, got {sizes.shape}")
    if statistics.shape[0] == 0:
        return statistics, jnp.zeros((0,), jnp.float32)
    root_config = root_config.resolved()

    def one(matrix, p, size):
        return inverse_pth_root(matrix, p, root_config, size=size, precision=precision)

    exponents = exponents.astype(jnp.int32)
    if sizes is None:
        return jax.vmap(lambda m, p: one(m, p, None))(statistics, exponents)
    return jax.vmap(one)(statistics, exponents, sizes.astype(jnp.int32))


def _ridge(a, mask, ridge_epsilon, relative_epsilon, precision, max_eigenvalue=None):
    if not relative_epsilon:
        return jnp.asarray(ridge_epsilon, a.dtype)
    if max_eigenvalue is None:
        max_eigenvalue = power_iteration(a, mask=mask, precision=precision)
    return ridge_epsilon * jnp.maximum(max_eigenvalue, _TINY)


def _coupled_newton_root(a, p, mask, ridge_epsilon, relative_epsilon, tolerance, num_iters, precision):
    dtype = a.dtype
    identity = jnp.diag(mask)
    ridge = _ridge(a, mask, ridge_epsilon, relative_epsilon, precision)
    p_f = jnp.asarray(p, dtype)
    if a.shape[0] == 1:
        return jnp.power(a + ridge * identity, -1.0 / p_f), jnp.zeros((), dtype)

    def cond(state):
        tries, _, err = state
        return (tries < _NUM_TRIES) & ~(err <= _RETRY_ERROR)

    def body(state):
        tries, _, _ = state
        damped = a + (ridge * jnp.asarray(10.0, dtype) ** tries) * identity
        x, err = _coupled_newton_iterations(damped, p, p_f, identity, tolerance, num_iters, precision)
        return tries + 1, x, err

    init = (jnp.asarray(0), identity, jnp.asarray(jnp.inf, dtype))
    _, x, err = lax.while_loop(cond, body, init)
    return x, err


def _coupled_newton_iterations(damped, p, p_f, identity, tolerance, num_iters, precision):
    dtype = damped.dtype
    mm = lambda x, y: jnp.matmul(x, y, precision=precision)
    z = (1.0 + p_f) / (2.0 * jnp.maximum(jnp.linalg.norm(damped), _TINY))
    m0 = z * damped
    x0 = jnp.power(z, 1.0 / p_f) * identity
    err0 = jnp.max(jnp.abs(m0 - identity))

    def cond(state):
        i, _, _, _, err, _, ratio = state
        return (i < num_iters) & (err > tolerance) & (ratio < _MAX_ERROR_RATIO)

    def body(state):
        i, m, x, _, err, _, _ = state
        t = ((p_f + 1.0) * identity - m) / p_f
        new_m = mm(matrix_power(t, p, precision), m)
        new_x = mm(x, t)
        new_err = jnp.max(jnp.abs(new_m - identity))
        return i + 1, new_m, new_x, x, new_err, err, new_err / err

    init = (jnp.asarray(0), m0, x0, x0, err0, err0, jnp.zeros((), dtype))
    _, _, x, x_prev, err, err_prev, ratio = lax.while_loop(cond, body, init)
    diverged = ratio >= _MAX_ERROR_RATIO
    return jnp.where(diverged, x_prev, x), jnp.where(diverged, err_prev, err)


def _eigh_root(a, p, mask, ridge_epsilon, relative_epsilon, precision):
    dtype = a.dtype
    size = jnp.maximum(jnp.sum(mask), 1.0)
    # Padding rows get the real block's mean eigenvalue: inside its spectrum, so neither the
    # largest eigenvalue (hence the ridge) nor the conditioning of the problem changes.
    fill = jnp.trace(a) / size
    padded = a + jnp.diag((1.0 - mask) * fill)
    e, u = jnp.linalg.eigh(padded)
    ridge = _ridge(a, mask, ridge_epsilon, relative_epsilon, precision, max_eigenvalue=jnp.max(e))
    p_f = jnp.asarray(p, dtype)
    inv = jnp.power(jnp.maximum(e, 0.0) + ridge, -1.0 / p_f)
    mm = lambda x, y: jnp.matmul(x, y, precision=precision)
    root = mm(u * inv[None, :], u.T)
    residual = mm(u.T, mm(padded, u)) - jnp.diag(e)
    error = jnp.max(jnp.abs(residual)) / jnp.maximum(jnp.max(jnp.abs(e)), _TINY)
    return root, error
