"""A seeded nemesis on separate hosts with hot standbys: a durable two-shard sync session trains
while shard processes die and hosts are cut off and lost, and the chaos checker judges every call.

    .venv/bin/python -m bench.netbed_nemesis --seed 1 --faults 6

A fresh bed (:mod:`bench.netbed`) of five hosts: the Ray head and ``optserve serve --replicas 2
--checkpoint-dir DIR`` on h1, Ray nodes on h2, h3 and h5 (shards and standbys), the client on h4
pushing every 50 ms (:class:`bench.netbed.Workload`, every call logged). The faults are drawn from
``random.Random(seed)`` before the run and printed (same seed, same schedule); each waits until
every shard's standby holds the session in sync again, then hits:

- ``primary_kill``: SIGKILL of a shard's primary process (its host stays);
- ``standby_kill``: SIGKILL of a shard's standby process;
- ``partition``: the host of a shard's primary cut off for 2-8 s, then back as a fresh Ray node;
- ``host_lost`` (the last fault, at most once: a lost host does not come back): the host of a
  shard's primary fails as a machine does.

After each fault that hit a primary the nemesis checks the promotion: the shard must be served
from the node its standby was on (promoted from memory, not restored from disk). At the end the
checker (bench/checker.py) proves every acknowledged push applied exactly once, versions
contiguous, parameters equal to a replay, every call ended with a documented status; it prints the
longest unavailability after each kind of fault. Exit status 1 when anything failed.
"""

from __future__ import annotations

import argparse
import random
import re
import subprocess
import sys
import time
from typing import Optional

from bench.netbed import NetBed, Workload, placed, start_cluster, start_node, unavailable_reason
from bench.netbed_replicas import HOSTS, host_of, server_status, wait_in_sync
from bench.netns import pids_in_netns

KINDS = ("primary_kill", "standby_kill", "partition")
SHARD_HOSTS = ("h2", "h3", "h5")


def plan(seed: int, faults: int, host_loss: bool = True) -> list[tuple[str, int, float]]:
    """``faults`` faults ``(kind, shard index, seconds cut off)``, the last a host loss."""
    rng = random.Random(seed)
    drawn = [(rng.choice(KINDS), rng.randrange(2), round(rng.uniform(2.0, 8.0), 1)) for _ in range(faults)]
    if host_loss and drawn:
        drawn[-1] = ("host_lost", rng.randrange(2), 0.0)
    return drawn


def shard_pids(bed: NetBed, host: str) -> dict[int, int]:
    """The shard processes of ``host``: listening port -> pid (``ss`` in its namespace)."""
    out = subprocess.run(["ip", "netns", "exec", bed.hosts[host].ns, "ss", "-ltnpH"], capture_output=True,
                         text=True).stdout
    ports = {}
    alive = set(pids_in_netns(bed.hosts[host].ns))
    for line in out.splitlines():
        port = re.search(r":(\d+)\s", line)
        pid = re.search(r"pid=(\d+)", line)
        if port and pid and int(pid.group(1)) in alive and _is_shard(int(pid.group(1))):
            ports[int(port.group(1))] = int(pid.group(1))
    return ports


def _is_shard(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return b"ShardActor" in fh.read()
    except OSError:
        return False


def kill_primary(bed: NetBed, address: str) -> int:
    host = host_of(bed, address)
    pid = shard_pids(bed, host)[int(address.rsplit(":", 1)[1])]
    subprocess.run(["kill", "-KILL", str(pid)], check=True)
    return pid


def kill_standby(bed: NetBed, shards: list[dict]) -> Optional[str]:
    """SIGKILLs one standby process (a shard process serving no primary); returns its host."""
    primaries = {int(s["address"].rsplit(":", 1)[1]) for s in shards}
    for host in random.Random(time.monotonic_ns()).sample(SHARD_HOSTS, len(SHARD_HOSTS)):
        listening = shard_pids(bed, host)  # a process listens on several ports: a primary's data port names it
        standbys = set(listening.values()) - {pid for port, pid in listening.items() if port in primaries}
        if standbys:
            subprocess.run(["kill", "-KILL", str(min(standbys))], check=True)
            return host
    return None


def one_run(seed: int, faults: int) -> dict:
    from bench.checker import FaultRecord, print_report

    schedule = plan(seed, faults)
    print(f"netbed_nemesis: seed {seed}: " + ", ".join(f"{k}(shard {i}{f', {s:g} s' if k == 'partition' else ''})"
                                                      for k, i, s in schedule), flush=True)
    problems = []
    with NetBed(HOSTS) as bed:
        cluster = start_cluster(bed, replicas=2, durable=True)
        start_node(bed.hosts["h5"], placed(cluster.node_argv, bed.hosts["h1"], bed.hosts["h5"],
                                           cluster.checkpoint_dir), "ray-h5")
        work = Workload(cluster, timeout_s=30.0)
        work.wait_steps(20)
        for number, (kind, index, seconds) in enumerate(schedule, 1):
            shards = wait_in_sync(bed, cluster.address, timeout_s=180)
            before, standby_node = shards[index]["address"], shards[index]["standby"]["node_id"]
            host = host_of(bed, before)
            at = time.time()
            if kind == "primary_kill":
                target = f"shard {index} primary (pid {kill_primary(bed, before)}, {host})"
                work.faults.append(FaultRecord(kind, target, at, time.time()))
            elif kind == "standby_kill":
                target = f"a standby on {kill_standby(bed, shards)}"
                work.faults.append(FaultRecord(kind, target, at, time.time()))
            elif kind == "partition":
                bed.partition(host)
                target = f"{host} (shard {index}'s primary) for {seconds:g} s"
                work.wait_steps(5, after=at, timeout_s=90)
                time.sleep(max(0.0, at + seconds - time.time()))
                bed.heal(host)
                work.faults.append(FaultRecord(kind, target, at, time.time()))
                cluster.rejoin(host)
            else:
                bed.lose_host(host)
                target = f"{host} (shard {index}'s primary)"
                work.faults.append(FaultRecord(kind, target, at, at))
            work.wait_steps(10, after=at, timeout_s=90)
            after = server_status(bed, cluster.address)[index]
            promoted = after["address"] != before and after["node_id"] == standby_node
            if kind != "standby_kill" and not promoted:
                problems.append(f"fault {number} ({kind} of {target}): shard {index} was not promoted onto its "
                                f"standby's node (now {after['address']} on {after['node_id'][:12]})")
            print(f"  fault {number}: {kind} of {target}: "
                  + ("" if kind == "standby_kill" else f"promoted {promoted}; ")
                  + f"next acknowledged step after {work.wait_steps(1, after=at) - at:.2f} s", flush=True)
        report = work.stop()
        print_report(report)
        return {"problems": problems + report.problems(), "lost": report.lost, "duplicated": report.duplicated}


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.netbed_nemesis", description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="draws the fault schedule (same seed, same schedule)")
    parser.add_argument("--faults", type=int, default=6, help="how many faults, the last a host loss")
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason:
        print(f"netbed_nemesis: cannot make hosts here: {reason}")
        return 2
    outcome = one_run(args.seed, args.faults)
    print("PROBLEMS:\n  " + "\n  ".join(outcome["problems"]) if outcome["problems"] else "clean: nothing lost, "
          "nothing applied twice, every primary fault promoted its standby")
    return 1 if outcome["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
