"""A soak: the nemesis's durable workload without its faults, for a long time, beside a crowd of
clients that create, train and close sessions all along; what every process holds is sampled.

    .venv/bin/python -m bench.soak --minutes 60
    .venv/bin/python -m bench.soak --minutes 2 --crowd 8      # a short one (--small: two minutes)

The server and the three durable sessions are the nemesis's (:mod:`bench.nemesis`: ``sync``,
``async`` and ``elastic``, checkpoints every 25 steps, each worker a process of its own, some over
shared memory, the others over gRPC). Instead of faults, the run has:

- a crowd (:func:`bench.crowd.run`): rounds of ``--crowd`` clients in threads, each creating a
  session of its own, doing ``--crowd-steps`` steps with pauses of 0 to ``--pause-s`` between
  them and closing it, one round after another;
- the elastic session's members leaving and joining: every ``--rejoin-s`` one of its workers is
  SIGKILLed (inside a push, as the nemesis's ``worker_kill``: the checker accounts for it) and a
  new one started, which joins; the old one leaves at its lease's end.

Every ``--sample-s`` the sampler reads each process of the server's tree (the server, Ray's
processes, the shard actors): resident memory, threads and open file descriptors, plus the
shared-memory regions in ``/dev/shm`` and the checkpoint folder's size, and from the server's
metrics (``--metrics-port``) the coordinator's and each shard's malloc heap, in use and free (a
shard keeps freed memory resident, so its RSS follows its peak; what it holds is the heap in
use). It prints each one's peak in a window of ``--window-s`` at the start (after
``--warmup-s``), the middle and the end, with the growth from the start to the end, and each
process's descriptors by kind, the crowd's connections apart. A round's open sessions hold
descriptors (their connections, their logs' files), so ``--between-s`` after each round, with
none open, every process is sampled again: what closed sessions left behind grows those. After a
quiet ``--settle-s`` the workers stop and the nemesis's checker proves that no acknowledged push
was lost or applied twice. Exit status 1 when its report is not clean.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import logging
import math
import os
import shutil
import sys
import threading
import time
import urllib.request
from typing import Optional

from prometheus_client.parser import text_string_to_metric_families

from bench import crowd
from bench._fd_census import KINDS, census
from bench._nemesis_schedule import PlannedFault
from bench.checker import CheckReport, print_report
from bench._termination import exit_on_termination
from bench.nemesis import Nemesis, Options


@dataclasses.dataclass(frozen=True)
class Sample:
    """One reading: seconds since the soak began, ``processes`` (``"title pid"`` -> (RSS bytes,
    threads, fds)), the regions in /dev/shm, the checkpoint folder's bytes and its session
    folders (the crowd's closed sessions must not leave theirs); ``heap``: the server's
    ``optserve_process_heap_bytes`` (``"shard-0"``, ``"coordinator"`` -> (in use, free) bytes;
    empty where the scrape failed); ``descriptors``: ``"title pid"`` -> its descriptors by kind
    (:func:`bench._fd_census.census`: ``from_here`` are the crowd's connections)."""

    at_s: float
    processes: dict
    regions: int
    checkpoint_bytes: int
    session_folders: int
    heap: dict = dataclasses.field(default_factory=dict)
    descriptors: dict = dataclasses.field(default_factory=dict)


def _title(pid: int) -> str:
    """What the process is: a Ray actor's class (its title without the method it runs now), a
    Python program's script or module, else the executable's name."""
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        words = [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    if not words:
        return "?"
    if words[0].startswith("ray::"):
        return words[0].split(".")[0].split()[0]
    name = os.path.basename(words[0])
    if name.startswith("python"):
        rest = [w for w in words[1:] if not w.startswith("-") or w == "-m"]
        if rest:
            name = rest[1] if rest[0] == "-m" and len(rest) > 1 else os.path.basename(rest[0])
    return name[:32]


def _process(pid: int) -> Optional[tuple[int, int, int]]:
    """(resident bytes, threads, open descriptors) of ``pid`` (None: gone)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            fields = dict(line.split(":", 1) for line in fh if ":" in line)
        rss = int(fields["VmRSS"].split()[0]) * 1024
        return rss, int(fields["Threads"]), len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, KeyError):
        return None


def _folder_bytes(folder: str) -> int:
    total = 0
    for top, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(top, name))
            except OSError:
                pass
    return total


@dataclasses.dataclass
class SoakOptions:
    """A soak's settings: the command's flags (``--crowd``: ``crowd``; ``--dir``: ``folder``).
    ``between_s``: after each crowd round (past the warm-up) the crowd waits this long, then
    every process is sampled again (:attr:`Soak.between`) with no crowd session or connection open."""

    minutes: float
    crowd: int = 32
    crowd_steps: int = 20
    pause_s: float = 2.0
    rejoin_s: float = 20.0
    sample_s: float = 10.0
    warmup_s: float = 30.0
    window_s: float = 120.0
    settle_s: float = 10.0
    seed: int = 0
    folder: Optional[str] = None
    between_s: float = 1.0


class Soak(Nemesis):
    """The nemesis's run with :meth:`_inject_until` doing the soak's work instead of faults."""

    def __init__(self, options: SoakOptions, out=sys.stdout):
        super().__init__(Options(options.minutes, options.seed, settle_s=options.settle_s, folder=options.folder,
                                 out=out))
        self.schedule = []
        self.soak = options
        self.samples: list[Sample] = []
        self.between: list[Sample] = []  # sampled between the crowd's rounds
        self.crowd_times: list[float] = []
        self.crowd_rounds = 0
        self.crowd_errors: list[str] = []
        self._titles: dict[int, str] = {}  # pid -> "title pid", named at first sight

    def _server_args(self, checkpoints: str) -> list[str]:
        return super()._server_args(checkpoints) + ["--metrics-port", "0"]

    def _heap(self) -> dict:
        """Each process's malloc heap from the server's metrics (empty if they cannot be read)."""
        url = self.server.metrics_url
        if not url:
            return {}
        heap: dict = {}
        try:
            with urllib.request.urlopen(url, timeout=10) as answer:
                text = answer.read().decode()
            for family in text_string_to_metric_families(text):
                if family.name == "optserve_process_heap_bytes":
                    for sample in family.samples:
                        heap.setdefault(sample.labels["process"], {})[sample.labels["state"]] = int(sample.value)
        except (OSError, http.client.HTTPException, ValueError, KeyError):  # a sample without it
            return {}
        return {process: (states.get("in_use", 0), states.get("free", 0)) for process, states in heap.items()}

    def _checkpoint_folder(self) -> str:
        return os.path.join(self.rig.mount, "ckpt") if not isinstance(self.rig, str) else os.path.join(self.folder,
                                                                                                      "ckpt")

    def _sample(self, started: float) -> Sample:
        processes = {}
        pids = self.server.session_pids()
        kinds = census(pids)
        for pid in pids:
            reading = _process(pid)
            if reading is None:
                continue
            if pid not in self._titles:
                try:
                    self._titles[pid] = f"{_title(pid)} {pid}"
                except OSError:
                    continue
            processes[self._titles[pid]] = reading
        regions = sum(1 for n in os.listdir("/dev/shm") if n.startswith("optserve-"))
        folder = self._checkpoint_folder()
        sessions = os.path.join(folder, "sessions")
        folders = len(os.listdir(sessions)) if os.path.isdir(sessions) else 0
        descriptors = {self._titles[pid]: kinds[pid] for pid in pids if self._titles.get(pid) in processes}
        return Sample(time.monotonic() - started, processes, regions, _folder_bytes(folder), folders, self._heap(),
                      descriptors)

    def _crowd(self, end: float, started: float) -> None:
        """Crowd rounds until ``end`` (each round's clients create, train and close their sessions),
        each past the warm-up followed by a pause and a sample (:attr:`between`)."""
        while time.monotonic() < end:
            try:
                self.crowd_times += crowd.run(self.server.address, self.soak.crowd, self.soak.crowd_steps,
                                              self.soak.pause_s, processes=False, seed=self.crowd_rounds * 1000)
            except Exception as exc:  # noqa: BLE001 - reported, and the soak is not clean
                self.crowd_errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
            self.crowd_rounds += 1
            if time.monotonic() - started >= self.soak.warmup_s and time.monotonic() < end:
                time.sleep(self.soak.between_s)
                self.between.append(self._sample(started))

    def _inject_until(self, end: float) -> None:
        started = time.monotonic()
        crowding = threading.Thread(target=self._crowd, args=(end, started), daemon=True)
        crowding.start()
        elastic = [s.name for s in self.slots if s.session == "elastic"]
        next_sample, next_rejoin, turn = started + self.soak.warmup_s, started + self.soak.rejoin_s, 0
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_sample:
                self.samples.append(self._sample(started))
                next_sample = now + self.soak.sample_s
            if now >= next_rejoin and elastic:  # a member leaves between pushes and a new one joins
                target = elastic[turn % len(elastic)]
                turn += 1
                record = self._worker_kill(PlannedFault(-1, "worker_kill", 0.0, target, 0.5, 0.0))
                self.faults.append(record)
                next_rejoin = time.monotonic() + self.soak.rejoin_s
            time.sleep(min(1.0, max(0.0, end - time.monotonic())))
        crowding.join(timeout=self.soak.crowd_steps * self.soak.pause_s + 120)
        self.samples.append(self._sample(started))


def _growth(first: float, last: float) -> str:
    return f"{(last - first) / first * 100:+.1f}%" if first and not math.isnan(first + last) else "n/a"


def windows(samples: list[Sample], window_s: float) -> tuple[list[Sample], list[Sample], list[Sample]]:
    """The samples of the start, the middle and the end: the ``window_s`` seconds from the first
    sample, around the middle one, and up to the last (each at least that one sample)."""
    first, middle, last = samples[0], samples[len(samples) // 2], samples[-1]
    half = window_s / 2
    return ([s for s in samples if s.at_s <= first.at_s + window_s],
            [s for s in samples if abs(s.at_s - middle.at_s) <= half],
            [s for s in samples if s.at_s >= last.at_s - window_s])


def _largest(window: list[Sample], name: str, field: int) -> float:
    values = [s.processes[name][field] for s in window if name in s.processes]
    return max(values) if values else float("nan")


def _print_descriptors(spans: tuple[list[Sample], ...], out, prefix: str = "") -> None:
    """Each process's descriptors by kind (the largest of each window), and its descriptors less
    the crowd's connections (``from_here``), which come and go with the crowd's rounds: a leak
    grows the latter, a round caught at its peak only the former."""
    for name in sorted({n for w in spans for s in w for n in s.descriptors}):
        held = [max((s.processes[name][2] - s.descriptors[name]["from_here"] for s in w
                     if name in s.descriptors and name in s.processes), default=float("nan")) for w in spans]
        kinds = []
        for kind in KINDS:
            peaks = [max((s.descriptors[name][kind] for s in w if name in s.descriptors), default=float("nan"))
                     for w in spans]
            kinds.append(f"{kind} {'/'.join(f'{v:.0f}' for v in peaks)}")
        out.write(f"{prefix}fds of {name} less the crowd's connections: {' / '.join(f'{v:.0f}' for v in held)} "
                  f"({_growth(held[0], held[2])}); by kind: {', '.join(kinds)}\n")


def print_between(between: list[Sample], out=sys.stdout, window_s: float = 0.0) -> None:
    """Each process's descriptors sampled between the crowd's rounds (its sessions closed, its
    connections gone), the largest of each window (:func:`windows`) with the growth: what
    sessions created and closed left behind, without the noise of a round's open sessions."""
    spans = _headed_windows(between, window_s, out, "between the crowd's rounds: ")
    if spans is not None:
        _print_descriptors(spans, out, "  between rounds: ")


def _headed_windows(samples: list[Sample], window_s: float, out, title: str = "") -> Optional[tuple]:
    """:func:`windows` of ``samples``, after a line saying when they are (None: no samples)."""
    if not samples:
        out.write(f"{title}no samples (the run ended before its warm-up)\n")
        return None
    spans = windows(samples, window_s)
    out.write(f"{title}samples at " + ", ".join(f"{w[0].at_s:.0f}-{w[-1].at_s:.0f} s" for w in spans)
              + f" (the largest of each window of {window_s:.0f} s)\n")
    return spans


def print_samples(samples: list[Sample], out=sys.stdout, window_s: float = 0.0) -> None:
    """Each process's memory, threads and descriptors at the start, the middle and the end, with
    the growth from the start to the end; then /dev/shm and the checkpoint folder. Each figure is
    the largest of a window of ``window_s`` seconds (:func:`windows`): a crowd's rounds come and go,
    so one sample catches a process at a random point of its load, and the growth of the
    windows' peaks is what the run added."""
    spans = _headed_windows(samples, window_s, out)
    if spans is None:
        return
    out.write(f"{'process':<40}{'RSS MB':>26}{'growth':>9}{'threads':>16}{'growth':>9}{'fds':>16}{'growth':>9}\n")
    for name in sorted({n for w in spans for s in w for n in s.processes}):
        cells = []
        for field, scale in ((0, 2 ** 20), (1, 1), (2, 1)):
            values = [_largest(w, name, field) / scale for w in spans]
            text = " / ".join(f"{v:.0f}" for v in values)
            cells.append(f"{text:>{26 if field == 0 else 16}}{_growth(values[0], values[2]):>9}")
        out.write(f"{name:<40}{''.join(cells)}\n")
    _print_descriptors(spans, out)
    regions = [max(s.regions for s in w) for w in spans]
    folder_mb = [max(s.checkpoint_bytes for s in w) / 2 ** 20 for w in spans]
    folders = [max(s.session_folders for s in w) for w in spans]
    for process in sorted({p for w in spans for s in w for p in s.heap}):
        in_use, free = ([max((s.heap[process][state] for s in w if process in s.heap), default=float("nan")) / 2 ** 20
                         for w in spans] for state in (0, 1))
        out.write(f"malloc heap of {process}: in use MB {' / '.join(f'{v:.1f}' for v in in_use)} "
                  f"({_growth(in_use[0], in_use[2])}), free MB {' / '.join(f'{v:.1f}' for v in free)}\n")
    out.write(f"/dev/shm regions: {regions[0]} / {regions[1]} / {regions[2]}\n")
    out.write(f"checkpoint folder MB: {folder_mb[0]:.1f} / {folder_mb[1]:.1f} / {folder_mb[2]:.1f}\n")
    out.write(f"session folders: {folders[0]} / {folders[1]} / {folders[2]}\n")


def run(options: SoakOptions, out=sys.stdout) -> tuple[CheckReport, Soak]:
    """One soak; returns the checker's report and the run (its samples and crowd times)."""
    soak = Soak(options, out)
    report = soak.run()
    return report, soak


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--small", action="store_true", help="a two-minute run (as `python -m bench --small` asks)")
    parser.add_argument("--crowd", type=int, default=32, help="clients per crowd round")
    parser.add_argument("--crowd-steps", type=int, default=20, help="steps per crowd client")
    parser.add_argument("--pause-s", type=float, default=2.0, help="a crowd client's longest pause between steps")
    parser.add_argument("--rejoin-s", type=float, default=20.0, help="seconds between elastic members' departures")
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=30.0, help="the first sample's time (after the warm-up)")
    parser.add_argument("--window-s", type=float, default=120.0,
                        help="each printed figure is the largest of this many seconds of samples (0: one sample)")
    parser.add_argument("--settle-s", type=float, default=10.0)
    parser.add_argument("--between-s", type=float, default=1.0,
                        help="after each crowd round, wait this long and sample (no crowd session open)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default=None, help="folder for logs and checkpoints (default: a temporary one)")
    args = parser.parse_args(argv)
    logging.getLogger("optserve.client").setLevel(logging.ERROR)
    options = SoakOptions(2.0 if args.small else args.minutes, args.crowd, args.crowd_steps, args.pause_s, args.rejoin_s, args.sample_s,
                          args.warmup_s, args.window_s, args.settle_s, args.seed, args.dir, args.between_s)
    with exit_on_termination():
        report, soak = run(options)
    print_samples(soak.samples, window_s=options.window_s)
    print_between(soak.between, window_s=options.window_s)
    if soak.crowd_times:
        figures = crowd.summary(soak.crowd_times)
        print(f"crowd: {soak.crowd_rounds} rounds of {args.crowd} clients, {figures['steps']} steps, p50 "
              f"{figures['p50_s'] * 1000:.1f} ms, p99 {figures['p99_s'] * 1000:.1f} ms, max {figures['max_s']:.2f} s")
    for error in soak.crowd_errors:
        print(f"crowd error: {error}")
    print_report(report)
    clean = report.clean and not soak.crowd_errors
    if clean and args.dir is None:
        shutil.rmtree(soak.folder, ignore_errors=True)
    else:
        print(f"logs: {soak.folder}")
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
