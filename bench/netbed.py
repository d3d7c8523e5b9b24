"""Separate hosts on one Linux machine: a test bed for optserve across machines, and its bench.

    .venv/bin/python -m bench.netbed --runs 3     # host lost, partition healed, cut off until replaced: next step

The hosts themselves (:class:`~bench.netns.NetBed`, :func:`~bench.netns.unavailable_reason`) are
made by :mod:`bench.netns`. :func:`start_cluster` runs docs/operating.md's "More than one machine"
commands as written: Ray head and ``optserve serve`` on h1, Ray nodes on h2 and h3 (the shards;
the head offers Ray no CPU), clients on h4 (:class:`Workload`: a training client whose every call
the chaos checker, bench/checker.py, reads). Closing the bed kills every process of every host and
deletes its namespaces (with their links and bridge) and its folder, also after a failure
(``OSNB_KEEP=1`` keeps the folder, logs included); a new bed first sweeps what a bed whose owner
died left behind (namespaces named ``osnb-*``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import statistics
import subprocess
import sys
import time
from typing import Optional

from bench.netns import REPO, Host, NetBed, Proc, pids_in_netns, unavailable_reason
from bench.process_session import kill_until_gone
from bench.ray_cluster import RAY, ray_env

RAY_PORT = 6379
SERVE_PORT = 50051
SHAPES = {"w": (16, 12), "b": (12,), "v": (40,), "u": (8, 4)}
ADAM = {"name": "adam", "args": {"learning_rate": 0.01}}


@dataclasses.dataclass
class Cluster:
    """The README's deployment on a bed: ``address`` is the server's control address."""

    bed: NetBed
    address: str
    server: Proc
    checkpoint_dir: str
    node_argv: list  # the docs' ``ray start`` of a node (their placeholders: see :func:`placed`)

    def rejoin(self, name: str) -> None:
        """Host ``name`` (its link up) comes back as an operator brings back a machine Ray declared
        dead: what is left of its processes is killed, its Ray node started again."""
        host = self.bed.hosts[name]
        kill_until_gone(lambda: [p for p in pids_in_netns(host.ns) if p != host.holder.pid], 10.0)
        start_node(host, placed(self.node_argv, self.bed.hosts["h1"], host, self.checkpoint_dir),
                   f"ray-{name}-{time.monotonic_ns()}")


DOCS = os.path.join(REPO, "docs", "operating.md")
DOCS_HEAD, DOCS_NODE, DOCS_SHARED = "10.0.0.1", "10.0.0.2", "/mnt/shared/optserve"  # the docs' placeholders


def docs_commands(path: str = DOCS) -> list[tuple[dict, list[str]]]:
    """The commands of the ``bash`` block in the "More than one machine" part of docs/operating.md,
    as ``(environment assignments, argv)``, in order: the head's ``ray start``, another node's, the
    server."""
    import shlex

    with open(path) as f:
        text = f.read()
    part = text[text.index("**More than one machine**"):]
    block = part[part.index("```bash") + len("```bash"):part.index("```", part.index("```bash") + 7)]
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        env = {}
        while words and "=" in words[0] and not words[0].startswith("-"):
            name, value = words.pop(0).split("=", 1)
            env[name] = value
        if words:
            commands.append((env, words))
    return commands


def start_cluster(bed: NetBed, shards: int = 2, replicas: int = 1, durable: bool = False) -> Cluster:
    """docs/operating.md's "More than one machine" run as written (:func:`docs_commands`: its
    addresses replaced by the hosts', its shared folder by one in the bed's folder, which every
    host sees): the Ray head and ``optserve serve`` on h1, a Ray node on h2 and one on h3. The bed
    adds only what its own bookkeeping needs (``--block``, a ``--temp-dir`` per host, a small
    object store) and ``--shards``, ``--min-shard-bytes 0`` (small sessions spread too). With
    ``replicas=2`` the server keeps its sessions in memory twice (``--replicas 2``: each shard's
    standby on another node), instead of on disk (no ``--checkpoint-dir``) or, ``durable``, as
    well. Returns once the server listens."""
    (head_env, head_argv), (_, node_argv), (_, serve_argv) = docs_commands()
    h1 = bed.hosts["h1"]
    checkpoints = os.path.join(bed.folder, "checkpoints")
    head = h1.spawn("ray-head", [*RAY, *placed(head_argv, h1, h1, checkpoints)[1:], "--include-dashboard=false",
                                 f"--temp-dir={h1.folder}/ray", *BOOKKEEPING], dict(ray_env(), **head_env))
    head.wait_for("Ray runtime started")
    for name in ("h2", "h3"):
        start_node(bed.hosts[name], placed(node_argv, h1, bed.hosts[name], checkpoints), f"ray-{name}")
    serve = placed(serve_argv, h1, h1, checkpoints)
    serve[serve.index("--shards") + 1] = str(shards)
    if replicas != 1:
        at = serve.index("--checkpoint-dir")
        serve[at:at + 2] = ["--replicas", str(replicas)] + (serve[at:at + 2] if durable else [])
    server = h1.spawn("optserve", [sys.executable, "-m", "optserve.server.cli", *serve[1:], "--min-shard-bytes", "0"])
    address = server.wait_for("optserve listening on ").split()[-1]
    return Cluster(bed, address, server, checkpoints, node_argv)


def placed(argv: list[str], head: Host, host: Host, checkpoints: str) -> list[str]:
    """A docs command run on ``host``: the docs' head address replaced by ``head``'s, their node
    address by ``host``'s, their shared folder by ``checkpoints``."""
    swap = {DOCS_HEAD: head.address, DOCS_NODE: host.address, DOCS_SHARED: checkpoints}
    return [swap.get(word, word.replace(DOCS_HEAD + ":", head.address + ":")) for word in argv]


