"""Hot standbys across separate hosts: what a lost or cut-off shard host costs with ``--replicas 2``.

    .venv/bin/python -m bench.netbed_replicas --runs 5

Each run is a fresh bed (:mod:`bench.netbed`) of five hosts: the Ray head and ``optserve serve
--replicas 2 --checkpoint-dir DIR`` on h1 (the folder every host sees: the sessions are durable and
live in two hosts' memory; ``--memory-only``: no ``--checkpoint-dir``), Ray nodes on h2, h3 and h5
(the shards and their standbys), a client on h4 training a two-shard sync session (adam) and
pushing every 50 ms, every call read by the chaos checker (bench/checker.py). In order:

1. **isolated**: the host of shard 0's primary is cut off for ``--isolate-s`` (20 s), then plugged
   back in and started again as a fresh Ray node; its standby is promoted meanwhile;
2. **lost**: once every shard's standby is in sync again, the host of shard 0's primary is lost
   (link down, every process SIGKILLed);
3. **lost again**: once the fresh standby is in sync, the host of the new primary is lost too.

Each figure is the longest wait from the fault to the next acknowledged step (over the first ten
after it, :func:`bench.netbed.stall`); then the checker's verdict on the whole run: every
acknowledged push applied exactly once, versions contiguous, parameters equal to a replay.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Optional

from bench.netbed import NetBed, Workload, start_cluster, start_node, placed, stall, unavailable_reason

HOSTS = ("h1", "h2", "h3", "h4", "h5")
STATUS = ("import json, sys; from optserve.client import Client\n"
          "with Client(sys.argv[1], timeout=30) as c:\n"
          "    print('STATUS', json.dumps([{'index': s.index, 'address': s.address, 'node_id': s.node_id,\n"
          "        'standby': s.standby and {'node_id': s.standby.node_id, 'healthy': s.standby.healthy,\n"
          "                                  'in_sync': s.standby.in_sync}} for s in c.server_status()]))\n")


def server_status(bed: NetBed, address: str, host: str = "h4") -> list[dict]:
    """The server's shards as a client on ``host`` sees them: each ``{"index", "address",
    "node_id", "standby": None or {"node_id", "healthy", "in_sync"}}``."""
    run = bed.hosts[host].spawn(f"status-{time.monotonic_ns()}", [sys.executable, "-c", STATUS, address])
    if run.process.wait(timeout=120) != 0:
        raise RuntimeError(run.output()[-3000:])
    return json.loads(run.wait_for("STATUS ").split(" ", 1)[1])


def host_of(bed: NetBed, address: str) -> str:
    by_address = {h.address: name for name, h in bed.hosts.items()}
    return by_address[address.rsplit(":", 1)[0]]


def wait_in_sync(bed: NetBed, address: str, timeout_s: float = 120.0) -> list[dict]:
    """The shards once each has a healthy standby holding its session in sync."""
    deadline = time.monotonic() + timeout_s
    while True:
        shards = server_status(bed, address)
        if all(s["standby"] and s["standby"]["healthy"] and s["standby"]["in_sync"] >= 1 for s in shards):
            return shards
        if time.monotonic() > deadline:
            raise RuntimeError(f"standbys not in sync after {timeout_s:.0f} s: {shards}")
        time.sleep(0.5)


def one_run(isolate_s: float = 20.0, durable: bool = True) -> dict:
    from bench.checker import FaultRecord

    with NetBed(HOSTS) as bed:
        started = time.monotonic()
        cluster = start_cluster(bed, replicas=2, durable=durable)
        start_node(bed.hosts["h5"], placed(cluster.node_argv, bed.hosts["h1"], bed.hosts["h5"],
                                           cluster.checkpoint_dir), "ray-h5")
        work = Workload(cluster, timeout_s=30.0)
        work.wait_steps(20)
        figures = {}

        shards = wait_in_sync(bed, cluster.address)
        host = host_of(bed, shards[0]["address"])
        cut = time.time()
        bed.partition(host)
        work.wait_steps(10, after=cut, timeout_s=90)
        moved = host_of(bed, server_status(bed, cluster.address)[0]["address"]) != host
        time.sleep(max(0.0, cut + isolate_s - time.time()))
        healed = time.time()
        bed.heal(host)
        work.faults.append(FaultRecord("partition", host, cut, healed))
        cluster.rejoin(host)
        figures["isolated_s"], figures["promoted"] = stall([c.ended for c in work.acknowledged()], cut), moved
        print(f"  isolated {host}: next step {figures['isolated_s']:.2f} s, promoted {moved}", flush=True)

        for key in ("lost_s", "lost_again_s"):
            shards = wait_in_sync(bed, cluster.address)
            host = host_of(bed, shards[0]["address"])
            print(f"  in sync: {[(host_of(bed, s['address']), s['standby']) for s in shards]}", flush=True)
            lost = time.time()
            bed.lose_host(host)
            work.faults.append(FaultRecord("host_lost", host, lost, lost))
            work.wait_steps(10, after=lost, timeout_s=90)
            figures[key] = stall([c.ended for c in work.acknowledged()], lost)
            print(f"  lost {host}: next step {figures[key]:.2f} s", flush=True)
        report = work.stop()
        figures.update(acknowledged=report.statuses.get("push", {}).get("ok", 0), lost=report.lost,
                       duplicated=report.duplicated, replay=report.sessions[0].replay_max_diff,
                       problems=report.problems(), wall_s=time.monotonic() - started)
        return figures


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.netbed_replicas", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--isolate-s", type=float, default=20.0, help="how long a primary's host is cut off")
    parser.add_argument("--memory-only", action="store_true",
                        help="no --checkpoint-dir: the sessions live in the two hosts' memory only")
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason:
        print(f"netbed_replicas: cannot make hosts here: {reason}")
        return 2
    print(f"netbed_replicas: --replicas 2 {'in memory only' if args.memory_only else 'with --checkpoint-dir'}, "
          f"{args.runs} runs", flush=True)
    runs = []
    for index in range(args.runs):
        run = one_run(args.isolate_s, durable=not args.memory_only)
        runs.append(run)
        print(f"run {index + 1}: primary's host isolated {args.isolate_s:g} s -> next step {run['isolated_s']:.2f} s "
              f"({'standby promoted' if run['promoted'] else 'NOT PROMOTED'}), primary's host lost -> next step "
              f"{run['lost_s']:.2f} s, new primary's host lost -> next step {run['lost_again_s']:.2f} s; steps "
              f"acknowledged {run['acknowledged']} lost {run['lost']} duplicated {run['duplicated']} replay |diff| "
              f"{run['replay']:.1e}, run {run['wall_s']:.0f} s" + (f", PROBLEMS: {run['problems']}"
                                                                   if run["problems"] else ""), flush=True)
    median = {k: statistics.median(r[k] for r in runs) for k in ("isolated_s", "lost_s", "lost_again_s")}
    print(f"median of {len(runs)}: isolated -> next step {median['isolated_s']:.2f} s, lost -> next step "
          f"{median['lost_s']:.2f} s, lost again -> next step {median['lost_again_s']:.2f} s; promoted in "
          f"{sum(r['promoted'] for r in runs)} of {len(runs)}, lost {sum(r['lost'] for r in runs)}, duplicated "
          f"{sum(r['duplicated'] for r in runs)}, runs with problems {sum(bool(r['problems']) for r in runs)}")
    return 1 if any(r["problems"] or not r["promoted"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
