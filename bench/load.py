"""Load benchmark: many clients at once, each on its own session, then all on one shared session.

    .venv/bin/python -m bench.load                       # 64 clients x 100 steps, 2 shards
    .venv/bin/python -m bench.load --clients 16 --steps 20

A real server (coordinator in this process, shard actors in their own) and the clients as
threads of this process (one ``Client`` each). Two runs:

* ``own``: every client creates its own small session (the same structure and optimizer) and
  steps it; the first ``push_pull`` of each session is timed apart ("first step": with shared
  compiled updates it costs a dispatch, not a compile);
* ``shared``: one async session, every client attached to it, each pushing its own gradients.

Rows: steps, wall time, throughput, step latency p50 / p99 / max, first-step p50 / max, session
creation p50 / max (the first session of the structure compiles its update there). Then the peak
resident memory of each process (this one, each shard), and each shard's resident memory at
start, after a warm-up session of another structure (JAX's runtime started: the baseline), after a
warm-up round of the load's own structure (a few sessions opened, stepped, closed: its compiled
update is then cached, a second baseline) and after every session was closed (memory of closed
sessions should go back: the target is within 10% of the baseline; the one compiled update the
runs share stays, which the second baseline already holds).

``--processes 16,32,64`` runs the clients as processes instead (multiprocessing, spawn; each imports
NumPy and the client only), each with its own ``Client`` and its own session, so that no client
shares the coordinator's interpreter (its GIL):

    .venv/bin/python -m bench.load --processes 16,32,64 --steps 30              # durable and not
    .venv/bin/python -m bench.load --processes 64 --steps 30 --durable on --log-io buffered

One server without durability and one with it (``--checkpoint-dir``: a temporary folder, or under
``--dir``; ``--fsync`` / ``--log-io`` / ``--checkpoint-every-steps`` set its
:class:`~optserve.server.domain.durability.DurabilityConfig`, the server's defaults otherwise;
``--grpc-threads`` its ``ServerConfig.grpc_threads``), each warmed up as above, then for each
process count: every process creates its session, all wait at one barrier, then step ``--steps``
times at once (the first step timed apart, as ``own`` above). Table 1: steps, errors, wall,
throughput, step latency p50 / p99 / max (steps 2..N), p99 over every step, first step, session
creation, the client processes' peak RSS. Table 2, where the time goes, over the same window
(barrier to last result): how busy the machine was; CPU ms per step of the client processes, the
shard actors, this process (the coordinator), this process's other descendants (Ray's daemons)
and the rest of the machine (other programs, the kernel's own threads); the Little's-law bound
``processes x CPU per step / cores`` beside the measured mean latency (equal when the steps wait
for nothing but the CPU); and the server's own histograms (``/metrics``: ``optserve_push_seconds``,
``..._pull_seconds``, ``..._step_seconds`` of the run's sessions, merged; p99 interpolated within
buckets, as Prometheus' ``histogram_quantile``), which separate the shards' time from the clients'
and the queueing. Then, per run, the kernel's share of each group's CPU, the client processes'
and the shards' CPU by thread, and the busiest processes outside the groups. ``--perf-control
FIFO`` writes enable / disable around each stepping window for ``perf record -a -D -1 --control
fifo:FIFO``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import resource
import threading
import time

import numpy as np

from bench._timing import print_table

OPTIMIZER = {"name": "adafactor_hf", "args": {"lr": 1e-3, "relative_step": False, "scale_parameter": False}}
SHAPES = {"layer0/w": (64, 64), "layer0/b": (64,), "layer1/w": (64, 10), "layer1/b": (10,)}


def model(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: (rng.standard_normal(shape) * 0.1).astype(np.float32) for name, shape in SHAPES.items()}


def gradients(step: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed * 100_003 + step)
    return {name: (rng.standard_normal(shape) * 1e-2).astype(np.float32) for name, shape in SHAPES.items()}


class Run:
    """What one run measured: per-step latencies (s), first-step latencies (s), errors, wall time."""

    def __init__(self):
        self.latencies: list[float] = []
        self.first_steps: list[float] = []
        self.creates: list[float] = []
        self.errors: list[str] = []
        self.wall_s = 0.0
        self._lock = threading.Lock()

    def add(self, latencies: list[float], first: float | None = None, create: float | None = None) -> None:
        with self._lock:
            self.latencies += latencies
            if first is not None:
                self.first_steps.append(first)
            if create is not None:
                self.creates.append(create)

    def failed(self, error: BaseException) -> None:
        with self._lock:
            self.errors.append(f"{type(error).__name__}: {error}")

    def row(self, label: str) -> list:
        lat = np.array(self.latencies) * 1e3
        first = np.array(self.first_steps) * 1e3
        create = np.array(self.creates) * 1e3
        steps = len(self.latencies) + len(self.first_steps)
        return [label, steps, len(self.errors), round(self.wall_s, 1), round(steps / self.wall_s, 1),
                _pct(lat, 50), _pct(lat, 99), _pct(lat, 100), _pct(first, 50), _pct(first, 100),
                _pct(create, 50), _pct(create, 100)]


def _pct(values: np.ndarray, q: float) -> str:
    return f"{np.percentile(values, q):.0f}" if values.size else "-"


def run_own_sessions(address: str, clients: int, steps: int, prefix: str = "load-own", timeout: float = 300.0,
                     keep_results: bool = False) -> tuple[Run, dict[int, dict[str, np.ndarray]]]:
    """``clients`` threads, each creating session ``{prefix}-{i}`` and stepping it ``steps`` times
    (the first step timed apart), then closing it. Returns the run and, with ``keep_results``,
    each client's last parameters (client -> name -> array)."""
    from optserve.client import Client

    run, results = Run(), {}
    start = threading.Barrier(clients)

    def client_loop(index: int) -> None:
        try:
            with Client(address, timeout=timeout) as client:
                t0 = time.perf_counter()
                session = client.create_session(f"{prefix}-{index}", model(), optimizer=OPTIMIZER)
                create = time.perf_counter() - t0
                start.wait(timeout=timeout)
                t0 = time.perf_counter()
                params = session.push_pull(gradients(0, index))
                first = time.perf_counter() - t0
                latencies = []
                for step in range(1, steps):
                    t0 = time.perf_counter()
                    params = session.push_pull(gradients(step, index))
                    latencies.append(time.perf_counter() - t0)
                run.add(latencies, first, create)
                if keep_results:
                    results[index] = params
                session.close()
        except BaseException as exc:  # noqa: BLE001 - counted, reported
            run.failed(exc)

    _threads(client_loop, clients, run)
    return run, results


