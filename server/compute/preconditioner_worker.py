"""Compute layer: a preconditioner worker, the Ray actor that computes Shampoo's inverse roots
(and SOAP's eigenbases).

A worker runs the root function a kernel's offload seam names (:class:`RootComputation`),
jitted once per (batch shape, root config), on batches of identity-padded statistics
sent by the shards (see :mod:`optserve.server.compute.preconditioner_pool`), with the results in
use as a second stacked input when the kernel's export carries them (SOAP's bases). With ``f64``
the worker turns on ``jax_enable_x64`` in its own process before any computation, so the roots
are computed in float64 (and returned in float32, the input's dtype); shards are unaffected.

Workers hold no session state: a restarted worker (Ray's ``max_restarts``) serves the next batch
as if nothing happened, and any batch can go to any worker.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Hashable, Optional

import numpy as np

from optserve.server.compute.devices import check_device, DeviceRequest, DeviceUnusable, ray_gpu_ids


@dataclasses.dataclass(frozen=True)
class RootComputation:
    """What a worker runs on a batch, as a kernel's offload seam declares it.

    Attributes:
      compute: the kernel's pure ``(statistics [b, n, n], exponents [b], sizes [b], config[,
        previous [b, n, n]]) -> (roots [b, n, n], errors [b])``.
      config: its typed root configuration (method, ridge), sent unchanged from the session's
        kernel config; hashable, so each worker compiles once per (batch shape, config).
    """

    compute: Callable
    config: Hashable


def compute_roots_fn(computation: RootComputation):
    """A jitted ``(statistics, exponents, sizes[, previous]) -> (roots, errors)`` for ``computation``.

    Used by the workers and by a shard's local fallback (when no worker can be reached).
    """
    import jax

    return jax.jit(lambda statistics, exponents, sizes, *previous: computation.compute(
        statistics, exponents, sizes, computation.config, *previous))


class PreconditionerWorker:
    """One preconditioner worker (wrap with ``ray.remote``; see :func:`preconditioner_pool.start_workers`).

    Args:
      index: the worker's slot in the pool (for status and logs).
      f64: compute in float64 (``jax_enable_x64`` in this process).
      device: the GPUs it asked Ray for (None: none); float32 matmuls run at full precision either way.
        A worker whose JAX cannot use its GPUs computes nothing: its :meth:`info` names the problem
        and :meth:`compute` raises ``DeviceUnusable`` (the pool logs it, and the batch's roots count as
        failed: the shard keeps the preconditioners it has).
    """

    def __init__(self, index: int, f64: bool = False, device: Optional[DeviceRequest] = None):
        import jax

        request = dataclasses.replace(device or DeviceRequest("", "--gpus-per-precond-worker"),
                                      role=f"preconditioner worker {index}", full_precision=True)
        self._device = check_device(request, ray_gpu_ids(), _node_address())
        if f64:
            jax.config.update("jax_enable_x64", True)
        self._index = index
        self._fns: dict[RootComputation, Any] = {}
        self._batches = 0

    def compute(self, statistics: np.ndarray, exponents: np.ndarray, sizes: np.ndarray,
                computation: RootComputation, previous: np.ndarray | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
        """Inverse roots of one batch.

        Args:
          statistics: f32 [b, n, n], each real block in the top-left ``sizes[i]`` corner.
          exponents: int32 [b], the root ``p`` of each matrix.
          sizes: int32 [b], real sizes.
          computation: the session's root computation.
          previous: f32 [b, n, n], the results in use (identity-padded), for a kernel whose export
            carries them; else None.

        Returns:
          ``(roots f32 [b, n, n], errors f32 [b])``; ``errors[i]`` is ``inf`` for non-finite input.
        """
        if self._device.problem:  # restarted by Ray on a node whose JAX cannot use its GPU: no silent CPU roots
            raise DeviceUnusable(self._device.problem)
        fn = self._fns.get(computation)
        if fn is None:
            fn = self._fns[computation] = compute_roots_fn(computation)
        roots, errors = fn(statistics, exponents, sizes, *(() if previous is None else (previous,)))
        self._batches += 1
        return np.asarray(roots, dtype=np.float32), np.asarray(errors, dtype=np.float32)

    def info(self) -> dict:
        """``{"index", "pid", "device", "x64", "batches", "placement"}``: ``x64`` whether this process
        computes in float64; ``batches`` computed since this process started; ``placement`` its
        :class:`~optserve.server.compute.devices.DeviceReport`."""
        import jax

        return {"index": self._index, "pid": os.getpid(), "device": str(jax.devices()[0]),
                "x64": bool(jax.config.jax_enable_x64), "batches": self._batches, "placement": self._device}


def _node_address() -> str:
    """This worker's node IP (for messages), "" outside Ray."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - not in a Ray worker
        return ""
