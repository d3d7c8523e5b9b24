"""Elastic sync sessions: how fast a round goes on without a lost worker, what one slow worker
costs the others, and what the membership bookkeeping costs a step.

    .venv/bin/python -m bench.elastic            # about 3 minutes on 2 cores
    .venv/bin/python -m bench.elastic --small    # fewer repetitions (a smoke run)

One real server in this process (coordinator here, 2 shard actors in a local Ray, as
tests/conftest.py starts it) and workers as their own processes (``python -m bench.elastic
--worker ...``, below). Every worker prints the version each push went into with the
``time.monotonic()`` at which its push returned; CLOCK_MONOTONIC is one clock for every process
of the machine, so a commit's time is the earliest of its participants' answers, and the time
from a signal sent here to the next commit needs no polling. Tensors are tiny (a 16 x 16 matrix
and a 16-vector, about 1 KB), the optimizer SGD: the figures are the protocol's, not compute's.

1. Failure: three workers (``num_workers=3, min_workers=2``), one of them the victim; a fresh
   session every repetition. The figure is the time from the victim's signal to the first round
   committed without it (the earliest answer of a survivor for it).

   - ``straggler_s=60`` (the deadline never cuts a round here), "between steps": the victim
     pushes five rounds, then "computes" for ever (its lease is renewed in the background), so
     the survivors wait in the next round; 0.3 s later it gets SIGKILL (``lease_s=5``: only its
     dropped connection ends the wait sooner; target <= 1 s) or SIGSTOP (``lease_s=L``: its lease
     lapses; target <= L + 0.5 s).
   - ``straggler_s=60``, "mid-push": the victim pushes without pause (so its push mostly waits in
     an open round for the survivors) and gets SIGKILL at a random point after twelve rounds.
   - adaptive straggler deadline (the default): every worker paces ``C`` s per step; after 12
     rounds the victim gets the signal at a random point of its step. A stopped worker is cut by
     the deadline (half the median round period) long before its lease lapses.

2. Throughput: four workers (``num_workers=4, min_workers=3``, adaptive deadline), each sleeping
   ``C`` s before every push ("equal"), or one of them ``3 C`` ("one 3x slower"); rounds per
   second over a window after 15 warm-up rounds, from a fast worker's answers. The two take turns
   (fresh session and processes each); the ratio is the median of per-repetition ratios
   (target >= 0.9).

3. Bookkeeping: one worker stepping a strict sync session (``num_workers=1``) and an elastic one
   (``num_workers=1, max_workers=2``: membership, lease, round records), one step of each in
   turn; the p50 of each and their ratio (target <= 1.02), on a 1-shard server started beside the
   2-shard one (a 1-shard step is the shortest, so the bookkeeping's share is the largest), and
   on the 2-shard server with the same ~1 KB tensors spread over both shards.

Nothing here asserts a time: the tables print the figures and each target beside them.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Optional

import numpy as np

from bench._timing import print_table

SGD = {"name": "sgd", "args": {"learning_rate": 0.01}}
SHAPES = {"w": (16, 16), "b": (16,)}
ROOT = Path(__file__).resolve().parent.parent
VICTIM = "victim"


def params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {n: (rng.standard_normal(s) * 0.1).astype(np.float32) for n, s in SHAPES.items()}


def grads(worker: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(sum(map(ord, worker)))
    return {n: (rng.standard_normal(s) * 1e-3).astype(np.float32) for n, s in SHAPES.items()}


# ----------------------------------------------------------------------------- worker process
def worker_main(address: str, session: str, worker_id: str, pace_s: float, hang_after: int) -> None:
    """Joins, then sleeps ``pace_s`` and pushes, for ever; prints ``acked V T`` / ``late V T`` per
    push (T: ``time.monotonic()`` at its answer). After ``hang_after`` pushes (> 0) it prints
    ``hang`` and sleeps for ever instead (a compute that never ends; its lease is still renewed)."""
    from optserve.client import Client

    with Client(address, timeout=120.0) as client:
        s = client.session(session, worker_id=worker_id)
        s.join()
        s.pull()
        mine = grads(worker_id)
        print("ready", flush=True)
        pushes = 0
        while True:
            if 0 < hang_after <= pushes:
                print("hang", flush=True)
                while True:
                    time.sleep(3600)
            time.sleep(pace_s)
            s.push_pull(mine)
            now = time.monotonic()
            step = s.last_step
            if step.dropped is None:
                print(f"acked {step.version} {now:.6f}", flush=True)
            else:
                print(f"late {step.current_version} {now:.6f}", flush=True)
            pushes += 1


class Worker:
    """``python -m bench.elastic --worker`` as a process; ``acks`` collects (version, monotonic time)."""

    def __init__(self, address: str, session: str, worker_id: str, pace_s: float, hang_after: int = 0):
        self.worker_id = worker_id
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.elastic", "--worker", address, session, worker_id, str(pace_s),
             str(hang_after)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.acks: list[tuple[int, float]] = []
        self.late = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            line = line.strip()
            self.lines.append(line)
            parts = line.split()
            if len(parts) == 3 and parts[0] == "acked":
                self.acks.append((int(parts[1]), float(parts[2])))
            elif len(parts) == 3 and parts[0] == "late":
                self.late += 1

    def signal(self, sig: int) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)  # a stopped process dies too
        self.process.wait(30)


def _kill_all(workers: list[Worker]) -> None:
    for worker in workers:
        with contextlib.suppress(Exception):  # teardown: the next one still goes
            worker.kill()


def _wait_for(predicate, timeout_s: float, what: str, workers: list[Worker]):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        for worker in workers:
            if worker.process.poll() is not None:
                raise RuntimeError(f"worker {worker.worker_id} exited ({worker.process.returncode}) while waiting "
                                   f"for {what}:\n" + "\n".join(worker.lines[-20:]))
        time.sleep(0.01)
    tails = "\n".join(f"[{w.worker_id}] " + " | ".join(w.lines[-5:]) for w in workers)
    raise RuntimeError(f"timed out after {timeout_s} s waiting for {what}\n{tails}")


def _commit_times(workers: list[Worker]) -> dict[int, float]:
    """version -> the earliest answer any of ``workers`` got for it (the commit, plus the reply)."""
    times: dict[int, float] = {}
    for worker in workers:
        for version, at in list(worker.acks):
            times[version] = min(at, times.get(version, at))
    return times


def _name(kind: str) -> str:
    return f"bench-elastic-{kind}-{uuid.uuid4().hex[:8]}"


# ----------------------------------------------------------------------------- 1. failures
def failure_rep(client, address: str, sig: int, *, lease_s: float, straggler_s: Optional[float], pace_s: float,
                victim_pace_s: float, hang: bool) -> tuple[float, str]:
    """One repetition; returns (seconds from the signal to the first round without the victim,
    why that round committed). ``hang``: the victim stops pushing after five pushes (the
    survivors then wait for it) and is signalled 0.3 s later; else it is signalled at a random
    point of its step after twelve rounds."""
    name = _name("fail")
    owner = client.create_session(name, params(), SGD, num_workers=3, min_workers=2, lease_s=lease_s,
                                  straggler_s=straggler_s)
    workers: list[Worker] = []
    try:
        survivors = [Worker(address, name, f"w{i}", pace_s) for i in range(2)]
        victim = Worker(address, name, VICTIM, victim_pace_s, hang_after=5 if hang else 0)
        workers = survivors + [victim]
        if hang:  # the survivors wait in the round after the victim's fifth push
            _wait_for(lambda: "hang" in victim.lines, 90, "the victim to hang", workers)
            time.sleep(0.3)
        else:
            _wait_for(lambda: len(victim.acks) >= 12, 90, "twelve rounds of the victim", workers)
            time.sleep(random.uniform(0.0, max(pace_s, victim_pace_s) + 0.01))
        signalled = time.monotonic()
        victim.signal(sig)
        limit = lease_s + 15.0
        _wait_for(lambda: sum(at > signalled for s in survivors for _, at in s.acks) >= 4, limit,
                  "rounds after the signal", survivors)
        commits = _commit_times(survivors)
        after = min(v for v, at in commits.items() if at > signalled)
        records = {r.version: r for r in owner.history(since=after - 1)}
        first = min(v for v, at in commits.items() if at > signalled and v in records
                    and VICTIM not in records[v].participants)
        return commits[first] - signalled, records[first].closed_by
    finally:
        _kill_all(workers)
        owner.close()


def failures(client, address: str, repeats: int, pace_s: float, lease_s: float) -> str:
    kill_lease = 5.0
    cases = [  # label, signal, lease_s, straggler_s (None: adaptive), victim's pace, hang, target (s)
        (f"SIGKILL between steps, straggler_s=60, lease_s={kill_lease:g}", signal.SIGKILL, kill_lease, 60.0, pace_s,
         True, 1.0),
        (f"SIGKILL mid-push (victim pace 0), straggler_s=60, lease_s={kill_lease:g}", signal.SIGKILL, kill_lease, 60.0,
         0.0, False, 1.0),
        (f"SIGSTOP between steps, straggler_s=60, lease_s={lease_s:g}", signal.SIGSTOP, lease_s, 60.0, pace_s, True,
         lease_s + 0.5),
        (f"SIGKILL, adaptive deadline, lease_s={kill_lease:g}", signal.SIGKILL, kill_lease, None, pace_s, False, 1.0),
        (f"SIGSTOP, adaptive deadline, lease_s={lease_s:g}", signal.SIGSTOP, lease_s, None, pace_s, False,
         lease_s + 0.5),
    ]
    samples = {case[0]: [] for case in cases}
    reasons = {case[0]: collections.Counter() for case in cases}
    for _ in range(repeats):  # the cases take turns
        for label, sig, lease, straggler, victim_pace, hang, _ in cases:
            seconds, closed_by = failure_rep(client, address, sig, lease_s=lease, straggler_s=straggler, pace_s=pace_s,
                                             victim_pace_s=victim_pace, hang=hang)
            samples[label].append(seconds)
            reasons[label][closed_by] += 1
    rows = []
    for label, *_, target in cases:
        xs = samples[label]
        worst, median = max(xs), statistics.median(xs)
        verdict = "met" if worst <= target else ("median met, max MISSED" if median <= target else "MISSED")
        rows.append([label, median * 1e3, min(xs) * 1e3, worst * 1e3, f"<= {target * 1e3:.0f}", verdict,
                     " ".join(f"{k} x{n}" for k, n in reasons[label].most_common())])
    title = (f"1. signal to the first round without the victim: 3 workers (num_workers=3, min_workers=2), "
             f"pace {pace_s * 1e3:.0f} ms, {repeats} repetitions each (fresh session, cases interleaved)")
    return print_table(title, ["case", "median ms", "min ms", "max ms", "target ms", "max vs target", "closed by"],
                       rows)


# ----------------------------------------------------------------------------- 2. a slow worker
def rate_rep(client, address: str, slow: bool, pace_s: float, window_s: float, warmup: int = 15) -> dict:
    name = _name("rate")
    owner = client.create_session(name, params(), SGD, num_workers=4, min_workers=3)
    workers: list[Worker] = []
    try:
        workers = [Worker(address, name, f"r{i}", pace_s * (3 if slow and i == 3 else 1)) for i in range(4)]
        fast = workers[0]
        _wait_for(lambda: fast.acks and fast.acks[-1][0] >= warmup, 90, f"{warmup} rounds", workers)
        start = time.monotonic()
        time.sleep(window_s)
        window = [(v, at) for v, at in list(fast.acks) if at >= start]
        (v0, t0), (v1, t1) = window[0], window[-1]
        records = owner.history(since=v0)
        records = [r for r in records if r.version <= v1]
        deadline = owner.status().elastic.straggler_s
        return {"rate": (v1 - v0) / (t1 - t0), "deadline": deadline,
                "duration": statistics.median(r.duration_s for r in records),
                "closed_by": collections.Counter(r.closed_by for r in records),
                "participants": statistics.mean(len(r.participants) for r in records),
                "with_slow": sum("r3" in r.participants for r in records) / len(records),
                "late": sum(len(r.late) for r in records) / len(records)}
    finally:
        _kill_all(workers)
        owner.close()


def slow_worker(client, address: str, repeats: int, pace_s: float, window_s: float) -> str:
    runs = {"equal": [], "slow": []}
    for _ in range(repeats):
        for key in ("equal", "slow"):
            runs[key].append(rate_rep(client, address, key == "slow", pace_s, window_s))
    ratios = [s["rate"] / e["rate"] for e, s in zip(runs["equal"], runs["slow"])]
    rows = []
    for key, label in (("equal", f"4 x {pace_s * 1e3:.0f} ms"),
                       ("slow", f"3 x {pace_s * 1e3:.0f} ms + 1 x {3 * pace_s * 1e3:.0f} ms")):
        xs = runs[key]
        closed = sum((x["closed_by"] for x in xs), collections.Counter())
        total = sum(closed.values())
        note = ""
        if key == "slow":
            note = f"{statistics.median(ratios):.3f} x equal (median per repetition) [{min(ratios):.2f}, {max(ratios):.2f}]"
        rows.append([label, statistics.median(x["rate"] for x in xs), 1.0 / pace_s,
                     statistics.median(x["duration"] for x in xs) * 1e3,
                     statistics.median(x["deadline"] for x in xs) * 1e3,
                     statistics.mean(x["participants"] for x in xs),
                     f"{statistics.mean(x['with_slow'] for x in xs):.0%}",
                     " ".join(f"{k} {n / total:.0%}" for k, n in closed.most_common()), note])
    title = (f"2. rounds/s with one slow worker: num_workers=4, min_workers=3, adaptive deadline, {window_s:g} s "
             f"windows after 15 rounds, {repeats} interleaved repetitions (target: slow >= 0.9 x equal)")
    return print_table(title, ["workers (sleep per step)", "rounds/s", "1/C", "round ms (p50, first push to commit)",
                               "adaptive deadline ms", "mean pushes/round",
                               "rounds with r3", "closed by", "ratio"], rows)


# ----------------------------------------------------------------------------- 3. bookkeeping
def bookkeeping(client, label: str, pairs: int) -> list:
    """One worker steps both sessions in turn, one step each (the order flips every pair), so the
    two see the same machine; returns the table row."""
    tiny = params()
    mine = grads("solo")
    names = {"strict": _name("strict"), "elastic": _name("elastic")}
    owners = {"strict": client.create_session(names["strict"], tiny, SGD, num_workers=1),
              "elastic": client.create_session(names["elastic"], tiny, SGD, num_workers=1, max_workers=2)}
    sessions = {k: client.session(n, worker_id="solo") for k, n in names.items()}
    samples = {k: [] for k in sessions}
    try:
        for session in sessions.values():
            for _ in range(100):
                session.push_pull(mine)
        for i in range(pairs):
            for key in (("strict", "elastic") if i % 2 == 0 else ("elastic", "strict")):
                session = sessions[key]
                started = time.perf_counter()
                session.push_pull(mine)
                samples[key].append(time.perf_counter() - started)
        elastic = sessions["elastic"].status().elastic
        assert elastic is not None and elastic.members == ("solo",) and sessions["strict"].status().elastic is None
    finally:
        for session in sessions.values():
            session.detach()
        for owner in owners.values():
            owner.close()
    p50 = {k: statistics.median(v) for k, v in samples.items()}
    p99 = {k: float(np.percentile(v, 99)) for k, v in samples.items()}
    ratio = p50["elastic"] / p50["strict"]
    paired = statistics.median(e / s for e, s in zip(samples["elastic"], samples["strict"]))
    halves = [statistics.median(samples["strict"][h::2]) for h in (0, 1)]  # strict against itself: the noise
    return [label, f"{p50['strict'] * 1e3:.3f} / {p99['strict'] * 1e3:.3f}",
            f"{p50['elastic'] * 1e3:.3f} / {p99['elastic'] * 1e3:.3f}", f"{ratio:.3f}", f"{paired:.3f}",
            f"{max(halves) / min(halves):.3f}", "met" if ratio <= 1.02 else "MISSED"]


# ----------------------------------------------------------------------------- main
def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="fewer repetitions")
    parser.add_argument("--pace", type=float, default=0.05, help="C: seconds each worker sleeps per step")
    parser.add_argument("--lease", type=float, default=1.0, help="L: lease_s of the SIGSTOP cases")
    parser.add_argument("--repeats", type=int, default=None, help="failure repetitions per case (default 5)")
    parser.add_argument("--window", type=float, default=None, help="seconds of each throughput window (default 4)")
    args = parser.parse_args(argv)
    repeats = args.repeats or (2 if args.small else 5)
    rate_repeats = 2 if args.small else 4
    window = args.window or (2.0 if args.small else 4.0)
    pairs = 500 if args.small else 3000

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from optserve.client import Client
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig

    ray.init(include_dashboard=False, num_cpus=4, log_to_driver=False, configure_logging=False)
    servers = []
    try:
        server = start_server(ServerConfig(host="127.0.0.1", port=0, shards=2, ray_address="local",
                                           min_shard_bytes=0))
        servers.append(server)
        one_shard = start_server(ServerConfig(host="127.0.0.1", port=0, shards=1, ray_address="local",
                                              min_shard_bytes=0))
        servers.append(one_shard)
        tables = []
        with Client(server.address, timeout=120.0) as client:
            tables.append(failures(client, server.address, repeats, args.pace, args.lease))
            tables.append(slow_worker(client, server.address, rate_repeats, args.pace, window))
            rows = []
            with Client(one_shard.address, timeout=120.0) as single:
                rows.append(bookkeeping(single, "1-shard server", pairs))
            rows.append(bookkeeping(client, "2-shard server (1 KB over 2 shards)", pairs))
        tables.append(print_table(
            f"3. tiny push_pull (~1 KB), one worker, strict sync (num_workers=1) vs elastic (num_workers=1, "
            f"max_workers=2); {pairs} steps of each, taking turns step by step, after 100 warm-up (target <= 1.02)",
            ["server", "strict p50 / p99 ms", "elastic p50 / p99 ms", "p50 ratio", "median paired ratio",
             "noise: strict p50, odd / even pairs", "target"], rows))
        return "\n\n".join(tables)
    finally:
        for running in reversed(servers):
            running.stop()
        ray.shutdown()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        address, session, worker_id, pace, hang_after = sys.argv[2:7]
        try:
            worker_main(address, session, worker_id, float(pace), int(hang_after))
        except KeyboardInterrupt:
            pass
    else:
        main()