def run_shared_session(address: str, clients: int, steps: int, name: str = "load-shared",
                       timeout: float = 300.0) -> tuple[Run, int]:
    """``clients`` threads stepping one async session ``steps`` times each; returns the run and
    the session's ``steps_applied`` (read before it is closed)."""
    from optserve.client import Client

    run = Run()
    owner = Client(address, timeout=timeout)
    owner.create_session(name, model(), optimizer=OPTIMIZER, mode="async")
    start = threading.Barrier(clients)

    def client_loop(index: int) -> None:
        try:
            with Client(address, timeout=timeout) as client:
                session = client.session(name)
                start.wait(timeout=timeout)
                latencies = []
                for step in range(steps):
                    t0 = time.perf_counter()
                    session.push_pull(gradients(step, index))
                    latencies.append(time.perf_counter() - t0)
                run.add(latencies)
                session.detach()
        except BaseException as exc:  # noqa: BLE001
            run.failed(exc)

    try:
        _threads(client_loop, clients, run)
        applied = owner.session(name).status().steps_applied
    finally:
        owner.close_session(name)
        owner.close()
    return run, applied


def _threads(fn, count: int, run: Run) -> None:
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        list(pool.map(fn, range(count)))
    run.wall_s = time.perf_counter() - started


def _warm_up(address: str, shards: int) -> None:
    """Starts JAX's runtime on every shard with sessions of another structure (opened, stepped, closed)."""
    from optserve.client import Client

    with Client(address, timeout=300) as client:
        sessions = [client.create_session(f"load-warm-up-{i}", {"warm": np.zeros(3, np.float32)},
                                          optimizer={"name": "sgd", "args": {"learning_rate": 0.1}})
                    for i in range(shards)]
        for session in sessions:
            session.push_pull({"warm": np.ones(3, np.float32)})
            session.close()


