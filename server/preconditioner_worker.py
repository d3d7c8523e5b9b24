"""Compute layer: a preconditioner worker, the Ray actor that computes Shampoo's inverse roots.

A worker runs exactly one function, :func:`optserve.optim_kernels.shampoo.compute_preconditioners`,
jitted once per (batch shape, :class:`RootOptions`), on batches of identity-padded statistics
sent by the shards (see :mod:`optserve.server.preconditioner_pool`). With ``f64`` the worker turns
on ``jax_enable_x64`` in its own process before any computation, so the roots are computed in
float64 (and returned in float32, the input's dtype); shards are unaffected.

Workers hold no session state: a restarted worker (Ray's ``max_restarts``) serves the next batch
as if nothing happened, and any batch can go to any worker.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class RootOptions:
    """The root computation's options, taken from a session's ``ShampooConfig``.

    Attributes:
      matrix_epsilon / relative_matrix_epsilon: the ridge added before the root.
      root_method: ``"auto"`` (resolved by the *worker's* backend: eigh on CPU, coupled Newton
        on accelerators), ``"eigh"`` or ``"coupled_newton"``.
      num_iters: coupled Newton's iteration cap.
    """

    matrix_epsilon: float
    relative_matrix_epsilon: bool
    root_method: str
    num_iters: int

    @classmethod
    def from_config(cls, config) -> "RootOptions":
        """From an :class:`~optserve.optim_kernels.shampoo.ShampooConfig`."""
        return cls(float(config.matrix_epsilon), bool(config.relative_matrix_epsilon), str(config.root_method),
                   int(config.root_num_iters))


def compute_roots_fn(options: RootOptions):
    """A jitted ``(statistics [b, n, n], exponents [b], sizes [b]) -> (roots [b, n, n], errors [b])``.

    Used by the workers and by a shard's local fallback (when no worker can be reached).
    """
    import functools

    import jax

    from optserve.optim_kernels.shampoo import compute_preconditioners

    return jax.jit(functools.partial(
        compute_preconditioners, matrix_epsilon=options.matrix_epsilon, method=options.root_method,
        relative_matrix_epsilon=options.relative_matrix_epsilon, num_iters=options.num_iters))


class PreconditionerWorker:
    """One preconditioner worker (wrap with ``ray.remote``; see :func:`preconditioner_pool.start_workers`).

    Args:
      index: the worker's slot in the pool (for status and logs).
      f64: compute in float64 (``jax_enable_x64`` in this process).
    """

    def __init__(self, index: int, f64: bool = False):
        import jax

        if f64:
            jax.config.update("jax_enable_x64", True)
        self._index = index
        self._f64 = f64
        self._fns: dict[RootOptions, Any] = {}
        self._batches = 0

    def compute(self, statistics: np.ndarray, exponents: np.ndarray, sizes: np.ndarray,
                options: RootOptions) -> tuple[np.ndarray, np.ndarray]:
        """Inverse roots of one batch.

        Args:
          statistics: f32 [b, n, n], each real block in the top-left ``sizes[i]`` corner.
          exponents: int32 [b], the root ``p`` of each matrix.
          sizes: int32 [b], real sizes.
          options: the session's root options.

        Returns:
          ``(roots f32 [b, n, n], errors f32 [b])``; ``errors[i]`` is ``inf`` for non-finite input.
        """
        fn = self._fns.get(options)
        if fn is None:
            fn = self._fns[options] = compute_roots_fn(options)
        roots, errors = fn(statistics, exponents, sizes=sizes)
        self._batches += 1
        return np.asarray(roots, dtype=np.float32), np.asarray(errors, dtype=np.float32)

    def info(self) -> dict:
        """``{"index", "pid", "device", "x64", "batches"}``: ``x64`` whether this process computes in
        float64; ``batches`` computed since this process started."""
        import jax

        return {"index": self._index, "pid": os.getpid(), "device": str(jax.devices()[0]),
                "x64": bool(jax.config.jax_enable_x64), "batches": self._batches}
