"""What ``python -m bench.crowd`` watches on the server's side while a crowd steps: CPU seconds of
the server (its own process, where the coordinator runs, and its shard actors) and of the Ray
daemons beside them, and the shards' threads and resident memory sampled every ``period_s``.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Optional

import psutil


@dataclasses.dataclass
class Series:
    """A sampled figure over a phase: its first, largest and last reading."""

    first: float = 0.0
    peak: float = 0.0
    last: float = 0.0
    readings: int = 0

    def add(self, value: float) -> None:
        self.first = value if self.readings == 0 else self.first
        self.peak = max(self.peak, value)
        self.last = value
        self.readings += 1


@dataclasses.dataclass
class Usage:
    """CPU seconds over a phase: ``server`` (the server's process and its shard actors) and
    ``ray`` (every other process below the server's but the bench's client processes)."""

    server_s: float
    ray_s: float


def _cpu(process: psutil.Process) -> Optional[float]:
    try:
        times = process.cpu_times()
        return times.user + times.system
    except psutil.Error:
        return None


def _is_shard(process: psutil.Process) -> bool:
    try:
        cmdline = process.cmdline()
    except psutil.Error:
        return False
    return bool(cmdline) and cmdline[0].startswith("ray::ShardActor")


class ServerWatch:
    """Watches the server running in process ``pid`` (the bench's own, which started it).

    ``exclude``: pids below it that are not the server's (the bench's client processes).
    """

    def __init__(self, pid: int, period_s: float = 1.0):
        self._root = psutil.Process(pid)
        self._period_s = period_s
        self.exclude: set[int] = set()
        self.threads = Series()
        self.rss_bytes = Series()
        self._cpu_at: dict[tuple[int, float], float] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def shard_processes(self) -> list[psutil.Process]:
        return [p for p in self._root.children(recursive=True) if _is_shard(p)]

    def sample(self) -> tuple[int, int]:
        """(threads, resident bytes) of the shard actors together."""
        threads = rss = 0
        for process in self.shard_processes():
            try:
                threads += process.num_threads()
                rss += process.memory_info().rss
            except psutil.Error:
                pass
        return threads, rss

    def _cpu_now(self) -> dict[tuple[int, float], tuple[bool, float]]:
        """(pid, start time) -> (is server, CPU seconds) for the root and everything below it."""
        found = {}
        for process in [self._root, *self._root.children(recursive=True)]:
            if process.pid in self.exclude:
                continue
            seconds = _cpu(process)
            try:
                key = (process.pid, process.create_time())
            except psutil.Error:
                continue
            if seconds is not None:
                found[key] = (process is self._root or _is_shard(process), seconds)
        return found

    def start(self) -> None:
        """Begins a phase: CPU counted from now, the samples started afresh."""
        self._cpu_at = {key: seconds for key, (_, seconds) in self._cpu_now().items()}
        self.threads, self.rss_bytes = Series(), Series()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sampling, name="crowd-watch", daemon=True)
        self._thread.start()

    def _sampling(self) -> None:
        while True:
            threads, rss = self.sample()
            self.threads.add(threads)
            self.rss_bytes.add(rss)
            if self._stop.wait(self._period_s):
                return

    def stop(self) -> Usage:
        """Ends the phase; its CPU seconds (a process that started meanwhile counts from 0; one
        that ended meanwhile is not counted)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        server = ray = 0.0
        for key, (is_server, seconds) in self._cpu_now().items():
            spent = seconds - self._cpu_at.get(key, 0.0)
            if is_server:
                server += spent
            else:
                ray += spent
        return Usage(server, ray)