def _warm_up_structure(address: str, sessions: int) -> None:
    """Opens, steps and closes ``sessions`` sessions of the load's own structure and optimizer."""
    from optserve.client import Client

    with Client(address, timeout=300) as client:  # all open at once, so they are placed on every shard
        opened = [client.create_session(f"load-warm-up-structure-{i}", model(i), optimizer=OPTIMIZER)
                  for i in range(sessions)]
        for i, session in enumerate(opened):
            session.push_pull({k: np.ones_like(v) for k, v in model(i).items()})
        for session in opened:
            session.close()


class ProcessRun(Run):
    """A :class:`Run` of client processes, with where the CPU went and the server's own histograms."""

    def __init__(self, processes: int):
        super().__init__()
        self.processes = processes
        self.all_steps: list[float] = []  # every step, the first ones included
        self.client_rss: list[int] = []
        # CPU s over the window: "clients", "shards", "coordinator", "ray daemons" (this process's other
        # descendants), "rest of machine" (other processes, the kernel), "machine busy" (all)
        self.cpu: dict[str, float] = {}
        self.cpu_system: dict[str, float] = {}  # the system (kernel) part of each group's
        self.shard_threads: list[tuple[str, float]] = []  # the shards' CPU s by thread name
        self.client_threads: dict[str, float] = {}  # the client processes' CPU s over their steps, by thread name
        self.machine_total_s = 0.0  # CPU seconds the machine had (all cores) over the window
        self.other_top: list[tuple[str, float]] = []  # the busiest other processes (name (pid), CPU s)
        self.label_pids = ""  # which pids are the coordinator and the shards
        self.server: dict[str, Histogram] = {}  # "push" / "pull" / "step" -> merged over the run's sessions

    def table_row(self, label: str) -> list:
        lat = np.array(self.latencies) * 1e3
        every = np.array(self.all_steps) * 1e3
        first = np.array(self.first_steps) * 1e3
        create = np.array(self.creates) * 1e3
        steps = len(self.all_steps)
        rss = np.array(self.client_rss) / (1 << 20)
        return [label, steps, len(self.errors), round(self.wall_s, 1), round(steps / self.wall_s, 1) if self.wall_s else 0,
                _pct(lat, 50), _pct(lat, 99), _pct(lat, 100), _pct(every, 99), _pct(first, 50), _pct(first, 100),
                _pct(create, 50), _pct(create, 100), f"{rss.mean():.0f}" if rss.size else "-"]

    def cpu_row(self, label: str) -> list:
        steps = max(1, len(self.all_steps))
        per_step = {k: v / steps * 1e3 for k, v in self.cpu.items()}
        cores = os.cpu_count() or 1
        busy = self.cpu.get("machine busy", 0.0) / self.machine_total_s if self.machine_total_s else 0.0
        mean = float(np.mean(self.all_steps)) * 1e3 if self.all_steps else 0.0
        bound = self.processes * per_step.get("machine busy", 0.0) / cores
        hist = [self.server[k] if k in self.server else Histogram() for k in ("push", "pull", "step")]
        return [label, f"{busy:.0%}", *(f"{per_step.get(k, 0.0):.1f}" for k in
                                       ("clients", "shards", "coordinator", "ray daemons", "rest of machine",
                                        "machine busy")),
                f"{bound:.0f}", f"{mean:.0f}",
                *(f"{h.mean() * 1e3:.1f}" for h in hist), f"{hist[0].quantile(0.99) * 1e3:.0f}",
                f"{hist[2].quantile(0.99) * 1e3:.1f}"]


class Histogram:
    """A Prometheus histogram's cumulative buckets (upper bound -> count), sum and count."""

    def __init__(self):
        self.buckets: dict[float, float] = {}
        self.sum = 0.0
        self.count = 0.0

    def mean(self) -> float:
        return self.sum / self.count if self.count else 0.0

    def quantile(self, q: float) -> float:
        """Interpolated within its bucket, as Prometheus' ``histogram_quantile``."""
        if not self.count:
            return 0.0
        rank, lower, below = q * self.count, 0.0, 0.0
        for upper in sorted(self.buckets):
            cumulative = self.buckets[upper]
            if cumulative >= rank:
                if upper == float("inf"):
                    return lower
                return lower + (upper - lower) * (rank - below) / max(cumulative - below, 1e-12)
            lower, below = upper, cumulative
        return lower