BOOKKEEPING = ["--block", "--object-store-memory=100000000", "--disable-usage-stats"]


def start_node(host: Host, node_argv: list[str], name: str) -> Proc:
    """A Ray node on ``host`` (``node_argv``: the docs' ``ray start --address ...`` with this
    host's addresses in place), one CPU for its shards."""
    node = host.spawn(name, [*RAY, *node_argv[1:], "--num-cpus=1", f"--temp-dir={host.folder}/ray", *BOOKKEEPING])
    node.wait_for("Ray runtime started")
    return node


# ----------------------------------------------------------------------------- a workload on h4

class Workload:
    """A sync session (one worker, adam) trained from a host (``h4``): its driver
    (``python -m bench.netbed --drive``) creates the session, runs ``bench._nemesis_worker`` (every
    call logged for the checker) and follows the session's history until :meth:`stop`, then pulls
    the final parameters; :meth:`stop` returns the checker's verdict on the run."""

    def __init__(self, cluster: Cluster, host: str = "h4", name: str = "netbed", timeout_s: float = 30.0,
                 shared_memory: bool = False):
        self.folder = os.path.join(cluster.bed.hosts[host].folder, name)
        os.mkdir(self.folder)
        self.name, self.timeout_s = name, timeout_s
        self.faults: list = []  # bench.checker.FaultRecord of each fault injected meanwhile
        self.driver = cluster.bed.hosts[host].spawn(f"drive-{name}", [
            sys.executable, "-m", "bench.netbed", "--drive", cluster.address, name, self.folder, str(timeout_s),
            *(["--shm"] if shared_memory else [])])
        self.driver.wait_for("training", timeout_s=120)

    def acknowledged(self) -> list:
        """The worker's acknowledged pushes so far (``bench.checker.CallRecord``), in order."""
        from bench._nemesis_workers import load_calls

        calls = load_calls([os.path.join(self.folder, "calls.jsonl")])
        return sorted((c for c in calls if c.kind == "push" and c.outcome == "ok"), key=lambda c: c.ended)

    def wait_steps(self, count: int, after: float = 0.0, timeout_s: float = 60.0) -> float:
        """Waits for ``count`` acknowledged pushes that ended after unix time ``after``; returns the
        first one's end time. RuntimeError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            acked = [c.ended for c in self.acknowledged() if c.ended >= after]
            if len(acked) >= count:
                return acked[0]
            if self.driver.process.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"{count} steps after {after:.1f} not acknowledged in {timeout_s:.0f} s:\n"
                           f"{self.driver.output()[-3000:]}")

    def data_paths(self) -> dict:
        """The worker's data path per shard index at its end (after :meth:`stop`)."""
        import json

        line = self.driver.wait_for("data paths", timeout_s=1)
        return {int(k): v for k, v in json.loads(line.split("data paths", 1)[1]).items()}

    def stop(self, timeout_s: float = 120.0):
        """Stops training; returns the checker's report (``bench.checker.CheckReport``)."""
        from bench._nemesis_workers import load_calls
        from bench.checker import check

        open(os.path.join(self.folder, "STOP"), "w").close()
        self.driver.process.wait(timeout=timeout_s)
        self.driver.wait_for("final", timeout_s=1)
        with open(os.path.join(self.folder, "run.pkl"), "rb") as f:
            run = pickle.load(f)
        return check([run], load_calls([os.path.join(self.folder, "calls.jsonl")]), self.faults)


