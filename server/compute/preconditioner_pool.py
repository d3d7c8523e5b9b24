"""Compute layer: the pool of preconditioner workers and the root jobs shards send to it.

A shard hands the pool one export (``[B, n, n]`` identity-padded statistics of its whole tree, and
the results in use in the same layout when the kernel's export carries them);
the pool cuts it into batches of a fixed size ``b`` (``min(batch_blocks, next power of two >= B)``,
the last one padded with identity matrices, so a worker compiles once per shape), deals the
batches round-robin over the workers (each shard starts at its own offset, so shards sharing a
pool spread evenly) and returns a :class:`RootJob` at once. The shard polls the job without
blocking (:meth:`PreconditionerPool.poll`) or waits for it (:meth:`PreconditionerPool.wait`).

Failure handling, one place:
* a worker that dies is restarted by Ray (``max_restarts=-1``) and Ray retries the calls it was
  running (``max_task_retries``); a batch whose call still fails with a worker error is
  resubmitted to the next worker, up to ``max_attempts`` calls in all, then computed in the
  calling process, so roots always arrive;
* an error raised by the computation itself marks the batch's roots as failed (``errors = inf``):
  the shard keeps the previous preconditioners and counts a failure.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Optional

import numpy as np

from optserve.server.compute.devices import DeviceRequest, refuse_problems
from optserve.server.compute.preconditioner_worker import PreconditionerWorker, RootComputation, compute_roots_fn

log = logging.getLogger(__name__)

# Calls that Ray itself retries on a restarted worker before the pool sees an error.
_RAY_TASK_RETRIES = 2


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """Preconditioner workers of a server.

    Attributes:
      workers: number of worker actors (``--precond-workers``), >= 1.
      gpus_per_worker: GPUs each worker requests from Ray (0: CPU).
      rehearsal: GPUs reserved in Ray, JAX on the CPU (``--rehearse-gpus``).
      f64: compute roots in float64 (``--precond-f64``).
      batch_blocks: largest number of matrices in one worker call, >= 1.
      max_attempts: worker calls per batch before computing it locally, >= 1.
    """

    workers: int
    gpus_per_worker: float = 0.0
    f64: bool = False
    batch_blocks: int = 32
    max_attempts: int = 3
    rehearsal: bool = False

    @property
    def device(self) -> DeviceRequest:
        """What each worker asks Ray for, and how its JAX uses it."""
        return DeviceRequest("preconditioner worker", "--gpus-per-precond-worker", self.gpus_per_worker,
                             self.rehearsal, full_precision=True)

    def __post_init__(self):
        if self.workers < 1:
            raise ValueError(f"preconditioner pool: workers must be >= 1, got {self.workers}")
        if self.batch_blocks < 1 or self.max_attempts < 1:
            raise ValueError("preconditioner pool: batch_blocks and max_attempts must be >= 1")


def ray_started_here() -> bool:
    """Whether this process started the Ray instance it is connected to (``ray.init()`` without an
    address: the embedded ``--ray-address local`` Ray, whose resources are fixed: no autoscaler adds
    nodes to it). False for a cluster joined by address, and when Ray's private node record cannot
    be read (then callers wait, as they do for a cluster that may grow)."""
    try:
        import ray._private.worker as ray_worker

        node = ray_worker._global_node
        return bool(node is not None and node.head)
    except (ImportError, AttributeError):
        return False


def check_gpus(flag: str, per_actor: float, actors: int, what: str) -> None:
    """Checks that the Ray cluster has the ``actors x per_actor`` GPUs that ``flag`` asks for.

    Ray would otherwise wait for them without end. The choice: when Ray was started by this process
    (:func:`ray_started_here`) the cluster can never grow, so a shortfall raises at once; on a
    cluster joined by address an autoscaler may still add GPU nodes, so a shortfall is only logged
    and the caller waits (for the shards, up to their placement timeout).

    Raises:
      RuntimeError: one line, e.g. ``the Ray cluster has 0 GPUs, --gpus-per-shard 1 x 2 shards
        needs 2``.
    """
    import ray

    needed = per_actor * actors
    if needed <= 0:
        return
    have = float(ray.cluster_resources().get("GPU", 0.0))
    if needed <= have:
        return
    message = f"the Ray cluster has {have:g} GPUs, {flag} {per_actor:g} x {actors} {what} needs {needed:g}"
    if ray_started_here():
        raise RuntimeError(message)
    log.warning("%s: waiting for the cluster to add GPU nodes", message)


def start_workers(config: PoolConfig, detached: Optional[tuple[str, str]] = None) -> list:
    """Starts ``config.workers`` worker actors (Ray restarts each one when it dies).

    ``detached``: ``(name prefix, namespace)``: named actors detached from the caller, which
    outlive it; a later call with the same prefix gets the running ones instead of new ones (a
    durable server's restarted coordinator on a Ray cluster).

    Raises:
      RuntimeError: the embedded Ray has fewer GPUs than the workers ask for (:func:`check_gpus`).
      DeviceUnusable: a worker's JAX cannot use the GPUs it was given.
    """
    import ray

    check_gpus("--gpus-per-precond-worker", config.gpus_per_worker, config.workers, "preconditioner workers")
    # GPUs: the worker's JAX sees (only) those Ray assigned it, within the memory budget of its share
    # no task events: Ray's GCS would keep every root computation's (see start_shards)
    resources = {"num_cpus": 0, "max_restarts": -1, "max_task_retries": _RAY_TASK_RETRIES,
                 "enable_task_events": False, **config.device.ray_options()}
    cls = ray.remote(PreconditionerWorker)
    if detached is None:
        workers = [cls.options(**resources).remote(i, config.f64, config.device) for i in range(config.workers)]
    else:
        prefix, namespace = detached
        workers = [cls.options(**resources, name=f"{prefix}-precond-{i}", namespace=namespace, lifetime="detached",
                               get_if_exists=True).remote(i, config.f64, config.device)
                   for i in range(config.workers)]
    try:
        reports = refuse_problems([info["placement"] for info in ray.get([w.info.remote() for w in workers])])
    except BaseException:  # detached ones would be found and reused by the next start
        for worker in workers:
            ray.kill(worker)
        raise
    for report in reports:
        if report.gpu_ids or report.backend != "cpu":
            log.info("event=device %s", " ".join(f"{key}={value}" for key, value in report.fields().items()))
    return workers


def batch_size(blocks: int, batch_blocks: int) -> int:
    """The fixed batch size for an export of ``blocks`` matrices: a power of two, <= batch_blocks."""
    size = 1
    while size < blocks:
        size *= 2
    return max(1, min(size, batch_blocks))


@dataclasses.dataclass
class _Batch:
    start: int
    stop: int
    worker: int
    ref: Any
    attempts: int = 1
    result: Optional[tuple[np.ndarray, np.ndarray]] = None
    inputs: Optional[list] = None  # ObjectRefs of the batch's arrays, put once (resends reuse them)


@dataclasses.dataclass
class RootJob:
    """One export in flight.

    Attributes:
      step: the export's step (the last update whose gradient its statistics contain).
      blocks: ``B``, the number of real matrices.
      batches: the worker calls, in block order.
      statistics / previous: the export's stacked matrices until every batch is in the object
        store (then None: the batches' ``inputs`` hold them, once).
      resubmits: calls sent again after a worker error.
    """

    step: int
    blocks: int
    batches: list[_Batch]
    statistics: Optional[np.ndarray] = dataclasses.field(repr=False)
    exponents: np.ndarray = dataclasses.field(repr=False)
    sizes: np.ndarray = dataclasses.field(repr=False)
    computation: RootComputation = dataclasses.field(repr=False)
    resubmits: int = 0
    previous: np.ndarray | None = dataclasses.field(default=None, repr=False)
    matrix_size: int = 0  # n

    @property
    def done(self) -> bool:
        return all(b.result is not None for b in self.batches)


class PreconditionerPool:
    """Submits root jobs to the workers (picklable: shard actors each hold a copy).

    Args:
      workers: worker actor handles (from :func:`start_workers`).
      config: the pool's configuration.
      first: the worker the first batch goes to (a shard passes its index).
    """

    def __init__(self, workers: list, config: PoolConfig, first: int = 0):
        self.workers = list(workers)
        self.config = config
        self._next = first % max(1, len(self.workers))
        # Workers whose process died: skipped until their probe call answers (Ray restarted
        # them); a worker killed for good fails its probe and stays skipped.
        self._suspects: dict[int, Any] = {}  # worker index -> probe ObjectRef
        self._local_fns: dict[RootComputation, Any] = {}

    def for_shard(self, index: int) -> "PreconditionerPool":
        """This pool with round-robin starting at worker ``index`` (spreads shards evenly)."""
        return PreconditionerPool(self.workers, self.config, first=index)

    def __getstate__(self):
        return {"workers": self.workers, "config": self.config, "_next": self._next, "_suspects": {},
                "_local_fns": {}}

    # ---------------------------------------------------------------- submit
    def submit(self, statistics: np.ndarray, exponents: np.ndarray, sizes: np.ndarray, step: int,
               computation: RootComputation, previous: np.ndarray | None = None) -> RootJob:
        """Sends one export's batches to the workers; returns immediately.

        Args:
          statistics: f32 [B, n, n] identity-padded statistics.
          exponents, sizes: int32 [B].
          step: the export's step (kept on the job).
          computation: the session's root computation.
          previous: f32 [B, n, n] identity-padded results in use, passed on to the computation
            (None: the kernel's export has none).
        """
        statistics = np.ascontiguousarray(statistics, dtype=np.float32)
        if previous is not None:
            previous = np.ascontiguousarray(previous, dtype=np.float32)
        exponents = np.asarray(exponents, np.int32)
        sizes = np.asarray(sizes, np.int32)
        blocks = statistics.shape[0]
        b = batch_size(blocks, self.config.batch_blocks)
        job = RootJob(int(step), blocks, [], statistics, exponents, sizes, computation, previous=previous,
                      matrix_size=int(statistics.shape[1]))
        for start in range(0, blocks, b):
            batch = _Batch(start, min(start + b, blocks), -1, None)
            self._send(job, batch, b)
            job.batches.append(batch)
        if all(batch.inputs is not None or batch.result is not None for batch in job.batches):
            job.statistics = job.previous = None  # the object store holds them: not a second copy here
        return job

    def _send(self, job: RootJob, batch: _Batch, b: int) -> None:
        """Sends a batch to the next live worker (computes it here when every worker is down)."""
        self._check_suspects()
        live = [i for i in range(len(self.workers)) if i not in self._suspects]
        if not live:
            batch.result = self._compute_locally(job, batch, b)
            return
        while self._next in self._suspects:
            self._next = (self._next + 1) % len(self.workers)
        batch.worker = self._next
        self._next = (self._next + 1) % len(self.workers)
        batch.ref = self._call(job, batch, b, batch.worker)

    def _batch_arrays(self, job: RootJob, start: int, b: int) -> tuple:
        """The batch at ``start``, padded to ``b`` matrices with identities (size n, p = 2):
        ``(statistics, exponents, sizes)``, then ``previous`` when the job has it."""
        stop = min(start + b, job.blocks)
        arrays = [job.statistics[start:stop], job.exponents[start:stop], job.sizes[start:stop]]
        if job.previous is not None:
            arrays.append(job.previous[start:stop])
        missing = b - (stop - start)
        if missing:
            n = job.matrix_size
            identities = np.broadcast_to(np.eye(n, dtype=np.float32), (missing, n, n))
            pads = [identities, np.full((missing,), 2, np.int32), np.full((missing,), n, np.int32), identities]
            arrays = [np.concatenate([a, pad]) for a, pad in zip(arrays, pads)]
        return tuple(arrays)

    def _inputs(self, job: RootJob, batch: _Batch, b: int) -> list:
        """The batch's arrays in the object store (put at its first send; a resend reuses them)."""
        if batch.inputs is None:
            import ray

            batch.inputs = [ray.put(array) for array in self._batch_arrays(job, batch.start, b)]
        return batch.inputs

    def _call(self, job: RootJob, batch: _Batch, b: int, worker: int):
        stats, exps, sizes, *previous = self._inputs(job, batch, b)
        return self.workers[worker].compute.remote(stats, exps, sizes, job.computation, *previous)

    # ---------------------------------------------------------------- collect
    def poll(self, job: RootJob) -> bool:
        """Collects finished batches without blocking; True when the whole job is done."""
        self._collect(job, timeout_s=0.0)
        return job.done

    def wait(self, job: RootJob, timeout_s: Optional[float] = None) -> bool:
        """Blocks until the job is done (resubmitting as needed) or ``timeout_s`` passes."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not job.done:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._collect(job, timeout_s=left)
            if deadline is not None and time.monotonic() >= deadline:
                break
        return job.done

    def result(self, job: RootJob) -> tuple[np.ndarray, np.ndarray]:
        """``(roots f32 [B, n, n], errors f32 [B])`` of a done job, in block order."""
        if not job.done:
            raise RuntimeError(f"root job of step {job.step} is not done")
        roots = np.concatenate([b.result[0][: b.stop - b.start] for b in job.batches])
        errors = np.concatenate([b.result[1][: b.stop - b.start] for b in job.batches])
        return roots, errors

    def _collect(self, job: RootJob, timeout_s: Optional[float]) -> None:
        import ray

        pending = [b for b in job.batches if b.result is None]
        if not pending:
            return
        ready, _ = ray.wait([b.ref for b in pending], num_returns=len(pending), timeout=timeout_s)
        ready_set = set(ready)
        for batch in pending:
            if batch.ref in ready_set:
                self._take(job, batch)

    def _take(self, job: RootJob, batch: _Batch) -> None:
        import ray
        from ray import exceptions as rex

        b = batch_size(job.blocks, self.config.batch_blocks)
        try:
            batch.result = ray.get(batch.ref)
        except (rex.RayActorError, rex.WorkerCrashedError, rex.OutOfMemoryError, rex.ObjectLostError) as exc:
            if isinstance(exc, rex.ActorDiedError) and batch.worker not in self._suspects:
                # Its process died: Ray may be restarting it, or it is gone for good; a probe tells.
                self._suspects[batch.worker] = self.workers[batch.worker].info.remote()
            if batch.attempts >= self.config.max_attempts:
                log.warning("root batch [%d, %d) of step %d failed %d times (%s); computing it locally",
                            batch.start, batch.stop, job.step, batch.attempts, type(exc).__name__)
                batch.result = self._compute_locally(job, batch, b)
                return
            batch.attempts += 1
            job.resubmits += 1
            self._send(job, batch, b)
        except rex.RayTaskError as exc:
            log.warning("root batch [%d, %d) of step %d raised %s; its roots count as failed",
                        batch.start, batch.stop, job.step, exc)
            n = job.matrix_size
            batch.result = (np.zeros((b, n, n), np.float32), np.full((b,), np.inf, np.float32))

    def _check_suspects(self) -> None:
        """Takes back the suspect workers whose probe answered (restarted); never blocks."""
        import ray

        if not self._suspects:
            return
        ready, _ = ray.wait(list(self._suspects.values()), num_returns=len(self._suspects), timeout=0)
        for worker, probe in list(self._suspects.items()):
            if probe not in ready:
                continue
            try:
                ray.get(probe)
            except Exception:  # noqa: BLE001 - dead for good: its probe keeps failing, it stays out
                continue
            del self._suspects[worker]

    def finish_locally(self, job: RootJob) -> None:
        """Computes the job's missing batches in this process (when the workers do not answer)."""
        b = batch_size(job.blocks, self.config.batch_blocks)
        for batch in job.batches:
            if batch.result is None:
                batch.result = self._compute_locally(job, batch, b)

    def _compute_locally(self, job: RootJob, batch: _Batch, b: int) -> tuple[np.ndarray, np.ndarray]:
        fn = self._local_fns.get(job.computation)
        if fn is None:
            fn = self._local_fns[job.computation] = compute_roots_fn(job.computation)
        if batch.inputs is not None:
            import ray

            arrays = ray.get(batch.inputs)
        else:
            arrays = self._batch_arrays(job, batch.start, b)
        roots, errors = fn(*arrays)
        return np.asarray(roots, np.float32), np.asarray(errors, np.float32)