_SAMPLE = re.compile(r'^optserve_(push|pull|step)_seconds_(bucket|sum|count)\{([^}]*)\} (\S+)$')


def server_histograms(metrics_address: str, session_prefix: str) -> dict[str, Histogram]:
    """``optserve_{push,pull,step}_seconds`` of the sessions named ``{session_prefix}-*``, merged
    over those sessions and their shards (scraped from the coordinator's ``/metrics``)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=60).read().decode()
    out: dict[str, Histogram] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(3)))
        if not labels.get("session", "").startswith(session_prefix + "-"):
            continue
        hist = out.setdefault(match.group(1), Histogram())
        value = float(match.group(4))
        if match.group(2) == "bucket":
            le = float(labels["le"])
            hist.buckets[le] = hist.buckets.get(le, 0.0) + value
        elif match.group(2) == "sum":
            hist.sum += value
        else:
            hist.count += value
    return out


def thread_cpu_seconds(pid: int | str = "self") -> dict[str, float]:
    """CPU seconds (user + system) of a process's threads so far, summed by thread name (``comm``:
    gRPC's C threads name themselves, Python's threads carry the process's name; the main thread
    is "main"); ``{}`` if unreadable."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                text = f.read()
        except OSError:
            continue
        name = "main" if tid == str(pid if pid != "self" else os.getpid()) else text[text.index("(") + 1:text.rindex(")")]
        fields = text[text.rindex(")") + 2:].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _processes() -> dict[int, tuple[str, float, float]]:
    """pid -> (name, user CPU s, system CPU s) of every process on the machine that can be read."""
    import psutil

    out = {}
    for proc in psutil.process_iter(["name", "cpu_times"]):
        times = proc.info["cpu_times"]
        if times is not None:
            out[proc.pid] = (proc.info["name"] or "?", times.user, times.system)
    return out


def _descendants() -> set[int]:
    import psutil

    return {child.pid for child in psutil.Process().children(recursive=True)}


def _machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the machine so far, every core (``/proc/stat``)."""
    from bench._timing import CpuSample

    sample = CpuSample.now()
    return (sample.machine_busy_s, sample.machine_total_s) if sample is not None else (0.0, 0.0)


class _Snapshot:
    """CPU used so far: by every process (user, system), by the shards' threads, by the machine."""

    def __init__(self, shard_pids):
        self.processes = _processes()
        self.shard_threads = [thread_cpu_seconds(pid) for pid in shard_pids]
        self.machine = _machine_cpu()


def _account(run: ProcessRun, before: _Snapshot, after: _Snapshot, client_pids, shard_pids) -> None:
    """Fills ``run.cpu`` (CPU s by group over the window), its user / system split, the shards'
    threads and the busiest processes outside the groups."""
    used = {pid: (name, u1 - before.processes[pid][1], s1 - before.processes[pid][2])
            for pid, (name, u1, s1) in after.processes.items() if pid in before.processes}
    ours = _descendants()
    groups = {"clients": set(client_pids), "shards": set(shard_pids), "coordinator": {os.getpid()}}
    groups["ray daemons"] = ours - groups["clients"] - groups["shards"]
    for group, pids in groups.items():
        run.cpu[group] = sum(used[pid][1] + used[pid][2] for pid in pids if pid in used)
        run.cpu_system[group] = sum(used[pid][2] for pid in pids if pid in used)
    run.cpu["machine busy"] = after.machine[0] - before.machine[0]
    run.cpu["rest of machine"] = max(0.0, run.cpu["machine busy"] - sum(run.cpu[g] for g in groups))
    run.machine_total_s = after.machine[1] - before.machine[1]
    grouped = set().union(*groups.values())
    others = [(f"{name} ({pid})", u + s) for pid, (name, u, s) in used.items() if pid not in grouped and u + s > 0]
    run.other_top = sorted(others, key=lambda kv: -kv[1])[:6]
    threads: dict[str, float] = {}
    for t0, t1 in zip(before.shard_threads, after.shard_threads):
        for name, cpu in t1.items():
            threads[name] = threads.get(name, 0.0) + cpu - t0.get(name, 0.0)
    run.shard_threads = sorted(((n, c) for n, c in threads.items() if c > 0), key=lambda kv: -kv[1])


