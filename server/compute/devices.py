"""Compute layer: the device an actor's JAX runs on, and the share of it that JAX may take.

A shard actor or preconditioner worker that asks Ray for GPUs (``--gpus-per-shard F``,
``--gpus-per-precond-worker F``; fractions allowed) is started with the environment of its
:class:`DeviceRequest` (:meth:`DeviceRequest.env`), which its JAX reads when it first starts a
backend. Ray itself sets ``CUDA_VISIBLE_DEVICES`` to the GPUs it assigned, so the actor's JAX sees
exactly those. The environment adds:

* ``XLA_PYTHON_CLIENT_MEM_FRACTION``: the memory budget, ``min(F, 1) x GPU_MEMORY_SHARE`` of each
  GPU the actor sees. XLA's own default is to preallocate 75% of the GPU in *every* process, so two
  shards at 0.5 on one GPU, or a shard beside its root worker, would ask for 150% of it.
* ``JAX_PLATFORMS=cpu`` for a rehearsal (``--rehearse-gpus``): Ray reserves and assigns the GPUs
  as it would, and JAX runs on the CPU. It checks a GPU deployment's placement on machines
  without GPUs (the GPU kit's dry run).

:func:`check_device` runs first in each such actor: it reports where the actor's JAX runs
(:class:`DeviceReport`) and, when the actor was given GPUs but its JAX found no GPU backend, why it
cannot serve, in one line naming the GPUs it expected and the backends it found. Where
:attr:`DeviceRequest.full_precision` (the root workers) it also sets JAX's default float32 matmul
precision to full: recent GPUs run float32 matmuls in TF32 by default, which moves inverse roots
and eigenbases past the tolerances they meet on a CPU.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

class DeviceUnusable(RuntimeError):
    """An actor's JAX cannot use the GPUs Ray gave it; the message is its report's one-line problem."""


def refuse_problems(reports: Sequence["DeviceReport"]) -> list:
    """``reports`` (a list), once none has a problem.

    Raises:
      DeviceUnusable: the first report's problem.
    """
    for report in reports:
        if report.problem:
            raise DeviceUnusable(report.problem)
    return list(reports)


GPU_MEMORY_SHARE = 0.9  # of an actor's GPU share: the rest is left to CUDA's own context per process


@dataclasses.dataclass(frozen=True)
class DeviceRequest:
    """What one actor asked Ray for, and how its JAX must use it.

    Attributes:
      role: the actor in words, e.g. ``"shard 0"`` or ``"preconditioner worker 1"``.
      flag: the flag that asked for its GPUs, e.g. ``"--gpus-per-shard"`` (for messages).
      gpus: GPUs requested from Ray (0: none; fractions share a GPU).
      rehearsal: GPUs reserved in Ray, JAX on the CPU (``--rehearse-gpus``).
      full_precision: float32 matmuls at full precision (no TF32), for the root workers.
    """

    role: str
    flag: str
    gpus: float = 0.0
    rehearsal: bool = False
    full_precision: bool = False

    @property
    def memory_fraction(self) -> float:
        """The share of each visible GPU's memory JAX may take in this actor (0: XLA's default,
        no GPU asked)."""
        return round(min(self.gpus, 1.0) * GPU_MEMORY_SHARE, 4) if self.gpus > 0 else 0.0

    def env(self) -> dict[str, str]:
        """Environment variables the actor's process must start with (Ray's ``runtime_env``)."""
        env: dict[str, str] = {}
        if self.gpus > 0:
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{self.memory_fraction:g}"
            if self.rehearsal:
                env["JAX_PLATFORMS"] = "cpu"
        return env

    def ray_options(self) -> dict:
        """Ray actor options for this request: its GPUs and its environment."""
        options: dict = {}
        if self.gpus > 0:
            options["num_gpus"] = self.gpus
        env = self.env()
        if env:
            options["runtime_env"] = {"env_vars": env}
        return options


@dataclasses.dataclass(frozen=True)
class DeviceReport:
    """Where one actor's JAX runs (server status, startup log).

    Attributes:
      role: as in :class:`DeviceRequest`.
      backend: JAX's default backend in the actor (``"gpu"``, ``"cpu"``, ...).
      devices: the JAX devices it sees, e.g. ``("cuda:0",)``.
      gpu_ids: the GPUs Ray assigned it (empty: none asked).
      memory_fraction: the share of each GPU's memory JAX may take, as the actor's environment
        says (0: XLA's default).
      rehearsal: GPUs reserved, JAX on the CPU.
      problem: why the actor cannot serve where it was placed (one line), or "".
    """

    role: str
    backend: str
    devices: tuple[str, ...] = ()
    gpu_ids: tuple[str, ...] = ()
    memory_fraction: float = 0.0
    rehearsal: bool = False
    problem: str = ""

    def fields(self) -> dict:
        """The report as ``event=device`` log fields (plain words, no spaces)."""
        return {"role": self.role.replace(" ", "-"), "backend": self.backend, "devices": ",".join(self.devices),
                "gpus": ",".join(self.gpu_ids) or "none", "memory_fraction": f"{self.memory_fraction:g}",
                "rehearsal": int(self.rehearsal)}


def check_device(request: DeviceRequest, gpu_ids: Sequence[str], node: str = "") -> DeviceReport:
    """Where this process's JAX runs for ``request``; ``gpu_ids``: the GPUs Ray assigned it.

    Starts JAX's backends (call it before anything else touches JAX in the actor). A GPU actor whose
    JAX finds no GPU backend (a node whose jax has no CUDA plugin, or a Ray node that declares GPUs
    it does not have) gets a ``problem``; the caller refuses to serve with it.
    """
    import jax

    if request.full_precision:
        jax.config.update("jax_default_matmul_precision", "highest")
    failure = ""
    try:
        devices = tuple(str(d) for d in jax.devices())
        backend = jax.default_backend()
    except RuntimeError as exc:  # a platform named in JAX_PLATFORMS that failed to start
        devices, backend, failure = (), "none", f" ({str(exc).strip().splitlines()[0]})"
    budget = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "") if request.gpus > 0 else ""
    report = DeviceReport(request.role, backend, devices, tuple(str(i) for i in gpu_ids),
                          float(budget) if budget else 0.0, request.rehearsal)
    if request.gpus > 0 and not request.rehearsal and backend != "gpu":
        where = f" on node {node}" if node else ""
        given = f"GPU {','.join(report.gpu_ids)}" if report.gpu_ids else "a GPU"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        problem = (f"{request.role}{where} was given {given} by Ray ({request.flag} {request.gpus:g}"
                   f"{'' if visible is None else f', CUDA_VISIBLE_DEVICES={visible}'}), but its JAX found no GPU "
                   f"backend (backends found: {_backends_found()}{failure}): install JAX with CUDA on that node, or drop "
                   f"{request.flag} (--rehearse-gpus runs JAX on the CPU)")
        report = dataclasses.replace(report, problem=problem)
    return report


def _backends_found() -> str:
    """The platforms JAX started in this process, in words."""
    import jax

    platforms: list[str] = []
    for platform in ("gpu", "tpu", "cpu"):
        try:
            if jax.devices(platform):
                platforms.append(platform)
        except RuntimeError:  # not started in this process
            pass
    return ", ".join(platforms) or "none"


def ray_gpu_ids() -> tuple[str, ...]:
    """The GPUs Ray assigned to this actor (empty outside Ray or without GPUs)."""
    try:
        import ray

        return tuple(ray.get_runtime_context().get_accelerator_ids().get("GPU", []))
    except Exception:  # noqa: BLE001 - not in a Ray worker
        return ()
