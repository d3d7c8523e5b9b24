"""How :mod:`bench.scale` runs one point: the server process, the worker processes, the timed rounds.

A point is one model (its shapes), one optimizer, one client path, a shard count and a worker
count. :func:`run_point` (one worker) opens a memory window (:class:`~bench._scale_report.MemorySampler`)
once the client process has imported its libraries, creates the session and takes the warm-up
steps inside it, then times the client's step and the in-process kernel's step in interleaved
rounds (:func:`bench.service.interleaved_seconds`; each process times its own step). The server's
push / step / pull phase times over the rounds come from its metrics (``--metrics-port 0``).
:func:`run_workers` steps ``workers`` client processes at once on one session and counts pushes.
"""

from __future__ import annotations

import multiprocessing
import statistics
import sys
import time
from typing import Any, Mapping, Optional, Sequence

from bench import _scale_worker
from bench._scale_report import MemorySampler
from bench.gpu import Server as _GpuServer, start_listening
from bench.load import _warm_up
from bench.service import interleaved_seconds

CALL_TIMEOUT_S = 3600.0


class ScaleServer:
    """``optserve serve`` in a process of its own with an embedded local Ray (``--min-shard-bytes 0``
    so every session spans ``shards``, metrics on a free port), plus ``flags``; each shard has
    stepped a tiny session before any point (JAX's runtime started, as in :mod:`bench.load`)."""

    phase_totals = _GpuServer.phase_totals  # {(phase, shard): (seconds, count)} of a session, from /metrics

    def __init__(self, log_dir: str, shards: int, flags: Sequence[str]):
        argv = [sys.executable, "-m", "optserve.server.cli", "serve", "--port", "0", "--shards", str(shards),
                "--min-shard-bytes", "0", "--metrics-port", "0", *flags]
        self.shards = shards
        self.flags = tuple(flags)
        self._process, self.address = start_listening(argv, log_dir)
        self.pid = self._process.process.pid
        try:  # JAX's runtime started on every shard (a tiny session each): not counted as any model's memory
            _warm_up(self.address, shards)
        except BaseException:
            self._process.stop()
            raise

    def stop(self) -> None:
        self._process.stop()


def phase_means(before: Mapping, after: Mapping) -> str:
    """``"push 1.2 / step 30.1 / pull 4.0"``: each phase's mean ms per call between two
    ``phase_totals``, averaged over the shards."""
    means: dict[str, list[float]] = {}
    for (phase, _shard), (seconds, count) in after.items():
        seconds0, count0 = before.get((phase, _shard), (0.0, 0.0))
        if count > count0:
            means.setdefault(phase, []).append((seconds - seconds0) / (count - count0) * 1e3)
    return " / ".join(f"{p} {statistics.mean(means[p]):.1f}" for p in ("push", "step", "pull") if p in means)


class Worker:
    """A :mod:`bench._scale_worker` process playing ``role``; :meth:`call` sends one command."""

    def __init__(self, role: str):
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.role = role
        self.process = context.Process(target=_scale_worker.serve, args=(child, role), daemon=True,
                                       name=f"scale-{role}")
        self.process.start()
        child.close()
        self.ready = self.call("ready")

    def send(self, command: str, **kwargs: Any) -> None:
        self._conn.send((command, kwargs))

    def receive(self, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(1.0):
            if not self.process.is_alive():
                raise RuntimeError(f"the {self.role} process died (exit code {self.process.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {self.role} process did not answer in {timeout_s:.0f} s")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"the {self.role} process failed:\n{value}")
        return value

    def call(self, command: str, **kwargs: Any) -> Any:
        self.send(command, **kwargs)
        return self.receive()

    def stop(self) -> None:
        try:
            if self.process.is_alive():
                self.call("stop")
        except Exception:  # noqa: BLE001 - a process that cannot stop cleanly is killed below
            pass
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)


class Kernel:
    """The in-process kernel of one optimizer and model, in its own process: its step's seconds."""

    def __init__(self, shapes, optimizer: Mapping[str, Any]):
        self.worker = Worker("kernel")
        self.setup = self.worker.call("setup", shapes=shapes, optimizer=optimizer)
        self.step()  # compiled

    def step(self) -> float:
        return self.worker.call("step")

    def stop(self) -> None:
        self.worker.stop()


def _per_param(value: Optional[float], params: int) -> Optional[float]:
    return None if value is None else value / params


