"""A crowd of clients that pause: how the server holds many clients, measured at half of what
this machine carries.

    .venv/bin/python -m bench.crowd                      # 1,032 clients (128 async sessions x 8 + a sync session of 8)
    .venv/bin/python -m bench.crowd --sessions 16 --duration-s 60
    .venv/bin/python -m bench.crowd --simple --clients 64 --steps 20   # the old crowd: own sessions, threads

It first measures the machine's **capacity**: ``--capacity-sessions`` async sessions of
``--workers`` clients stepping without pauses for ``--capacity-s``; steps per second, and the CPU
per step of the server (its process and shard actors), of Ray's daemons and of the clients.
Then it offers a crowd ``--load`` of that rate (0.5: half), first ``--compare-sessions`` sessions
(64 clients), then the full crowd: ``--sessions`` async sessions of ``--workers`` workers each
plus a sync session of ``--sync-workers`` (elastic, so a worker that ends leaves its rounds),
spread over ``--procs`` client processes, each client with its own ``Client`` and connections,
pausing uniformly so that together they offer the rate (sync workers pause 0-2x
``--sync-pause-s``: their step waits for their round). It prints each phase's step times
(p50 / p99 / max; a sync step also timed from its round's last push, the latest start among the
steps of its version, which leaves out the wait for the other workers), when its steps of 1 s or more began (by 10-s window: a stall is a few
windows, a load the machine cannot carry all of them from some point on), errors, clients still
in a step 90 s after the end, the shards' threads
(first, peak, last, and after 30 s idle) and memory, the CPU split between clients and server,
and the server's CPU per step at 1,032 clients against 64.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import multiprocessing
import os
import queue
import random
import statistics
import threading
import time
import uuid
from typing import Optional

import numpy as np

from bench._crowd_clients import (ADAM, GRACE_S, SHAPES, SLOW_S, ClientPlan, ProcessPlan, ProcessResult, after_last_push,
                                  run_process)
from bench._crowd_watch import Series, ServerWatch

IDLE_WAIT_S = 30.0  # after a phase, before the threads are counted again (a pool's idle threads end after 20 s)



def client_steps(address: str, steps: int, max_pause_s: float, seed: int) -> list[float]:
    """One client's step times (seconds): its own Client and session, pauses between steps."""
    from optserve.client import Client

    rng = random.Random(seed)
    params = {name: np.zeros(shape, np.float32) for name, shape in SHAPES.items()}
    grads = {name: np.ones(shape, np.float32) for name, shape in SHAPES.items()}
    times = []
    with Client(address, timeout=120) as client:
        session = client.create_session(f"crowd-{uuid.uuid4().hex[:8]}", params,
                                        optimizer={"name": "adam", "args": {"learning_rate": 0.01}})
        try:
            for _ in range(steps):
                time.sleep(rng.uniform(0.0, max_pause_s))
                start = time.perf_counter()
                session.push_pull(grads)
                times.append(time.perf_counter() - start)
        finally:
            session.close()
    return times


def _process_main(args: tuple, out) -> None:
    out.put(client_steps(*args))


def run(address: str, clients: int, steps: int, max_pause_s: float, processes: bool, seed: int = 0) -> list[float]:
    """Every client's step times, the clients as threads of this process or as processes."""
    times: list[float] = []
    if processes:
        queue = multiprocessing.get_context("spawn").Queue()
        workers = [multiprocessing.get_context("spawn").Process(
            target=_process_main, args=((address, steps, max_pause_s, seed + i), queue)) for i in range(clients)]
        for worker in workers:
            worker.start()
        for _ in workers:
            times.extend(queue.get())
        for worker in workers:
            worker.join()
        return times
    lock = threading.Lock()

    def one(i: int) -> None:
        result = client_steps(address, steps, max_pause_s, seed + i)
        with lock:
            times.extend(result)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return times


def summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"steps": len(ordered), "p50_s": statistics.median(ordered),
            "p99_s": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], "max_s": ordered[-1]}


@dataclasses.dataclass(frozen=True)
class Layout:
    """A crowd's shape: ``sessions`` async sessions of ``workers`` clients, and a sync session of
    ``sync_workers`` (0: none)."""

    sessions: int
    workers: int
    sync_workers: int = 0

    @property
    def clients(self) -> int:
        return self.sessions * self.workers + self.sync_workers

    def describe(self) -> str:
        sync = f" + a sync session of {self.sync_workers}" if self.sync_workers else ""
        return f"{self.clients} clients ({self.sessions} async sessions x {self.workers}{sync})"


