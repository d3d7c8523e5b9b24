"""A session's matrix roots on one shard: in the kernel's update, or offloaded to the workers.

This module is the one place that decides where a session's inverse roots are computed and when
a shard waits for them (:func:`build_shard_optimizer`), for any kernel that declares a root
offload seam in the registry (``RootOffloadSeam``; Shampoo does for its inverse roots, SOAP for
its eigenbases, whose exports also carry the bases in use):

* no seam: nothing to do (no preconditioner object);
* a seam, on a server without preconditioner workers, or with ``in_process`` set: the kernel
  computes roots inside its update (the reference); :class:`ShardPreconditioners` only keeps
  per-block status;
* otherwise :class:`OffloadedPreconditioners`: the kernel is built without in-update roots
  (``seam.without_inline_roots``) and the roots come from the workers through the seam
  (``export`` -> ``compute_roots`` on a worker -> ``install``).

Schedule of an offloaded session (``P = seam.compute_steps``, Shampoo's
``preconditioning_compute_steps``; ``A = max_age``; ``L = seam.lag``, 0 for Shampoo, 1 for SOAP):

* after update ``t`` with ``t % P == 0`` the shard exports the statistics (step ``t``), submits
  them and goes on without waiting;
* before every update it installs the newest finished export (older unfinished ones are
  dropped) and then enforces the bound: update ``t`` must use roots of step
  ``>= required_source_step(t, P, A, L) = min(s - s % P, t - A)`` with ``s = t - L``. If the
  installed ones are older, it waits for the first export in flight that is recent enough or, when
  none is, exports (with ``L = 0`` with the update's pending gradients: step ``t``, the statistics
  the update will hold; else the state as it is, step ``t - 1``) and waits for it.

So ``A = 0`` reproduces the in-process kernel (Shampoo's roots of step ``t - t % P``, SOAP's bases
of step ``s - s % P``, as the kernels compute them); with ``A >= P`` an update uses roots at most
``max(A, P - 1 + L)`` steps old and waits only when the workers fall behind; the default
``A = 2 P`` leaves the workers up to ``P`` steps to answer. A failed root (error NaN or
``>= inverse_failure_threshold``; for SOAP a non-finite or non-orthogonal basis) keeps the block's
previous preconditioner (identity until the first root, i.e. the grafted direction, or plain Adam
for SOAP) and counts a failure; its age then grows past the bound, which only counts exports, not
their outcome.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from optserve.optim_kernels import BuiltOptimizer, build_optimizer, resolve_schedules
from optserve.optim_kernels.registry import optimizer_entry
from optserve.protos.status_records import PreconditionerBlockStatus, RootOffloadStatus, RootStatus
from optserve.server.compute.heap import release_free_memory
from optserve.server.compute.preconditioner_pool import PreconditionerPool, RootJob
from optserve.server.compute.preconditioner_worker import RootComputation

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RootInstall:
    """Roots a primary installed into a session's state before one of its updates, as a standby
    installs them in its place (the same bytes, not roots of its own computing).

    Attributes:
      step: the statistics' step the roots were computed from (the export's).
      roots: float32 ``[B, n, n]``, one per block in block order (SOAP: its bases).
      errors: float32 ``[B]``, each block's root error (a failed one keeps its previous root).
    """

    step: int
    roots: np.ndarray
    errors: np.ndarray


def required_source_step(step: int, every: int, max_age: int, lag: int = 0) -> int:
    """The oldest statistics step update ``step`` may use: ``min(s - s % every, step - max_age)``
    with ``s = step - lag`` (the seam's ``lag``)."""
    scheduled = step - lag
    return min(scheduled - scheduled % every, step - max_age)


TRIM_INTERVAL_S = 5.0
"""Least seconds between two hand-backs of a shard's free heap pages after root installs."""


def default_max_age(every: int) -> int:
    """The bound when a session sets none: ``2 * preconditioning_compute_steps``."""
    return 2 * every


class RootReplication:
    """What a replicated session part asks of its roots' handling (a standby installs the roots its
    primary installed: see :class:`RootInstall`). This base is a part whose roots, if any, are
    computed inside its update, so that its state holds them the same on both replicas:
    nothing is installed, kept or shipped."""

    def keep_installs(self, keep: bool) -> None:
        """Whether installs are kept for a standby (:meth:`take_installs`): none are installed here."""

    def take_installs(self) -> list[RootInstall]:
        """The roots installed since the last call, in order: none (they are computed in the update)."""
        return []

    def follow_primary(self) -> None:
        """A standby's: its roots are the primary's (:meth:`install_shipped`): nothing changes here."""

    def install_shipped(self, installs: Sequence[RootInstall]) -> None:
        """Roots a primary installed before the next update.

        Raises:
          ValueError: there are some: this part computes its roots in its update, its primary did not.
        """
        if installs:
            raise ValueError(f"the primary installed {len(installs)} offloaded roots, and this part computes its "
                             f"roots inside its update")

    def lead(self, state) -> None:
        """A promoted standby's: it decides its roots from now on (nothing to do for roots in the update)."""


NO_ROOTS = RootReplication()
"""The root handling of a part whose kernel has no matrix roots."""


class ShardPreconditioners(RootReplication):
    """In-process roots (the kernel computes them in its update): per-block status only.

    Args:
      seam: the kernel's ``RootOffloadSeam``.
      config: the kernel's typed config (``seam.config(**args)``).
      labels: the shard's statistics in export order (``seam.block_labels``).
    """

    offloaded = False

    def __init__(self, seam, config, labels: Sequence):
        self.seam = seam
        self.config = config
        self.labels = list(labels)
        b = len(self.labels)
        # (count, source_step, failures, last_error, fallback_steps) after the latest update, host side
        self._snapshot = (0, np.full((b,), -1), np.zeros((b,), np.int64), np.zeros((b,), np.float32),
                          np.zeros((b,), np.int64))
        self.roots_installed = 0
        self.waits = 0
        self.resubmits = 0

    def before_update(self, state, grads, params):
        """Called with the pending gradients right before the update; returns the state to use."""
        return state

    def after_update(self, state):
        """Called right after the update; returns the state to keep."""
        self._record(state)
        return state

    def resume(self, state) -> None:
        """A state installed from a user's saved state (not reached by this object's updates):
        its status is recorded as after an update."""
        self._record(state)

    def _record(self, state) -> None:
        import jax

        count, source, failures, last_error = jax.device_get(self.seam.progress(state))
        source = np.asarray(source)
        fallback = self._snapshot[4] + (source < 0)
        self._snapshot = (int(count), source, np.asarray(failures), np.asarray(last_error), fallback)

    def _resubmits(self) -> int:
        return self.resubmits

    def status(self) -> RootStatus:
        """As of the latest update (a snapshot: safe to call from any thread)."""
        count, source, failures, errors, fallback = self._snapshot
        blocks = tuple(
            PreconditionerBlockStatus(label.tensor, label.block, label.dim, label.size,
                            (count - 1) - int(source[i]) if source[i] >= 0 and count > 0 else -1,
                            float(errors[i]), int(failures[i]), int(fallback[i]))
            for i, label in enumerate(self.labels))
        offload = RootOffloadStatus(self.offloaded, getattr(self, "max_age", None), self.roots_installed, self.waits,
                                    self._resubmits())
        return RootStatus(offload, blocks)


class OffloadedPreconditioners(ShardPreconditioners):
    """Roots from the preconditioner workers (see the module docstring for the schedule).

    Args:
      seam / config / labels: as :class:`ShardPreconditioners` (config built without in-update roots).
      pool: the shard's :class:`PreconditionerPool`.
      max_age: the bound ``A`` (>= 0).
      wait_timeout_s: longest wait for a job before its missing batches are computed here.
    """

    offloaded = True

    def __init__(self, seam, config, labels: Sequence, pool: PreconditionerPool, max_age: int,
                 wait_timeout_s: float = 120.0):
        import jax

        if max_age < 0:
            raise ValueError(f"max_age must be >= 0, got {max_age}")
        super().__init__(seam, config, labels)
        self.pool = pool
        self.max_age = max_age
        self._every = seam.compute_steps(config)
        self._lag = seam.lag
        self._wait_timeout_s = wait_timeout_s
        self._computation = RootComputation(seam.compute_roots, seam.root_config(config))
        self._export_pending = jax.jit(lambda state, grads: seam.export(state, config, grads))
        self._export_current = jax.jit(lambda state: seam.export(state, config))
        # The state is donated: its unchanged leaves (statistics, momenta, parameters' state) are
        # kept in place, not copied into a whole new state beside the old one at every install.
        self._install = jax.jit(lambda state, roots, errors, step: seam.install(
            state, config, roots, errors, step), donate_argnums=(0,))
        self._jobs: collections.deque[RootJob] = collections.deque()
        self._trim_due = False  # an install freed an export and its roots since the heap last gave pages back
        self._trimmed_at = -TRIM_INTERVAL_S
        self._offered = -1  # step of the newest installed export (whatever its blocks' outcome)
        self._exported = -1  # step of the newest export sent
        self._keep: Optional[list[RootInstall]] = None  # installs since the standby last took them (None: no standby)
        self._following = False  # a standby's: it installs its primary's roots, and computes none
        self._shipped: list[RootInstall] = []  # following: the primary's installs before the next update

    def keep_installs(self, keep: bool) -> None:
        """A primary with a standby (``keep``): every install from now on is kept, in order, until
        :meth:`take_installs` (each update's are shipped with its step); none are kept otherwise."""
        self._keep = [] if keep else None

    def take_installs(self) -> list[RootInstall]:
        """The installs kept since the last call (see :meth:`keep_installs`), oldest first."""
        if not self._keep:
            return []
        taken, self._keep = self._keep, []
        return taken

    def follow_primary(self) -> None:
        """A standby's: from now on each update installs exactly the roots its primary installed
        before it (:meth:`install_shipped`), and nothing is exported or waited for here."""
        self._following = True
        self._shipped = []

    def install_shipped(self, installs: Sequence[RootInstall]) -> None:
        """Following: the roots the primary installed before the update about to be applied here."""
        if not self._following:
            raise ValueError("roots were shipped to a part that does not follow a primary")
        self._shipped = list(installs)

    def lead(self, state) -> None:
        """A promoted standby's: it decides its roots from now on, as a state installed from a
        save does (:meth:`resume`), knowing the newest export its primary installed; the
        primary's exports in flight died with it, so when the newest one due is not installed,
        the statistics now are exported at once (not only once the age bound needs them)."""
        import jax

        offered = self._offered
        self._following, self._shipped = False, []
        self.resume(state)
        self._offered = max(self._offered, offered)
        if not self.labels:
            return
        step = int(jax.device_get(self.seam.progress(state)[0])) - 1
        due = step - step % self._every  # the newest export after an update (its statistics' step)
        if step >= 0 and due > self._offered and step > self._exported:
            self._submit(self._export_current(state))

    def before_update(self, state, grads, params):
        import jax

        if self._following:
            shipped, self._shipped = self._shipped, []
            for install in shipped:
                state = self._install_roots(state, install)
            return state
        if not self.labels:
            return state
        step = int(self.seam.progress(state)[0])
        state = self._install_newest_done(state)
        need = required_source_step(step, self._every, self.max_age, self._lag)
        if self._offered >= need:
            return state
        self.waits += 1
        for i, job in enumerate(self._jobs):
            if job.step >= need:
                self._finish(job)
                return self._install_job(state, i)
        if self._lag:  # the state already holds the statistics the bound asks for (step t - 1)
            self._submit(self._export_current(state))
        else:
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
            self._submit(self._export_pending(state, grads))
        self._finish(self._jobs[-1])
        return self._install_job(state, len(self._jobs) - 1)

    def after_update(self, state):
        self._release_exchange_memory()
        if self.labels and not self._following:
            step = int(self.seam.progress(state)[0]) - 1
            if step % self._every == 0 and step > self._exported:
                self._submit(self._export_current(state))
        self._record(state)
        return state

    def resume(self, state) -> None:
        """A state installed from a user's saved state: continues as the updates that made it
        would have, knowing the newest roots it holds (the export they came from is the newest
        offered and sent) and exporting the statistics of its last update if that one was due
        to export (its roots were in flight when the state was saved)."""
        import jax

        super().resume(state)
        if not self.labels:
            return
        count, source = (int(v) if np.ndim(v) == 0 else np.asarray(v) for v in
                         jax.device_get(self.seam.progress(state)[:2]))
        self._offered = self._exported = int(source.max()) if source.size else -1
        step = count - 1
        if step >= 0 and not self._following and step % self._every == 0 and step > self._exported:
            self._submit(self._export_current(state))

    def drain(self) -> None:
        """Waits for the exports still in flight and drops them (before shutting Ray down)."""
        while self._jobs:
            self._finish(self._jobs.popleft())

    def _release_exchange_memory(self) -> None:
        """Hands the heap's free pages back after an install (its roots and temporaries, a few
        times the statistics, are free then; one skipped for the interval is done after a later
        step), at most every :data:`TRIM_INTERVAL_S`: the heap otherwise keeps freed memory for
        the steps' reuse, and a step after a trim page-faults its temporaries afresh."""
        now = time.monotonic()
        if self._trim_due and now - self._trimmed_at >= TRIM_INTERVAL_S:
            release_free_memory()
            self._trim_due, self._trimmed_at = False, now

    # ---------------------------------------------------------------- jobs
    def _submit(self, exported) -> None:
        step = int(exported.step)
        previous = getattr(exported, "previous", None)  # a second stacked input (SOAP's bases in use)
        job = self.pool.submit(np.asarray(exported.statistics), np.asarray(exported.exponents),
                               np.asarray(exported.sizes), step, self._computation,
                               previous=None if previous is None else np.asarray(previous))
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
        return self._install_roots(state, RootInstall(job.step, roots, errors))

    def _install_roots(self, state, install: RootInstall):
        """``state`` with ``install``'s roots in place (kept for a standby, if any)."""
        state = self._install(_distinct_buffers(state), install.roots, install.errors, np.int32(install.step))
        self._offered = max(self._offered, install.step)
        self.roots_installed += 1
        if self._keep is not None:
            self._keep.append(install)
        del install  # unless kept: the export's batches are views of the object store, not on this heap
        self._trim_due = True
        self._release_exchange_memory()  # before the step: its temporaries then fit in what is left
        return state

    def _resubmits(self) -> int:
        return self.resubmits + sum(job.resubmits for job in list(self._jobs))


def _distinct_buffers(state):
    """``state`` with no two leaves in one device buffer (a state built eagerly may share one
    between equal leaves), so it can be donated whole: a repeated buffer is copied."""
    import jax
    import jax.numpy as jnp

    seen: set = set()

    def once(leaf):
        try:
            key = leaf.unsafe_buffer_pointer()
        except Exception:  # noqa: BLE001 - not a single-buffer device array: its identity will do
            key = id(leaf)
        if key in seen:
            return jnp.array(leaf, copy=True)
        seen.add(key)
        return leaf
    return jax.tree.map(once, state)


def build_shard_optimizer(name: str, args: Mapping[str, Any], shapes: Mapping[str, Sequence[int]],
                          pool: Optional[PreconditionerPool], *, in_process: bool = False,
                          max_age: Optional[int] = None) -> tuple[BuiltOptimizer, Optional[ShardPreconditioners]]:
    """Builds a session's optimizer for one shard (once) and decides where its roots are computed.

    Args:
      name / args: the session's registry entry and options (already validated).
      shapes: the shard's tensors, name -> shape.
      pool: the server's preconditioner pool (None: no workers).
      in_process: the session asks for roots inside the update even when workers exist.
      max_age: the session's age bound in steps (None: :func:`default_max_age`).

    Returns:
      ``(optimizer to run, preconditioners)``; preconditioners is None for a kernel without a
      root offload seam, else the object the updater calls around each step.
    """
    seam = optimizer_entry(name).root_offload
    if seam is None:
        return build_optimizer(name, args), None
    offload = pool is not None and not in_process
    if offload:
        args = seam.without_inline_roots(args)
    optimizer = build_optimizer(name, args)
    config = seam.config(**resolve_schedules(name, args))
    labels = seam.block_labels(config, shapes)
    if not offload:
        return optimizer, ShardPreconditioners(seam, config, labels)
    every = seam.compute_steps(config)
    bound = default_max_age(every) if max_age is None else max_age
    return optimizer, OffloadedPreconditioners(seam, config, labels, pool, bound)