def run_processes(address: str, processes: int, steps: int, prefix: str, shard_pids=(),
                  metrics_address: str | None = None, timeout: float = 300.0,
                  perf_control: str | None = None) -> ProcessRun:
    """``processes`` client processes (spawned; :func:`bench._load_client.client_process`), each
    creating session ``{prefix}-{i}`` with its own ``Client``; once all have (a barrier), they step
    ``steps`` times at once. Measures the CPU every process used over the stepping window and, with
    ``metrics_address``, reads the server's histograms of the run's sessions before they close.
    ``perf_control``: a FIFO that ``perf record --control fifo:FIFO -D -1`` reads: "enable" is
    written to it when the steps start, "disable" when the last one is done (a profile of the
    stepping window only)."""
    import multiprocessing

    from bench._load_client import client_process

    ctx = multiprocessing.get_context("spawn")
    run = ProcessRun(processes)
    start, done = ctx.Barrier(processes + 1), ctx.Barrier(processes + 1)
    ready, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=client_process, args=(address, i, prefix, steps, timeout, ready, start, done, results),
                         daemon=True, name=f"{prefix}-{i}") for i in range(processes)]
    for proc in procs:
        proc.start()
    try:
        _gather(ready, procs, processes, timeout, "create its session")
        client_pids = [p.pid for p in procs]
        before = _Snapshot(shard_pids)
        _perf(perf_control, "enable")
        start.wait(timeout=timeout)
        started = time.perf_counter()
        outs = _gather(results, procs, processes, timeout + steps * 60, "step")
        run.wall_s = time.perf_counter() - started
        _perf(perf_control, "disable")
        after = _Snapshot(shard_pids)
        if metrics_address is not None:
            run.server = server_histograms(metrics_address, prefix)
        try:
            done.wait(timeout=timeout)
        except threading.BrokenBarrierError:
            pass
    finally:
        for proc in procs:
            proc.join(timeout=120)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                run.errors.append(f"process {proc.name} did not exit; terminated")
    for out in outs:
        if out.get("error"):
            run.errors.append(out["error"])
        if out.get("first") is not None:
            run.first_steps.append(out["first"])
            run.all_steps.append(out["first"])
        run.latencies += out.get("latencies", [])
        run.all_steps += out.get("latencies", [])
        if out.get("create") is not None:
            run.creates.append(out["create"])
        if out.get("peak_rss"):
            run.client_rss.append(out["peak_rss"])
        for name, cpu in out.get("threads", {}).items():
            run.client_threads[name] = run.client_threads.get(name, 0.0) + cpu
    _account(run, before, after, client_pids, shard_pids)
    return run


def _perf(fifo: str | None, command: str) -> None:
    if fifo is not None:
        with open(fifo, "w") as f:
            f.write(command + "\n")


def _gather(queue, procs, count: int, timeout: float, what: str) -> list[dict]:
    """``count`` items from ``queue``; fails early when a process died without sending one."""
    import queue as queue_module

    items, deadline = [], time.monotonic() + timeout
    while len(items) < count:
        try:
            items.append(queue.get(timeout=1.0))
        except queue_module.Empty:
            sent = {item["index"] for item in items}
            dead = [p.name for i, p in enumerate(procs) if i not in sent and p.exitcode is not None]
            if dead:
                raise RuntimeError(f"client process(es) {dead[:3]} exited before they could {what}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count - len(items)} client process(es) did not {what} in {timeout:.0f} s")
    return items


