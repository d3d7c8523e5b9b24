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
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
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
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
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