def run_point(server: ScaleServer, sampler: MemorySampler, kernel: Optional[Kernel], *, session: str, path: str,
              shapes, optimizer: Mapping[str, Any], params: int, warmup: int, rounds: int,
              profile: int = 0) -> dict[str, Any]:
    """One client on a fresh session: memory over create + ``warmup`` steps, then ``rounds``
    interleaved with ``kernel``'s steps (``None``: the caller times the kernel apart)."""
    client = Worker(path)
    try:
        sampler.open(server.pid, [client.process.pid])
        setup = client.call("setup", address=server.address, session=session, shapes=shapes, optimizer=optimizer,
                            options={}, create=True)
        for _ in range(warmup):
            client.call("step")
        growth = sampler.close()
        memory = client.call("memory")
        before = server.phase_totals(session)
        times: dict[str, list[float]] = {"service": [], "kernel": []}
        fns = {"service": lambda: times["service"].append(client.call("step"))}
        if kernel is not None:
            fns["kernel"] = lambda: times["kernel"].append(kernel.step())
        interleaved_seconds(fns, rounds=rounds, warmup=0)
        phases = phase_means(before, server.phase_totals(session))
        listing = client.call("profile", steps=profile) if profile else ""
    finally:
        client.stop()
    step = statistics.median(times["service"])
    row = {"step_ms": step * 1e3, "ns_per_param": step / params * 1e9, "create_s": setup["create_s"],
           "client_rss_bpp": _per_param(memory["VmHWM"] - client.ready["rss"], params),
           **{f"{key}_bpp": _per_param(value, params) for key, value in growth.items()}, "phases": phases,
           "data_paths": "+".join(setup.get("data_paths", [])), "shared_tensors": setup.get("shared_tensors"),
           "samples": times["service"], "profile": listing}
    if times["kernel"]:
        row.update(kernel_times(times["kernel"]), interleaved=True)
        ratios = [s / k for s, k in zip(times["service"], times["kernel"])]
        row.update(ratio=statistics.median(ratios), ratio_range=(min(ratios), max(ratios)))
    return row


def kernel_times(samples: Sequence[float]) -> dict[str, Any]:
    return {"kernel_ms": statistics.median(samples) * 1e3, "kernel_samples": list(samples)}


def kernel_apart(shapes, optimizer: Mapping[str, Any], rounds: int) -> dict[str, Any]:
    """The kernel's step timed alone (after the service's point, where both do not fit at once)."""
    kernel = Kernel(shapes, optimizer)
    try:
        return kernel_times([kernel.step() for _ in range(rounds)])
    finally:
        kernel.stop()


def run_workers(server: ScaleServer, sampler: MemorySampler, kernel: Optional[Kernel], *, session: str, path: str,
                shapes, optimizer: Mapping[str, Any], params: int, workers: int, mode: str, rounds: int,
                steps_per_round: int) -> dict[str, Any]:
    """``workers`` client processes on one session (``mode`` async: every push is an update; sync:
    an update per ``workers`` pushes), all stepping ``steps_per_round`` at once per round; the
    round's pushes over its wall time, median over ``rounds`` (a kernel step between rounds)."""
    procs = [Worker(path) for _ in range(workers)]
    try:
        sampler.open(server.pid, [proc.process.pid for proc in procs])
        options = {"mode": mode} if mode == "async" else {"mode": "sync", "num_workers": workers}
        common = dict(address=server.address, session=session, shapes=shapes, optimizer=optimizer, options=options)
        setups = [procs[0].call("setup", create=True, seed=0, **common)]
        for index, proc in enumerate(procs[1:], 1):
            proc.send("setup", create=False, seed=index, **common)
        setups += [proc.receive() for proc in procs[1:]]
        _all_steps(procs, 2)
        growth = sampler.close()
        memory = [proc.call("memory")["VmHWM"] - proc.ready["rss"] for proc in procs]
        before = server.phase_totals(session)
        rates, kernel_samples = [], []
        for _ in range(rounds):
            wall = _all_steps(procs, steps_per_round)
            rates.append(workers * steps_per_round / wall)
            if kernel is not None:
                kernel_samples.append(kernel.step())
        phases = phase_means(before, server.phase_totals(session))
    finally:
        for proc in procs:
            proc.stop()
    pushes = statistics.median(rates)
    row = {"pushes_per_s": pushes, "updates_per_s": pushes if mode == "async" else pushes / workers,
           "mparams_per_s": pushes * params / 1e6, "client_rss_mb": statistics.mean(memory) / 2**20,
           **{f"{key}_bpp": _per_param(value, params) for key, value in growth.items()}, "phases": phases,
           "create_s": setups[0]["create_s"], "data_paths": "+".join(setups[0].get("data_paths", []))}
    if kernel_samples:
        row.update(kernel_times(kernel_samples))
        row["x_kernel_rate"] = row["updates_per_s"] * statistics.median(kernel_samples)
    return row


def _all_steps(procs: Sequence[Worker], n: int) -> float:
    started = time.perf_counter()
    for proc in procs:
        proc.send("steps", n=n)
    for proc in procs:
        proc.receive()
    return time.perf_counter() - started
