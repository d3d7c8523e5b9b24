"""DiLoCo's outer step on the server against a plain synchronous step, at ~100M parameters.

    .venv/bin/python -m bench.diloco             # 6 x 4096 x 4096 float32 (100.7M), 2 workers, 2 shards
    .venv/bin/python -m bench.diloco --small     # 4 x 512 x 512, a quick smoke run

One embedded server holds three sync sessions of ``--workers`` workers over the same parameters:

- ``sync adam``: plain per-step synchronous data parallelism, every worker pushes a gradient and
  the session runs adam (what DiLoCo replaces);
- ``sync sgd-nesterov``: the same with DiLoCo's default outer optimizer as a plain session;
- ``diloco outer``: the workers run :class:`optserve.client._diloco.DiLoCoCore` (the SDK's outer
  loop, H = 1) and each round push their pseudo-gradient (snapshot - current) and load the
  shared result, exactly as ``DiLoCo.step()`` does every H-th call (the simulated inner steps
  that move ``current`` are not timed; the worker's own work, the pseudo-gradient and the new
  snapshot, is in the round's wall time).

Each round, every variant takes one step with all workers (one thread each), the variants taking
turns (the machine's speed drifts). Per variant: the round's wall time, and the server's time read
from its own Prometheus histograms (``optserve_step_seconds``: the applied update, the outer step
itself; ``optserve_push_seconds``: receive, stage, vote, update, summed over the shards' pushes,
so it includes a sync round's wait for its last worker, which grows with the workers' skew).
Ratios are medians of per-round ratios against ``sync adam``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import threading
import time
import urllib.request
from typing import Callable

import numpy as np

from bench._timing import print_table
from bench.service import _model

ADAM = {"name": "adam", "args": {"learning_rate": 1e-3}}
NESTEROV = {"name": "sgd", "args": {"learning_rate": 0.7, "momentum": 0.9, "nesterov": True}}


class ServerClock:
    """Sums of a session's server-side histograms, scraped from the metrics endpoint."""

    _SUM = re.compile(r'^(optserve_(?:push|step)_seconds)_sum\{([^}]*)\} (\S+)$')

    def __init__(self, metrics_address: str):
        self._url = f"http://{metrics_address}/metrics"

    def totals(self) -> dict[tuple[str, str], float]:
        """(metric, session) -> seconds summed over the session's shards so far."""
        text = urllib.request.urlopen(self._url, timeout=30).read().decode()
        out: dict[tuple[str, str], float] = {}
        for line in text.splitlines():
            match = self._SUM.match(line)
            if match:
                labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
                key = (match.group(1), labels.get("session", ""))
                out[key] = out.get(key, 0.0) + float(match.group(3))
        return out


def _all_workers(steps: list[Callable[[], object]]) -> None:
    """Runs one step of every worker, each in its own thread; raises the first failure."""
    errors: list[BaseException] = []

    def run(step):
        try:
            step()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in steps]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


Variant = tuple[list, Callable[[], None], Callable[[], None]]  # (sessions, prepare (untimed), step)


def _plain_sync(client, name: str, params, grads, workers: int, optimizer) -> Variant:
    sessions = [client.create_session(name, params, optimizer=optimizer, mode="sync", num_workers=workers,
                                      worker_id="w0")]
    sessions += [client.session(name, worker_id=f"w{i}") for i in range(1, workers)]
    outs = [{k: np.empty_like(v) for k, v in params.items()} for _ in sessions]
    steps = [lambda s=s, o=o: s.push_pull(grads, out=o) for s, o in zip(sessions, outs)]
    return sessions, lambda: None, lambda: _all_workers(steps)