@dataclasses.dataclass
class PhaseReport:
    """One phase's figures (see :func:`run_phase`)."""

    layout: Layout
    mean_pause_s: float
    wall_s: float
    async_times: list[float]
    sync_times: list[float]
    errors: dict[str, int]
    first_error: dict[str, str]
    unfinished: int
    idle_clients: int
    client_cpu_s: float
    server_cpu_s: float
    ray_cpu_s: float
    threads: Series
    rss_bytes: Series
    threads_after_idle: int = 0
    slow_starts: list[float] = dataclasses.field(default_factory=list)  # seconds from the go, steps >= SLOW_S
    sync_after_last_push: list[float] = dataclasses.field(default_factory=list)  # see after_last_push

    @property
    def steps(self) -> int:
        return len(self.async_times) + len(self.sync_times)

    def per_step_ms(self, seconds: float) -> float:
        return seconds / max(1, self.steps) * 1e3


def process_plans(address: str, layout: Layout, procs: int, mean_pause_s: float, sync_pause_s: float,
                  duration_s: float, tag: str, sync_session: Optional[str], seed: int,
                  stream_idle_s: Optional[float] = None) -> list[ProcessPlan]:
    """The layout spread over ``procs`` processes: each async session whole in one process (it
    creates it), round robin; the sync session's workers one per process, round robin."""
    creates: list[list[str]] = [[] for _ in range(procs)]
    clients: list[list[ClientPlan]] = [[] for _ in range(procs)]
    for index in range(layout.sessions):
        name = f"crowd-{tag}-{index}"
        creates[index % procs].append(name)
        clients[index % procs].extend(ClientPlan(name, f"w{w}") for w in range(layout.workers))
    for w in range(layout.sync_workers):
        clients[w % procs].append(ClientPlan(sync_session, f"s{w}", sync=True))
    return [ProcessPlan(address, tuple(creates[i]), tuple(clients[i]), mean_pause_s, sync_pause_s, duration_s,
                        seed * 1000 + i, stream_idle_s=stream_idle_s) for i in range(procs) if clients[i]]


def run_phase(address: str, watch: Optional[ServerWatch], layout: Layout, procs: int, mean_pause_s: float,
              sync_pause_s: float, duration_s: float, seed: int = 0, idle_wait_s: float = IDLE_WAIT_S,
              stream_idle_s: Optional[float] = None) -> PhaseReport:
    """Runs one crowd for ``duration_s`` from a common go, after every client attached."""
    from optserve.client import Client

    tag = uuid.uuid4().hex[:6]
    context = multiprocessing.get_context("spawn")
    with Client(address, timeout=120.0, shared_memory=False) as owner:
        sync = None
        if layout.sync_workers:  # elastic: a worker that ends leaves, and the last rounds close without it
            sync = owner.create_session(f"crowd-{tag}-sync", {n: np.zeros(s, np.float32) for n, s in SHAPES.items()},
                                        ADAM, num_workers=layout.sync_workers, min_workers=1)
        plans = process_plans(address, layout, procs, mean_pause_s, sync_pause_s, duration_s, tag,
                              sync.name if sync is not None else None, seed, stream_idle_s)
        ready, results, go, abort = context.Queue(), context.Queue(), context.Event(), context.Event()
        processes = [context.Process(target=run_process, args=(plan, ready, go, abort, results), daemon=True)
                     for plan in plans]
        watching = False
        try:
            for process in processes:
                process.start()
            failures = [m for m in _gather(ready, processes, 600.0) if m != "ready"]
            if failures:
                raise RuntimeError(f"crowd: {len(failures)} client process(es) could not set up: {failures[0]}")
            if watch is not None:
                watch.exclude = {p.pid for p in processes}
                watch.start()
                watching = True
            started = time.perf_counter()
            go.set()
            reports: list[ProcessResult] = _gather(results, processes, duration_s + GRACE_S + 120)
            wall_s = time.perf_counter() - started
        finally:
            usage = watch.stop() if watching else None
            abort.set()  # processes still waiting for the go leave, closing what they created
            deadline = time.monotonic() + 60
            for process in processes:
                if process.pid is not None:
                    process.join(timeout=max(0.1, deadline - time.monotonic()))
                    if process.is_alive():
                        process.kill()
            if sync is not None:
                sync.close()
    errors: dict[str, int] = {}
    first_error: dict[str, str] = {}
    for report in reports:
        for name, count in report.errors.items():
            errors[name] = errors.get(name, 0) + count
            first_error.setdefault(name, report.first_error[name])
    phase = PhaseReport(layout, mean_pause_s, wall_s, [t for r in reports for t in r.async_times],
                        [t for r in reports for t in r.sync_times], errors, first_error,
                        sum(r.unfinished for r in reports),
                        sum(r.idle_clients for r in reports),
                        sum(r.cpu_s for r in reports), usage.server_s if usage else float("nan"),
                        usage.ray_s if usage else float("nan"),
                        watch.threads if watch else Series(), watch.rss_bytes if watch else Series())
    phase.slow_starts = sorted(t for r in reports for t in r.slow_starts)
    phase.sync_after_last_push = after_last_push([m for r in reports for m in r.sync_marks])
    if watch is not None:
        time.sleep(idle_wait_s)
        phase.threads_after_idle = watch.sample()[0]
    return phase


