"""The demo's worker processes, driven from the parent: spawned, followed phase by phase through
their message queue (on a progress bar), and stopped.

A worker reports on its phase's queue ``("ready", rank, data paths)`` once attached, then
``("step", rank, step, loss, version)`` per step, and ``("done", rank, ...)`` at the end, or
``("error", rank, traceback text)``; it starts training when the phase's ``go`` event is set.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import queue as queue_module
import time
from typing import Any, Sequence

from optserve.demo.config import DemoConfig


def start_workers(target, tasks: Sequence[Any], phases: int) -> tuple[list, list, list]:
    """Spawns one process per task running ``target(task, queues, gos)`` (with ``phases == 1``:
    ``target(task, queue, go)``); returns ``(processes, queues, gos)``, one queue and one
    ``multiprocessing.Event`` per phase (a run of the workers that :func:`drive_workers` follows)."""
    ctx = multiprocessing.get_context("spawn")
    queues, gos = [ctx.Queue() for _ in range(phases)], [ctx.Event() for _ in range(phases)]
    args = (queues[0], gos[0]) if phases == 1 else (queues, gos)
    procs = [ctx.Process(target=target, args=(task, *args), daemon=True) for task in tasks]
    for p in procs:
        p.start()
    return procs, queues, gos


@dataclasses.dataclass
class WorkersSeen:
    """What the parent saw of one phase of the worker processes."""

    seconds: float  # from ``go`` (every worker ready) to the last ``done``
    steps: list[int]  # steps each worker reported
    losses: list[tuple[int, int, float]]  # (rank, step, minibatch loss) in arrival order
    done: dict[int, tuple]  # rank -> the rest of its ``("done", rank, ...)`` message
    paths: set[str]  # data paths the workers reported when ready


def drive_workers(procs: Sequence, messages, go, steps: int, progress: bool, description: str,
                  on_ready=lambda paths: None) -> WorkersSeen:
    """Follows one phase of the worker processes through ``messages``: waits for every
    ``("ready", rank, paths)``, calls ``on_ready(paths)``, sets ``go`` (the clock starts), counts
    ``("step", rank, step, loss, version)`` on a progress bar of ``len(procs) * steps`` until every
    worker sent ``("done", rank, ...)``.

    Raises:
      RuntimeError: a worker sent ``("error", rank, traceback)`` or exited without finishing.
    """
    workers = len(procs)
    seen = WorkersSeen(0.0, [0] * workers, [], {}, set())
    ready: set[int] = set()
    bar = _NoBar()
    start = time.perf_counter()
    try:
        while len(seen.done) < workers:
            try:
                kind, rank, *rest = messages.get(timeout=5.0)
            except queue_module.Empty:
                dead = [p for i, p in enumerate(procs) if i not in seen.done and not p.is_alive()]
                if dead:
                    raise RuntimeError(f"demo worker(s) exited without finishing (exit codes {[p.exitcode for p in dead]})")
                continue
            if kind == "ready":
                ready.add(rank)
                seen.paths.update(rest[0] or ())
                if len(ready) == workers:  # every worker has imported torch and attached: start the clock
                    on_ready(seen.paths)
                    bar = _progress_bar(workers * steps, progress, description)
                    start = time.perf_counter()
                    go.set()
            elif kind == "step":
                step, loss, version = rest
                seen.steps[rank] = step + 1
                seen.losses.append((rank, step, loss))
                bar.update(1)
                bar.set_postfix_str(f"version {version}, loss {loss:.3f}")
            elif kind == "done":
                seen.done[rank] = tuple(rest)
            else:
                raise RuntimeError(f"demo worker {rank} failed:\n{rest[0]}")
        seen.seconds = time.perf_counter() - start
    finally:
        bar.close()
    return seen


def stop_workers(procs: Sequence, finished: bool) -> None:
    """Joins the worker processes (up to 30 s each when they ``finished``), terminating any left."""
    for p in procs:
        p.join(timeout=30 if finished else 0)
        if p.is_alive():
            p.terminate()


def data_path_line(paths: set[str], cfg: DemoConfig) -> str:
    """What the demo says about its data plane once every worker attached (``paths``: the data
    paths the workers reported)."""
    if paths == {"shared_memory"}:
        return ("data plane: shared memory (each shard proved it shares this host with the workers); gRPC carries "
                "every step's message (--no-shared-memory: tensor bytes over gRPC)")
    if not cfg.shared_memory:
        return "data plane: gRPC (--no-shared-memory)"
    return f"data plane: {' + '.join(sorted(paths)) or 'grpc'} (shared memory could not be proven for every shard)"


class _NoBar:
    """The progress bar's interface, drawing nothing (``--no-progress``, and before ``go``)."""

    def update(self, n: int) -> None: ...

    def set_postfix_str(self, s: str) -> None: ...

    def close(self) -> None: ...


def _progress_bar(total: int, enabled: bool, description: str):
    """A tqdm bar of ``total`` steps when ``enabled``, else a :class:`_NoBar`."""
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=description, unit="step", dynamic_ncols=True)