def initial_params():
    import numpy as np

    rng = np.random.default_rng(42)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def drive(address: str, name: str, folder: str, timeout_s: float, shared_memory: bool = False) -> None:
    """The driver of a :class:`Workload` (runs on its host)."""
    from bench.checker import HistoryFollower, SessionRun, shard_map
    from optserve.client import Client

    client = Client(address, timeout=timeout_s)
    client.create_session(name, initial_params(), ADAM, mode="sync", num_workers=1).detach()
    stop = os.path.join(folder, "STOP")
    worker = subprocess.Popen([sys.executable, "-m", "bench._nemesis_worker", address, name, "w0",
                               os.path.join(folder, "calls.jsonl"), stop, "--timeout", str(timeout_s),
                               "--pace", "0.05", *(["--shm-auto"] if shared_memory else [])], stdin=subprocess.DEVNULL)
    print("training", flush=True)
    follower, session = HistoryFollower(), client.session(name, worker_id="netbed-history")
    while not os.path.exists(stop):
        try:
            follower.add(session.history(since=follower.since))
        except Exception as exc:  # noqa: BLE001 - a host may be cut off: the next round asks again
            print("history:", type(exc).__name__, flush=True)
        time.sleep(1.0)
    worker.wait()
    follower.add(session.history(since=follower.since))
    follower.settle(session.history(since=0))
    final = session.pull()
    status = client.session_status(name)
    run = SessionRun(name, "sync", ADAM, initial_params(), final, status.version, list(follower.records),
                     tuple(follower.conflicts), tuple(follower.rollbacks), shard_map(status))
    with open(os.path.join(folder, "run.pkl"), "wb") as f:
        pickle.dump(run, f)
    print("final", status.version, flush=True)
    client.close()


# ----------------------------------------------------------------------------- the bench

def one_run(partition_s: float = 3.0) -> dict:
    """A fresh bed: a few steps, h3 partitioned for ``partition_s`` and healed, h3 cut off until its
    shard is replaced (the old one fenced) and rejoined, h2 lost; the figures."""
    from bench.checker import FaultRecord

    with NetBed() as bed:
        started = time.monotonic()
        cluster = start_cluster(bed)
        work = Workload(cluster)
        work.wait_steps(20)
        cut = time.time()
        bed.partition("h3")
        time.sleep(partition_s)
        healed = time.time()
        bed.heal("h3")
        work.faults.append(FaultRecord("partition", "h3", cut, healed))
        work.wait_steps(20, after=healed)
        replaced_s, fenced = cut_off_until_replaced(cluster, work)
        lost_at = time.time()
        bed.lose_host("h2")
        work.faults.append(FaultRecord("host_lost", "h2", lost_at, lost_at))
        work.wait_steps(20, after=lost_at, timeout_s=180)
        acks = [c.ended for c in work.acknowledged()]
        report = work.stop()
        steps = report.statuses.get("push", {}).get("ok", 0)
        return {"host_lost_s": stall(acks, lost_at), "heal_s": stall(acks, healed), "replaced_s": replaced_s,
                "fenced": fenced,
                "acknowledged": steps, "lost": report.lost, "duplicated": report.duplicated,
                "problems": report.problems(), "wall_s": time.monotonic() - started}


