"""What grew between two tracemalloc snapshots of one process (``server/ops/memory_trace.py``).

    python scripts/tracemalloc_diff.py OLD.snap NEW.snap [--top 25] [--by lineno|traceback]

Prints the total traced bytes of each, then the allocation sites whose live bytes grew most
(``--by traceback``: with each site's frames, innermost last), one line each: growth, bytes now,
blocks now (and their growth), where.
"""

from __future__ import annotations

import argparse
import sys
import tracemalloc
from typing import Optional


def _mib(size: int) -> str:
    return f"{size / 2**20:+.2f} MiB" if size else "0"


def _load(path: str) -> tracemalloc.Snapshot:
    try:
        snapshot = tracemalloc.Snapshot.load(path)
    except OSError:
        raise  # a missing or unreadable file, as the system says it
    except Exception as exc:  # noqa: BLE001 - a damaged file: pickle raises nearly anything
        raise ValueError(f"{path}: not a tracemalloc snapshot ({type(exc).__name__}: {exc})") from None
    if not isinstance(snapshot, tracemalloc.Snapshot):
        raise ValueError(f"{path}: not a tracemalloc snapshot (a pickled {type(snapshot).__name__})")
    return snapshot


def diff(old_path: str, new_path: str, top: int = 25, by: str = "lineno") -> list[str]:
    """The printed lines (see the module's docstring)."""
    old, new = _load(old_path), _load(new_path)
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__)]
    old, new = old.filter_traces(ignore), new.filter_traces(ignore)
    total_old = sum(s.size for s in old.statistics("filename"))
    total_new = sum(s.size for s in new.statistics("filename"))
    lines = [f"traced: {total_old / 2**20:.2f} MiB -> {total_new / 2**20:.2f} MiB ({_mib(total_new - total_old)})"]
    for stat in new.compare_to(old, by)[:top]:
        lines.append(f"{_mib(stat.size_diff):>12}  now {stat.size / 2**20:8.2f} MiB  {stat.count:>8} blocks "
                     f"({stat.count_diff:+d})  {stat.traceback[-1]}")  # the newest frame: the allocating line
        if by == "traceback":
            lines.extend(f"      {frame.strip()}" for frame in stat.traceback.format())
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/tracemalloc_diff.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--by", choices=("lineno", "traceback"), default="lineno")
    args = parser.parse_args(argv)
    try:
        print("\n".join(diff(args.old, args.new, args.top, args.by)))
    except (OSError, ValueError) as exc:
        print(f"tracemalloc_diff: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