def main_processes(args) -> str:
    """``--processes``: the client-process runs, durable and not (see the module's docstring)."""
    import shutil
    import tempfile

    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig
    from optserve.server.domain.durability import DurabilityConfig, FsyncPolicy, LogIO

    counts = [int(c) for c in args.processes.split(",") if c.strip()]
    modes = {"both": [False, True], "on": [True], "off": [False]}[args.durable]
    root = tempfile.mkdtemp(prefix="optserve-bench-load-", dir=args.dir)
    durability_kwargs = {}
    if args.fsync is not None:
        durability_kwargs["fsync"] = FsyncPolicy(args.fsync)
    if args.log_io is not None:
        durability_kwargs["log_io"] = LogIO(args.log_io)
    if args.checkpoint_every_steps is not None:
        durability_kwargs["every_steps"] = args.checkpoint_every_steps
    runs: list[tuple[str, ProcessRun]] = []
    try:
        for durable in modes:
            durability = DurabilityConfig(os.path.join(root, "checkpoints"), **durability_kwargs) if durable else None
            extra = {"grpc_threads": args.grpc_threads} if args.grpc_threads is not None else {}
            server = start_server(ServerConfig(host="127.0.0.1", port=0, shards=args.shards, ray_address="local",
                                               metrics_port=0, durability=durability, **extra))
            try:
                _warm_up(server.address, args.shards)
                _warm_up_structure(server.address, 4)
                for count in counts:
                    label = f"{count} processes, {'durable' if durable else 'not durable'}"
                    prefix = f"load-proc-{'d' if durable else 'n'}{count}"
                    run = run_processes(server.address, count, args.steps, prefix, server.fleet.pids(),
                                        server.metrics_address, perf_control=args.perf_control)
                    run.label_pids = f"coordinator (this process) {os.getpid()}, shards {server.fleet.pids()}"
                    runs.append((label, run))
                    print(f"{label}: {len(run.all_steps)} steps, p50 {_pct(np.array(run.latencies) * 1e3, 50)} ms, "
                          f"p99 {_pct(np.array(run.latencies) * 1e3, 99)} ms, {len(run.errors)} errors, "
                          f"wall {run.wall_s:.1f} s", flush=True)
                    for error in run.errors[:3]:
                        print(f"  error: {error}", flush=True)
            finally:
                server.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    durable_note = ""
    if True in modes:
        d = DurabilityConfig("-", **durability_kwargs)
        durable_note = (f"; durable: fsync {d.fsync.value}, log writes {d.log_io.value}, "
                        f"checkpoint every {d.every_steps} steps / {d.every_s:g} s")
    threads = args.grpc_threads if args.grpc_threads is not None else ServerConfig.grpc_threads
    title = (f"bench.load --processes: client processes x {args.steps} steps, one session each, {args.shards} shards "
             f"({threads} gRPC threads each), "
             f"{os.cpu_count()} cores, small model ({sum(int(np.prod(s)) for s in SHAPES.values())} params), "
             f"{OPTIMIZER['name']}{durable_note}")
    text = print_table(title, ["run", "steps", "errors", "wall s", "steps/s", "p50 ms", "p99 ms", "max ms",
                               "p99 all ms", "first p50 ms", "first max ms", "create p50 ms", "create max ms",
                               "client RSS MiB"], [run.table_row(label) for label, run in runs])
    text += "\n" + print_table(
        "where the time goes (stepping window; CPU ms per step; bound = processes x CPU per step / cores; "
        "server: optserve_*_seconds of the run's sessions, mean ms, p99 ms)",
        ["run", "machine busy", "clients", "shards", "coordinator", "ray daemons", "rest of machine", "total",
         "bound ms", "mean step ms",
         "server push", "server pull", "server update", "server push p99", "server update p99"],
        [run.cpu_row(label) for label, run in runs])
    for label, run in runs:
        steps = max(1, len(run.all_steps))

        def ms(pairs, steps=steps):
            return ", ".join(f"{name} {cpu / steps * 1e3:.2f}" for name, cpu in pairs) or "-"

        system = ", ".join(f"{g} {100 * run.cpu_system[g] / run.cpu[g]:.0f}%" for g in run.cpu_system if run.cpu[g])
        lines = [f"{label} ({run.label_pids}), CPU ms per step:",
                 f"  kernel (system) share: {system}",
                 f"  client processes by thread: {ms(sorted(run.client_threads.items(), key=lambda kv: -kv[1]))}",
                 f"  shards by thread: {ms(run.shard_threads[:6])}",
                 f"  busiest processes outside the groups: {ms(run.other_top)}"]
        print("\n".join(lines))
        text += "\n" + "\n".join(lines)
    return text