def _diloco(client, name: str, params, grads, workers: int) -> Variant:
    from optserve.client._diloco import DiLoCoCore

    cores = [DiLoCoCore(client, name, params, sync_every=1, outer=NESTEROV, worker_id=f"w{i}", mode="sync",
                        num_workers=workers) for i in range(workers)]

    currents: list[dict] = [{} for _ in cores]

    def inner_steps():  # untimed: the round's local progress moved every tensor by one gradient
        for core, current in zip(cores, currents):
            current.update({k: v - grads[k] for k, v in core.shared().items()})

    def exchange(core, current):
        core.after_inner_step(1, lambda names: {n: current[n] for n in names})

    steps = [lambda c=c, cur=cur: exchange(c, cur) for c, cur in zip(cores, currents)]
    return [c.sessions[0] for c in cores], inner_steps, lambda: _all_workers(steps)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="4 x 512 x 512 instead of 6 x 4096 x 4096")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from optserve.client import Client
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig

    matrices, dim = (4, 512) if args.small else (6, 4096)
    params = _model(matrices, dim)
    grads = {k: np.random.default_rng(1).standard_normal(v.shape, dtype=np.float32) * 1e-3 for k, v in params.items()}
    server = start_server(ServerConfig(host="127.0.0.1", port=0, shards=args.shards, ray_address="local",
                                       metrics_port=0))
    try:
        clock = ServerClock(server.metrics_address)
        with Client(server.address, timeout=600.0, shared_memory="auto") as client:
            variants = {"sync adam": _plain_sync(client, "bench-sync-adam", params, grads, args.workers, ADAM),
                        "sync sgd-nesterov": _plain_sync(client, "bench-sync-sgd", params, grads, args.workers,
                                                         NESTEROV),
                        "diloco outer": _diloco(client, "bench-diloco", params, grads, args.workers)}
            names = {"sync adam": "bench-sync-adam", "sync sgd-nesterov": "bench-sync-sgd",
                     "diloco outer": "bench-diloco"}
            for _, prepare, step in variants.values():  # warm-up: compile every kernel
                prepare()
                step()
            wall = {v: [] for v in variants}
            server_push = {v: [] for v in variants}
            server_step = {v: [] for v in variants}
            for _ in range(args.rounds):
                for variant, (_, prepare, step) in variants.items():
                    prepare()
                    before = clock.totals()
                    start = time.perf_counter()
                    step()
                    wall[variant].append(time.perf_counter() - start)
                    after = clock.totals()
                    session = names[variant]
                    server_push[variant].append(after[("optserve_push_seconds", session)]
                                                - before.get(("optserve_push_seconds", session), 0.0))
                    server_step[variant].append(after[("optserve_step_seconds", session)]
                                                - before.get(("optserve_step_seconds", session), 0.0))
            for sessions, _, _ in variants.values():
                sessions[0].close()  # closes the session for every worker
    finally:
        server.stop()

    base, same_kernel = "sync adam", "sync sgd-nesterov"
    rows = []
    for variant in variants:
        row = [variant]
        note = ""
        if variant == "diloco outer":
            note = "vs " + same_kernel + ": " + ", ".join(
                f"{what} {statistics.median(a / b for a, b in zip(samples[variant], samples[same_kernel])):.3f}x"
                for what, samples in (("wall", wall), ("push", server_push), ("update", server_step)))
        for samples in (wall, server_push, server_step):
            mine = statistics.median(samples[variant])
            if variant == base:
                row.append(f"{mine * 1e3:.0f}")
            else:
                ratio = statistics.median(a / b for a, b in zip(samples[variant], samples[base]))
                row.append(f"{mine * 1e3:.0f} ({ratio:.3f}x)")
        rows.append(row + [note])
    n = sum(v.size for v in params.values())
    print_table(f"DiLoCo outer step vs plain sync step: {n / 1e6:.1f}M f32 params, {args.workers} workers, "
                f"{args.shards} shards, shared memory; median of {args.rounds} interleaved rounds after 1 warm-up "
                f"(ratios: median per-round ratio vs {base})",
                ["variant", "round wall ms", "server push ms (sum over shards)", "server update ms", "note"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
