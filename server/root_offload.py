"""Domain layer: a Shampoo session's preconditioners on one shard, in process or offloaded.

This module is the one place that decides where a session's inverse roots are computed and when
a shard waits for them (:func:`shard_preconditioners`):

* not Shampoo: nothing to do (``None``);
* Shampoo on a server without preconditioner workers, or with ``in_process`` set: the kernel
  computes roots inside its update (the reference); :class:`ShardPreconditioners` only keeps
  per-block status;
* otherwise :class:`OffloadedPreconditioners`: the kernel runs with
  ``inline_preconditioners=False`` and the roots come from the workers through the kernel's
  offload seam (``export_statistics`` -> ``compute_preconditioners`` -> ``install_preconditioners``).

Schedule of an offloaded session (``P = preconditioning_compute_steps``, ``A = max_age``):

* after update ``t`` with ``t % P == 0`` the shard exports the statistics (step ``t``), submits
  them and goes on without waiting;
* before every update it installs the newest finished export (older unfinished ones are
  dropped) and then enforces the bound: update ``t`` must use roots of step
  ``>= required_source_step(t, P, A) = min(t - t % P, t - A)``. If the installed ones are older, it
  waits for the first export in flight that is recent enough or, when none is, exports with the
  update's pending gradients (step ``t``, the statistics the update will hold) and waits for it.

So ``A = 0`` reproduces in-process Shampoo (roots of step ``t - t % P``, as the kernel computes
them); with ``A >= P`` an update uses roots at most ``max(A, P - 1)`` steps old and waits only
when the workers fall behind; the default ``A = 2 P`` leaves the workers up to ``P`` steps to
answer. A failed root (error NaN or ``>= inverse_failure_threshold``) keeps the block's previous
preconditioner (identity until the first root, i.e. the grafted direction) and counts a failure;
its age then grows past the bound, which only counts exports, not their outcome.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from optserve.server.preconditioner_pool import PreconditionerPool, RootJob
from optserve.server.preconditioner_worker import RootOptions

log = logging.getLogger(__name__)

SHAMPOO = "shampoo"


@dataclasses.dataclass(frozen=True)
class BlockLabel:
    """Which statistic a position of the export is: ``tensor``'s ``block`` (row-major over its
    block grid), dimension ``dim`` of that block, a ``size x size`` matrix."""

    tensor: str
    block: int
    dim: int
    size: int


def block_labels(config, shapes: Mapping[str, Sequence[int]]) -> list[BlockLabel]:
    """Labels in the kernel's export order for a shard holding ``shapes`` (a dict pytree, so its
    tensors flatten in sorted-name order)."""
    labels = []
    for name in sorted(shapes):
        layout = config.layout(tuple(shapes[name]))
        if layout is None:
            continue
        for b, block in enumerate(layout.block_shapes):
            labels.extend(BlockLabel(name, b, k, d) for k, d in enumerate(block))
    return labels


def required_source_step(step: int, every: int, max_age: int) -> int:
    """The oldest statistics step update ``step`` may use: ``min(step - step % every, step - max_age)``."""
    return min(step - step % every, step - max_age)


def default_max_age(every: int) -> int:
    """The bound when a session sets none: ``2 * preconditioning_compute_steps``."""
    return 2 * every


class ShardPreconditioners:
    """In-process roots (the kernel computes them): per-block status only.

    Args:
      optimizer: the ``BuiltOptimizer`` the shard runs.
      config: its ``ShampooConfig``.
      labels: the shard's statistics in export order.
    """

    offloaded = False

    def __init__(self, optimizer, config, labels: list[BlockLabel]):
        self.optimizer = optimizer
        self.config = config
        self.labels = labels
        b = len(labels)
        # (count, source_step, failures, last_error, fallback_steps) after the latest update, host side
        self._snapshot = (0, np.full((b,), -1), np.zeros((b,), np.int64), np.zeros((b,), np.float32),
                          np.zeros((b,), np.int64))
        self._counters: dict[str, Any] = {"roots_installed": 0, "waits": 0, "resubmits": 0}

    def before_update(self, state, grads, params):
        """Called with the pending gradients right before the update; returns the state to use."""
        return state

    def after_update(self, state):
        """Called right after the update; returns the state to keep."""
        self._record(state)
        return state

    def _record(self, state) -> None:
        import jax

        info = jax.device_get(state.preconditioner_info)
        source = np.asarray(info.source_step)
        fallback = self._snapshot[4] + (source < 0)
        self._snapshot = (int(state.count), source, np.asarray(info.failures), np.asarray(info.last_error), fallback)

    def _blocks(self) -> list[dict]:
        count, source, failures, errors, fallback = self._snapshot
        blocks = []
        for i, label in enumerate(self.labels):
            age = (count - 1) - int(source[i]) if source[i] >= 0 and count > 0 else -1
            blocks.append({"tensor": label.tensor, "block": label.block, "dim": label.dim, "size": label.size,
                           "age": age, "error": float(errors[i]), "failures": int(failures[i]),
                           "fallback_steps": int(fallback[i])})
        return blocks

    def status(self) -> dict:
        """``{"offloaded", "max_age", "roots_installed", "waits", "resubmits", "blocks": [...]}`` as of
        the latest update (a snapshot: safe to call from any thread).

        Each block: ``tensor``, ``block``, ``dim``, ``size``; ``age``: steps between the statistics
        of the preconditioner the latest update used and that update (-1: no root yet);
        ``error``: error of the latest root offered; ``failures``: roots rejected;
        ``fallback_steps``: updates that ran the block without a root (the grafted direction).
        """
        return {"offloaded": self.offloaded, "max_age": None, **self._counters, "blocks": self._blocks()}


class OffloadedPreconditioners(ShardPreconditioners):
    """Roots from the preconditioner workers (see the module docstring for the schedule).

    Args:
      optimizer: the ``BuiltOptimizer`` built with ``inline_preconditioners=False``.
      config: its ``ShampooConfig``.
      labels: the shard's statistics in export order.
      pool: the shard's :class:`PreconditionerPool`.
      max_age: the bound ``A`` (>= 0).
      wait_timeout_s: longest wait for a job before its missing batches are computed here.
    """

    offloaded = True

    def __init__(self, optimizer, config, labels: list[BlockLabel], pool: PreconditionerPool, max_age: int,
                 wait_timeout_s: float = 120.0):
        import jax

        from optserve.optim_kernels.shampoo import export_statistics, install_preconditioners

        if config.inline_preconditioners:
            raise ValueError("offloaded preconditioners need a kernel built with inline_preconditioners=False")
        if max_age < 0:
            raise ValueError(f"max_age must be >= 0, got {max_age}")
        super().__init__(optimizer, config, labels)
        self.pool = pool
        self.max_age = max_age
        self._every = config.preconditioning_compute_steps
        self._wait_timeout_s = wait_timeout_s
        self._options = RootOptions.from_config(config)
        self._export_pending = jax.jit(lambda state, grads: export_statistics(state, config, grads))
        self._export_current = jax.jit(lambda state: export_statistics(state, config))
        self._install = jax.jit(lambda state, roots, errors, step: install_preconditioners(
            state, config, roots, errors, step))  # unchanged leaves are forwarded, not copied
        self._jobs: collections.deque[RootJob] = collections.deque()
        self._offered = -1  # step of the newest installed export (whatever its blocks' outcome)
        self._exported = -1  # step of the newest export sent
        self.roots_installed = 0
        self.waits = 0
        self.resubmits = 0

    def before_update(self, state, grads, params):
        import jax

        if not self.labels:
            return state
        step = int(state.count)
        state = self._install_newest_done(state)
        need = required_source_step(step, self._every, self.max_age)
        if self._offered >= need:
            return state
        self.waits += 1
        for i, job in enumerate(self._jobs):
            if job.step >= need:
                self._finish(job)
                return self._install_job(state, i)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        self._submit(self._export_pending(state, grads))
        self._finish(self._jobs[-1])
        return self._install_job(state, len(self._jobs) - 1)

    def after_update(self, state):
        if self.labels:
            step = int(state.count) - 1
            if step % self._every == 0 and step > self._exported:
                self._submit(self._export_current(state))
        self._record(state)
        return state

    def drain(self) -> None:
        """Waits for the exports still in flight and drops them (before shutting Ray down)."""
        while self._jobs:
            self._finish(self._jobs.popleft())

    # ---------------------------------------------------------------- jobs
    def _submit(self, exported) -> None:
        step = int(exported.step)
        job = self.pool.submit(np.asarray(exported.statistics), np.asarray(exported.exponents),
                               np.asarray(exported.sizes), step, self._options)
        self._jobs.append(job)
        self._exported = step

    def _finish(self, job: RootJob) -> None:
        if not self.pool.wait(job, timeout_s=self._wait_timeout_s):
            log.warning("roots of step %d did not arrive within %.0f s; computing the rest on the shard",
                        job.step, self._wait_timeout_s)
            self.pool.finish_locally(job)

    def _install_newest_done(self, state):
        newest = -1
        for i, job in enumerate(self._jobs):
            if self.pool.poll(job):
                newest = i
        return state if newest < 0 else self._install_job(state, newest)

    def _install_job(self, state, index: int):
        """Installs job ``index`` (done) and drops it and every older job."""
        job = self._jobs[index]
        for _ in range(index + 1):
            self.resubmits += self._jobs.popleft().resubmits
        roots, errors = self.pool.result(job)
        state = self._install(state, roots, errors, np.int32(job.step))
        self._offered = max(self._offered, job.step)
        self.roots_installed += 1
        return state

    def _record(self, state) -> None:
        super()._record(state)
        self._counters = {"roots_installed": self.roots_installed, "waits": self.waits,
                          "resubmits": self.resubmits + sum(job.resubmits for job in self._jobs)}

    def status(self) -> dict:
        return {**super().status(), "offloaded": True, "max_age": self.max_age}


def shard_preconditioners(optimizer_name: str, optimizer, shapes: Mapping[str, Sequence[int]],
                          pool: Optional[PreconditionerPool], in_process: bool = False,
                          max_age: Optional[int] = None) -> Optional[ShardPreconditioners]:
    """Decides how a session's roots are computed on one shard (the policy of this module).

    Args:
      optimizer_name: the session's registry name.
      optimizer: the validated ``BuiltOptimizer``.
      shapes: the shard's tensors, name -> shape.
      pool: the server's preconditioner pool (``None``: no workers).
      in_process: the session asks for in-process roots even when workers exist.
      max_age: the session's bound (``None``: :func:`default_max_age`).

    Returns:
      ``None`` for other optimizers; else the object the shard calls around each update (its
      ``optimizer`` is what the shard must run).
    """
    if optimizer_name != SHAMPOO:
        return None
    from optserve.optim_kernels import build_optimizer
    from optserve.optim_kernels.shampoo import shampoo_config

    if pool is None or in_process:
        config = shampoo_config(**optimizer.args)
        return ShardPreconditioners(optimizer, config, block_labels(config, shapes))
    args = {**optimizer.args, "inline_preconditioners": False}
    config = shampoo_config(**args)
    bound = default_max_age(config.preconditioning_compute_steps) if max_age is None else max_age
    return OffloadedPreconditioners(build_optimizer(SHAMPOO, args), config, block_labels(config, shapes), pool, bound)