def peak_rss_bytes(pid: int | None = None) -> int:
    """A process's peak resident memory (``VmHWM``), 0 if unreadable."""
    try:
        with open(f"/proc/{pid or 'self'}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 if pid is None else 0


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--processes", default=None,
                        help="comma-separated client process counts (e.g. 16,32,64): run the clients as processes, "
                             "one session each, durable and not (instead of the thread runs)")
    parser.add_argument("--durable", choices=["both", "on", "off"], default="both",
                        help="--processes: which servers to run (default: one without durability, one with it)")
    parser.add_argument("--dir", default=None, help="--processes: folder for the durable server's checkpoint "
                                                    "folder (default: a temporary folder)")
    parser.add_argument("--fsync", choices=["step", "every-n", "checkpoint"], default=None,
                        help="--processes: the durable server's fsync policy (default: the server's)")
    parser.add_argument("--log-io", choices=["auto", "buffered", "direct"], default=None,
                        help="--processes: the durable server's step-log writes (default: the server's)")
    parser.add_argument("--checkpoint-every-steps", type=int, default=None,
                        help="--processes: the durable server's checkpoint interval (default: the server's)")
    parser.add_argument("--grpc-threads", type=int, default=None,
                        help="--processes: ServerConfig.grpc_threads (default: the server's, 256; a shard keeps at most "
                             "half of them as open PushPull calls, more end after each step and are reopened)")
    parser.add_argument("--perf-control", default=None, metavar="FIFO",
                        help="--processes: write enable / disable to this FIFO around each stepping window (for "
                             "perf record -a -D -1 --control fifo:FIFO)")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if args.processes:
        return main_processes(args)
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig
    from optserve.server.ops.metrics import resident_bytes

    server = start_server(ServerConfig(host="127.0.0.1", port=0, shards=args.shards))
    try:
        pids = server.fleet.pids()
        at_start = [resident_bytes(pid) for pid in pids]
        _warm_up(server.address, args.shards)
        before = [resident_bytes(pid) for pid in pids]
        _warm_up_structure(server.address, 4)
        warm = [resident_bytes(pid) for pid in pids]
        own, _ = run_own_sessions(server.address, args.clients, args.steps)
        shared, applied = run_shared_session(server.address, args.clients, args.steps)
        time.sleep(1.0)
        after = [resident_bytes(pid) for pid in pids]
        title = f"bench.load: {args.clients} clients x {args.steps} steps, {args.shards} shards, small model " \
                f"({sum(int(np.prod(s)) for s in SHAPES.values())} params), {OPTIMIZER['name']}"
        text = print_table(title, ["run", "steps", "errors", "wall s", "steps/s", "p50 ms", "p99 ms", "max ms",
                                   "first p50 ms", "first max ms", "create p50 ms", "create max ms"],
                           [own.row("own sessions"), shared.row(f"one shared async ({applied} applied)")])
        mib = 1 << 20
        rows = [["this process (clients + coordinator)", round(peak_rss_bytes() / mib), "-", "-", "-", "-", "-", "-"]]
        rows += [[f"shard {i} (pid {pid})", round(peak_rss_bytes(pid) / mib), round(s / mib), round(b / mib),
                  round(w / mib), round(a / mib), f"{100 * (a - b) / b:+.0f}%", f"{100 * (a - w) / w:+.0f}%"]
                 for i, (pid, s, b, w, a) in enumerate(zip(pids, at_start, before, warm, after))]
        text += "\n" + print_table("memory (MiB)", ["process", "peak RSS", "RSS at start", "RSS after warm-up",
                                                    "after same-structure warm-up", "RSS after closing all",
                                                    "vs warm-up", "vs same-structure warm-up"], rows)
        for label, run in (("own", own), ("shared", shared)):
            for error in run.errors[:3]:
                print(f"{label} error: {error}")
        return text
    finally:
        server.stop()


if __name__ == "__main__":
    main()
