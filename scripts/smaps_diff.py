"""Where a process's memory grew: its mappings' resident bytes, snapshotted and compared by kind.

    python3 scripts/smaps_diff.py snap PATTERN OUT.json    # every process whose command line has PATTERN
    python3 scripts/smaps_diff.py diff BEFORE.json AFTER.json [--top 15]

A snapshot holds, per process, the resident and anonymous bytes of each mapping in
``/proc/PID/smaps``, summed by what the mapping is: its file (a shared library, a mapped data
file), ``[heap]``, ``[stack]``, or ``[anon]`` for anonymous mappings (malloc arenas, Python's
arenas, thread stacks, XLA's buffers). ``diff`` prints, for each process found in both, its total
and the kinds that grew the most. It reads only ``/proc``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return " ".join(f.read().replace(b"\0", b" ").decode(errors="replace").split())
    except OSError:
        return ""


def mapping_kinds(pid: str) -> dict[str, list[int]]:
    """``{kind: [resident bytes, anonymous bytes, mappings]}`` of process ``pid``'s mappings."""
    kinds: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    kind = "[anon]"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header: address range, perms, ..., path
                parts = line.split(None, 5)
                kind = parts[5].strip() if len(parts) == 6 and parts[5].strip() else "[anon]"
                kinds[kind][2] += 1
            elif first == "Rss:":
                kinds[kind][0] += int(line.split()[1]) * 1024
            elif first == "Anonymous:":
                kinds[kind][1] += int(line.split()[1]) * 1024
    return dict(kinds)


def snap(pattern: str) -> dict:
    """Every process whose command line contains ``pattern`` (this one excepted), by pid."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        line = _cmdline(pid)
        if pattern in line and int(pid) != os.getpid():
            try:
                found[pid] = {"cmdline": line[:200], "kinds": mapping_kinds(pid)}
            except OSError:  # gone meanwhile
                continue
    return found


def diff(before: dict, after: dict, top: int) -> str:
    lines = []
    for pid in sorted(set(before) & set(after), key=int):
        old, new = before[pid]["kinds"], after[pid]["kinds"]
        total_old = sum(v[0] for v in old.values())
        total_new = sum(v[0] for v in new.values())
        lines.append(f"pid {pid} {after[pid]['cmdline'][:80]}: resident {total_old / 2**20:.1f} -> "
                     f"{total_new / 2**20:.1f} MiB ({(total_new - total_old) / 2**20:+.1f})")
        growth = sorted(((new.get(k, [0, 0, 0])[0] - old.get(k, [0, 0, 0])[0], k) for k in set(old) | set(new)),
                        reverse=True)
        for delta, kind in growth[:top]:
            if delta:
                count = f"{old.get(kind, [0, 0, 0])[2]} -> {new.get(kind, [0, 0, 0])[2]} mappings"
                lines.append(f"  {delta / 2**20:+8.2f} MiB  {kind}  ({count})")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    take = sub.add_parser("snap")
    take.add_argument("pattern")
    take.add_argument("out")
    compare = sub.add_parser("diff")
    compare.add_argument("before")
    compare.add_argument("after")
    compare.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    if args.command == "snap":
        found = snap(args.pattern)
        with open(args.out, "w") as f:
            json.dump(found, f)
        print(f"smaps_diff: {len(found)} processes matching {args.pattern!r} -> {args.out}")
        return 0
    with open(args.before) as f:
        before = json.load(f)
    with open(args.after) as f:
        after = json.load(f)
    print(diff(before, after, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
