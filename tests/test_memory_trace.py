"""OPTSERVE_TRACEMALLOC_DIR (server/ops/memory_trace.py): a process traces its allocations and
writes snapshots on a period, and scripts/tracemalloc_diff.py names the line whose memory grew."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from optserve.server.ops import memory_trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GROWING = """
import time
from optserve.server.ops.memory_trace import start_from_environment
writer = start_from_environment("shard-7")
kept = []
for _ in range(8):
    kept.append(bytearray(1 << 20))  # the line that grows: 1 MiB per 0.1 s
    time.sleep(0.1)
writer.check_once()
writer.stop()
"""


def test_snapshots_on_a_period_and_the_diff_names_the_line_that_grew(tmp_path):
    folder = tmp_path / "snaps"
    env = dict(os.environ, OPTSERVE_TRACEMALLOC_DIR=str(folder), OPTSERVE_TRACEMALLOC_EVERY_S="0.25")
    child = subprocess.run([sys.executable, "-c", GROWING], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=60)
    assert child.returncode == 0, child.stderr
    snaps = sorted(folder.iterdir())
    assert len(snaps) >= 3 and all(p.name.startswith("shard-7-") and p.suffix == ".snap" for p in snaps), snaps
    diff = subprocess.run([sys.executable, "scripts/tracemalloc_diff.py", str(snaps[0]), str(snaps[-1]), "--top", "3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert diff.returncode == 0, diff.stderr
    lines = diff.stdout.splitlines()
    assert lines[0].startswith("traced: ") and "+8.0" in lines[0], diff.stdout  # 8 MiB kept between them
    assert "+8.00 MiB" in lines[1] and "<string>:" in lines[1], diff.stdout  # the bytearray's line, first


def test_without_the_variable_nothing_is_traced(monkeypatch):
    monkeypatch.delenv(memory_trace.DIR_ENV, raising=False)
    assert memory_trace.start_from_environment("server") is None


@pytest.mark.parametrize("name, value", [(memory_trace.EVERY_ENV, "0"), (memory_trace.FRAMES_ENV, "many")])
def test_a_bad_setting_is_refused_naming_the_variable(tmp_path, monkeypatch, name, value):
    monkeypatch.setenv(memory_trace.DIR_ENV, str(tmp_path))
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        memory_trace.start_from_environment("server")


def test_a_damaged_snapshot_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.snap"
    bad.write_bytes(b"not a snapshot")
    diff = subprocess.run([sys.executable, "scripts/tracemalloc_diff.py", str(bad), str(bad)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert diff.returncode == 2 and diff.stderr.count("\n") == 1 and "tracemalloc_diff:" in diff.stderr, diff.stderr