def _gather(answers, processes: list, timeout_s: float) -> list:
    """One answer from each of ``processes`` off the ``answers`` queue, within ``timeout_s``.

    Raises:
      RuntimeError: a process ended with a failure (a crash, a kill) before all answered, or the
        time ran out.
    """
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < len(processes):
        try:
            got.append(answers.get(timeout=1.0))
            continue
        except queue.Empty:
            pass
        crashed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
        if crashed:
            raise RuntimeError(f"crowd: a client process ended with exit code {crashed[0]} before answering")
        if time.monotonic() > deadline:
            raise RuntimeError(f"crowd: {len(processes) - len(got)} client process(es) did not answer "
                               f"within {timeout_s:.0f} s")
    return got


def _ms(times: list[float], q: float) -> str:
    if not times:
        return "-"
    ordered = sorted(times)
    return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3:.0f}"


def _by_window(starts: list[float], window_s: float = 10.0) -> str:
    """``starts`` counted per ``window_s`` of the phase ("0-10 s: 3, ..."), empty windows left out."""
    counts = collections.Counter(int(start // window_s) for start in starts)
    return ", ".join(f"{k * window_s:.0f}-{(k + 1) * window_s:.0f} s: {n}" for k, n in sorted(counts.items()))


def print_phase(title: str, phase: PhaseReport) -> None:
    offered = phase.layout.clients / phase.mean_pause_s if phase.mean_pause_s else float("inf")
    print(f"crowd: {title}: {phase.layout.describe()}, pauses 0-{2 * phase.mean_pause_s:.1f} s "
          f"(offered {offered:.0f} steps/s), {phase.wall_s:.0f} s: {phase.steps} steps "
          f"({phase.steps / phase.wall_s:.1f}/s)")
    print(f"  async step ms: p50 {_ms(phase.async_times, 0.5)}, p99 {_ms(phase.async_times, 0.99)}, "
          f"max {_ms(phase.async_times, 1.0)}"
          + (f"; sync step ms: p50 {_ms(phase.sync_times, 0.5)}, p99 {_ms(phase.sync_times, 0.99)}, "
             f"max {_ms(phase.sync_times, 1.0)}" if phase.layout.sync_workers else ""))
    if phase.layout.sync_workers:
        after = phase.sync_after_last_push
        print(f"  sync step ms from its round's last push (without the wait for the round's workers): "
              f"p50 {_ms(after, 0.5)}, p99 {_ms(after, 0.99)}, max {_ms(after, 1.0)}")
    errors = ", ".join(f"{n} {c}" for n, c in sorted(phase.errors.items())) or "none"
    print(f"  errors: {errors}; clients still in a step {GRACE_S:.0f} s after the end: {phase.unfinished}; "
          f"clients without a step done: {phase.idle_clients}")
    for name, message in sorted(phase.first_error.items()):
        print(f"    first {name}: {message}")
    if phase.slow_starts:
        print(f"  steps of {SLOW_S:g} s or more, by when they began: {_by_window(phase.slow_starts)}")
    print(f"  CPU per step: server {phase.per_step_ms(phase.server_cpu_s):.1f} ms, ray daemons "
          f"{phase.per_step_ms(phase.ray_cpu_s):.1f} ms, clients {phase.per_step_ms(phase.client_cpu_s):.1f} ms")
    if phase.threads.readings:
        print(f"  shard threads: {phase.threads.first:.0f} at the start, peak {phase.threads.peak:.0f}, "
              f"{phase.threads.last:.0f} at the end, {phase.threads_after_idle} after {IDLE_WAIT_S:.0f} s idle; "
              f"shard RSS "
              f"{phase.rss_bytes.first / 2**20:.0f} -> peak {phase.rss_bytes.peak / 2**20:.0f} MiB")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=128, help="async sessions of the crowd")
    parser.add_argument("--workers", type=int, default=8, help="clients per async session")
    parser.add_argument("--sync-workers", type=int, default=8, help="workers of the sync session (0: none)")
    parser.add_argument("--procs", type=int, default=8, help="client processes")
    parser.add_argument("--duration-s", type=float, default=180.0, help="how long the crowd steps")
    parser.add_argument("--load", type=float, default=0.5, help="the crowd's offered rate, a fraction of capacity")
    parser.add_argument("--capacity-s", type=float, default=20.0)
    parser.add_argument("--capacity-sessions", type=int, default=4)
    parser.add_argument("--compare-sessions", type=int, default=8, help="the small crowd first (0: skip it)")
    parser.add_argument("--sync-pause-s", type=float, default=0.25)
    parser.add_argument("--simple", action="store_true", help="the old crowd: --clients own sessions, --steps each")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--max-pause-s", type=float, default=1.5)
    parser.add_argument("--processes", action="store_true", help="--simple: clients as processes (default: threads)")
    parser.add_argument("--stream-idle-s", type=float, default=None,
                        help="the clients' Client(stream_idle_s=...) (default: the SDK's)")
    parser.add_argument("--grpc-threads", type=int, default=None, help="the started server's threads per gRPC server")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig

    threads = {} if args.grpc_threads is None else {"grpc_threads": args.grpc_threads}
    server = start_server(ServerConfig(host="127.0.0.1", port=0, shards=2, ray_address="local", min_shard_bytes=0,
                                       **threads))
    try:
        if args.simple:
            return _simple(server.address, args)
        return _crowds(server.address, args)
    finally:
        server.stop()


def _simple(address: str, args) -> dict:
    started = time.perf_counter()
    result = summary(run(address, args.clients, args.steps, args.max_pause_s, args.processes))
    kind = "processes" if args.processes else "threads"
    print(f"crowd: {args.clients} clients ({kind}), {args.steps} steps each, pauses 0-{args.max_pause_s:g} s, "
          f"{time.perf_counter() - started:.0f} s: step p50 {result['p50_s'] * 1e3:.1f} ms, "
          f"p99 {result['p99_s'] * 1e3:.1f} ms, max {result['max_s'] * 1e3:.1f} ms ({result['steps']} steps)")
    return result


def _crowds(address: str, args) -> dict:
    watch = ServerWatch(os.getpid())
    saturated = Layout(args.capacity_sessions, args.workers)
    capacity = run_phase(address, watch, saturated, min(args.procs, args.capacity_sessions), 0.0, 0.0,
                         args.capacity_s, idle_wait_s=0.0)
    rate = capacity.steps / capacity.wall_s
    cpu_ms = capacity.per_step_ms(capacity.server_cpu_s + capacity.ray_cpu_s + capacity.client_cpu_s)
    print(f"crowd: capacity {rate:.0f} steps/s ({saturated.describe()} without pauses, {capacity.wall_s:.0f} s); "
          f"CPU per step {cpu_ms:.1f} ms: server {capacity.per_step_ms(capacity.server_cpu_s):.1f}, ray daemons "
          f"{capacity.per_step_ms(capacity.ray_cpu_s):.1f}, clients {capacity.per_step_ms(capacity.client_cpu_s):.1f}; "
          f"async step p50 {_ms(capacity.async_times, 0.5)} ms")
    offered = args.load * rate
    figures = {"capacity_steps_per_s": rate}
    phases = []
    if args.compare_sessions:
        small = Layout(args.compare_sessions, args.workers)
        phases.append(("small", small))
    phases.append(("crowd", Layout(args.sessions, args.workers, args.sync_workers)))
    reports = {}
    for name, layout in phases:
        report = run_phase(address, watch, layout, args.procs, layout.clients / offered, args.sync_pause_s,
                           args.duration_s, seed=len(reports) + 1, stream_idle_s=args.stream_idle_s)
        print_phase(f"{name} at {args.load:g} of capacity", report)
        reports[name] = report
        p99_s = float(np.percentile(report.async_times, 99)) if report.async_times else float("nan")
        figures[name] = {"steps": report.steps, "p99_s": p99_s, "max_s": max(report.async_times, default=float("nan")),
                         "server_ms_per_step": report.per_step_ms(report.server_cpu_s), "errors": report.errors,
                         "unfinished": report.unfinished}
        if report.sync_times:
            figures[name]["sync_p99_s"] = float(np.percentile(report.sync_times, 99))
            figures[name]["sync_after_last_push_p99_s"] = float(np.percentile(report.sync_after_last_push, 99))
    if "small" in reports:
        ratio = figures["crowd"]["server_ms_per_step"] / figures["small"]["server_ms_per_step"]
        print(f"crowd: server CPU per step, {reports['crowd'].layout.clients} clients vs "
              f"{reports['small'].layout.clients}: {ratio:.2f}x (target <= 1.2x)")
        figures["cpu_ratio"] = ratio
    return figures


if __name__ == "__main__":
    main()
