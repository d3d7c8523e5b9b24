"""scripts/smaps_diff.py: a process's resident growth found in its anonymous mappings."""

from __future__ import annotations

import subprocess
import sys
import uuid

from scripts.smaps_diff import diff, snap

GROWER = ("import sys\nmarker = sys.argv[1]\nprint('ready', flush=True)\nsys.stdin.readline()\nheld = bytearray(96 << 20)\n"
          "for i in range(0, len(held), 4096):\n    held[i] = 1\nprint('grown', flush=True)\nsys.stdin.readline()\n")


def test_a_process_that_touches_96_mib_shows_them_as_anonymous_growth():
    marker = f"smaps-diff-{uuid.uuid4().hex}"
    process = subprocess.Popen([sys.executable, "-c", GROWER, marker], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    try:
        assert process.stdout.readline().strip() == "ready"  # started, its command line in /proc
        before = snap(marker)
        process.stdin.write("grow\n")
        process.stdin.flush()
        assert process.stdout.readline().strip() == "grown"
        after = snap(marker)
    finally:
        process.kill()
        process.wait()
    assert list(before) == list(after) == [str(process.pid)]
    kinds_before, kinds_after = before[str(process.pid)]["kinds"], after[str(process.pid)]["kinds"]
    anonymous = lambda kinds: sum(v[1] for v in kinds.values())  # noqa: E731
    assert anonymous(kinds_after) - anonymous(kinds_before) >= 90 << 20
    report = diff(before, after, top=3)
    lines = report.splitlines()
    assert lines[0].startswith(f"pid {process.pid} ") and "MiB" in lines[0]
    grown = float(lines[1].split()[0])
    assert grown >= 90 and ("[anon]" in lines[1] or "[heap]" in lines[1]), report
