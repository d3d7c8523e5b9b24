"""Shared timing helpers for the benchmarks: medians over repeats, CPU accounting, and a plain
table printer."""

from __future__ import annotations

import dataclasses
import os
import resource
import statistics
import time
from typing import Callable, Optional, Sequence


def median_seconds(fn: Callable[[], object], *, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls after ``warmup`` untimed calls.

    ``fn`` must block until its work is done (call ``block_until_ready`` on jax outputs).
    """
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


@dataclasses.dataclass(frozen=True)
class CpuSample:
    """CPU seconds used so far: by the whole machine (all cores, from ``/proc/stat``) and by this
    process (all its threads). Differences of two samples tell whether a timed call was CPU-bound."""

    machine_busy_s: float
    machine_total_s: float
    process_s: float

    @staticmethod
    def now() -> Optional["CpuSample"]:
        """The current sample, or None where ``/proc/stat`` does not exist (not Linux)."""
        try:
            with open("/proc/stat") as stat:
                ticks = [int(v) for v in stat.readline().split()[1:]]
        except OSError:
            return None
        hz = os.sysconf("SC_CLK_TCK")
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return CpuSample((sum(ticks) - idle) / hz, sum(ticks) / hz, usage.ru_utime + usage.ru_stime)


@dataclasses.dataclass
class CpuUse:
    """CPU used by repeated calls of one function, summed over the calls (see :class:`CpuSample`)."""

    calls: int = 0
    machine_busy_s: float = 0.0
    machine_total_s: float = 0.0
    process_s: float = 0.0

    def add(self, before: Optional[CpuSample], after: Optional[CpuSample]) -> None:
        if before is None or after is None:
            return
        self.calls += 1
        self.machine_busy_s += after.machine_busy_s - before.machine_busy_s
        self.machine_total_s += after.machine_total_s - before.machine_total_s
        self.process_s += after.process_s - before.process_s

    def summary(self, own: str = "this process", others: str = "others") -> str:
        """``"machine 95% busy; CPU ms per call: client 430, shards 610"`` (``own`` / ``others``
        name this process and the rest of the machine), or "" if nothing was measured."""
        if not self.calls or self.machine_total_s <= 0:
            return ""
        own_ms = self.process_s / self.calls * 1e3
        others_ms = max(0.0, self.machine_busy_s - self.process_s) / self.calls * 1e3
        busy = self.machine_busy_s / self.machine_total_s
        return f"machine {busy:.0%} busy; CPU ms per call: {own} {own_ms:.0f}, {others} {others_ms:.0f}"


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Prints a fixed-width table (and returns it) so closing notes can quote it verbatim."""
    cells = [[str(h) for h in header]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(cells[0], widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells[1:]]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
