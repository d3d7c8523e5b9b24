"""Shared timing helpers for the benchmarks: medians over repeats, and a plain table printer."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence


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
