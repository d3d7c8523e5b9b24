"""Where a machine's CPU goes while a command runs, by kind of process (for the suite's time).

    .venv/bin/python scripts/cpu_by_process.py [--interval-s 1] -- make test

Runs the command and, every ``--interval-s``, reads each process's CPU time from ``/proc``; the
time a process used since the previous reading goes to its kind (its command line matched
against :data:`KINDS`, first match). At the end it prints the CPU seconds of each kind, their
share and the command's wall time. A process that starts and ends between two readings is not
seen (a shorter interval sees more of them); its time is reported as unseen: the machine's whole
CPU time (``/proc/stat``) less what the readings attributed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections import Counter
from typing import Optional

KINDS = (  # the first that matches; the specific ones before pytest's, whose tmp_path other commands carry
    ("shard actor", re.compile(r"^ray::ShardActor")),
    ("preconditioner worker", re.compile(r"^ray::Precond")),
    ("ray idle worker", re.compile(r"^ray::IDLE")),
    ("ray daemons", re.compile(r"gcs_server|raylet|dashboard|log_monitor|monitor\.py|runtime_env|ray::|ray\.util")),
    ("optserve serve", re.compile(r"optserve serve|optserve\.server\.cli|server\.cli import main")),
    ("optserve demo", re.compile(r"optserve demo|optserve\.demo")),
    ("bench", re.compile(r"-m bench\.|bench/")),
    ("pytest worker", re.compile(r"-m pytest|bin/pytest|exec\(eval\(sys\.stdin\.readline")),
    ("pip / build", re.compile(r"\bpip\b|setuptools|wheel")),
    ("other python", re.compile(r"python")),
)
_TICKS = os.sysconf("SC_CLK_TCK")


def kind_of(cmdline: str) -> str:
    """The first kind of :data:`KINDS` whose pattern ``cmdline`` matches ("other" if none)."""
    for kind, pattern in KINDS:
        if pattern.search(cmdline):
            return kind
    return "other"


def _process_cpu(pid: str) -> Optional[tuple[float, str, int]]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICKS, cmdline, int(fields[19])  # utime + stime, start time


def _readings(me: str):
    """``((pid, start time), CPU seconds, command line)`` of every process but ``me`` (a reused
    pid is another key; a process that renames itself, as Ray's workers do, keeps its key)."""
    for pid in os.listdir("/proc"):
        if pid.isdigit() and pid != me:
            reading = _process_cpu(pid)
            if reading is not None:
                yield (pid, reading[2]), reading[0], reading[1]


def _machine_cpu() -> float:
    with open("/proc/stat") as fh:
        values = [int(v) for v in fh.readline().split()[1:]]
    return (sum(values) - values[3] - values[4]) / _TICKS  # all but idle and iowait


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval-s", type=float, default=1.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("cpu_by_process: give the command to run after --", file=sys.stderr)
        return 2
    me = str(os.getpid())
    seen = {key: cpu for key, cpu, _ in _readings(me)}  # (pid, start time) -> CPU seconds at the last reading
    by_kind: Counter = Counter()
    started, machine_at_start = time.monotonic(), _machine_cpu()
    child = subprocess.Popen(command)
    while True:
        for key, cpu, cmdline in _readings(me):  # a process new since the start counts all its time
            by_kind[kind_of(cmdline)] += cpu - seen.get(key, 0.0)
            seen[key] = cpu
        if child.poll() is not None:
            break
        time.sleep(args.interval_s)
    wall, machine = time.monotonic() - started, _machine_cpu() - machine_at_start
    attributed = sum(by_kind.values())
    print(f"\ncpu_by_process: {wall:.0f} s wall, {machine:.0f} CPU s on the machine "
          f"({machine / wall:.2f} cores busy on average)")
    for kind, seconds in by_kind.most_common():
        print(f"  {kind:<24} {seconds:8.0f} s  {100 * seconds / max(machine, 1e-9):5.1f}%")
    print(f"  {'unseen (short-lived)':<24} {machine - attributed:8.0f} s  {100 * (machine - attributed) / max(machine, 1e-9):5.1f}%")
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