def cut_off_until_replaced(cluster: Cluster, work: Workload, host: str = "h3") -> tuple[float, bool]:
    """``host`` cut off until its shard is restored elsewhere and the old one exited (fenced: it
    still sees the checkpoint folder), then healed and rejoined as a fresh Ray node. Returns the
    wait from the cut to the next acknowledged step, and whether the old shard exited while cut off."""
    from bench.checker import FaultRecord

    shards = cluster.bed.hosts[host].shard_pids()
    cut = time.time()
    cluster.bed.partition(host)
    work.wait_steps(5, after=cut, timeout_s=120)
    deadline = time.monotonic() + 30.0
    while set(shards) & set(cluster.bed.hosts[host].shard_pids()) and time.monotonic() < deadline:
        time.sleep(0.1)
    fenced = not set(shards) & set(cluster.bed.hosts[host].shard_pids())
    healed = time.time()
    cluster.bed.heal(host)
    work.faults.append(FaultRecord("partition", host, cut, healed))
    cluster.rejoin(host)
    return stall([c.ended for c in work.acknowledged()], cut), fenced


def stall(acks: list, t: float, within: int = 10) -> float:
    """The longest wait from unix time ``t`` (or from an acknowledgement after it) to the next
    acknowledgement, over the first ``within`` after ``t``: a step answered just as a fault hit
    does not hide the stall behind it."""
    after = [a for a in sorted(acks) if a >= t][:within]
    return max(b - a for a, b in zip([t] + after, after)) if after else float("inf")


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.netbed", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--partition-s", type=float, default=3.0, help="how long h3 is cut off")
    parser.add_argument("--drive", nargs=4, metavar=("ADDRESS", "SESSION", "DIR", "TIMEOUT"), help=argparse.SUPPRESS)
    parser.add_argument("--shm", action="store_true", help=argparse.SUPPRESS)  # the driven worker shares memory
    args = parser.parse_args(argv)
    if args.drive:
        drive(*args.drive[:3], float(args.drive[3]), args.shm)
        return 0
    reason = unavailable_reason()
    if reason:
        print(f"netbed: cannot make hosts here: {reason}")
        return 2
    runs = []
    for index in range(args.runs):
        run = one_run(args.partition_s)
        runs.append(run)
        print(f"run {index + 1}: host lost -> next step {run['host_lost_s']:.2f} s, partition ({args.partition_s:g} s)"
              f" heal -> next step {run['heal_s']:.2f} s, cut off until replaced -> next step {run['replaced_s']:.2f} s"
              f" (old shard {'fenced' if run['fenced'] else 'NOT FENCED'}),"
              f" steps acknowledged {run['acknowledged']} lost {run['lost']}"
              f" duplicated {run['duplicated']}, run {run['wall_s']:.0f} s"
              + (f", PROBLEMS: {run['problems']}" if run["problems"] else ""), flush=True)
    median = {k: statistics.median(r[k] for r in runs) for k in ("host_lost_s", "heal_s", "replaced_s", "acknowledged",
                                                                 "lost", "duplicated", "wall_s")}
    print(f"median of {len(runs)}: host lost -> next step {median['host_lost_s']:.2f} s, partition heal -> next step "
          f"{median['heal_s']:.2f} s, cut off until replaced -> next step {median['replaced_s']:.2f} s (fenced in "
          f"{sum(r['fenced'] for r in runs)} of {len(runs)}), steps acknowledged {median['acknowledged']:g} "
          f"lost {median['lost']:g} duplicated {median['duplicated']:g}, run {median['wall_s']:.0f} s")
    return 1 if any(r["problems"] or not r["fenced"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
