"""OPTSERVE_TRACEMALLOC_DIR (server/ops/memory_trace.py): a process traces its allocations and
writes snapshots on a period, a real server passes the setting to its shard actors, and
scripts/tracemalloc_diff.py names the line whose memory grew."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time
import tracemalloc

import pytest

from optserve.server.ops import memory_trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GROWING = """import time
from optserve.server.ops.memory_trace import start_from_environment
writer = start_from_environment("shard-7")
kept = []
def grow():
    kept.append(bytearray(1 << 20))  # line 6: 1 MiB per 0.1 s
for _ in range(8):
    grow()  # line 8
    time.sleep(0.1)
writer.check_once()
writer.stop()
"""


def _diff(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/tracemalloc_diff.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_snapshots_on_a_period_and_the_diff_names_the_line_that_grew(tmp_path):
    folder = tmp_path / "snaps"
    env = dict(os.environ, OPTSERVE_TRACEMALLOC_DIR=str(folder), OPTSERVE_TRACEMALLOC_EVERY_S="0.25")
    child = subprocess.run([sys.executable, "-c", GROWING], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=60)
    assert child.returncode == 0, child.stderr
    snaps = sorted(folder.iterdir())
    assert len(snaps) >= 3 and all(p.name.startswith("shard-7-") and p.suffix == ".snap" for p in snaps), snaps
    for by in ("lineno", "traceback"):  # the allocating line, not its caller's (line 8)
        diff = _diff(snaps[0], snaps[-1], "--top", "3", "--by", by)
        assert diff.returncode == 0, diff.stderr
        lines = diff.stdout.splitlines()
        assert lines[0].startswith("traced: ") and "+8.0" in lines[0], diff.stdout  # 8 MiB kept between them
        assert "+8.00 MiB" in lines[1] and lines[1].endswith("<string>:6"), (by, diff.stdout)


def test_a_server_passes_the_setting_to_its_shard_and_its_stop_ends_the_tracing(ray_local, tmp_path, monkeypatch):
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig

    folder = tmp_path / "snaps"
    monkeypatch.setenv(memory_trace.DIR_ENV, str(folder))
    monkeypatch.setenv(memory_trace.EVERY_ENV, "1")
    # this process's Ray started without the variable: only the actors' own environment carries it
    running = start_server(ServerConfig(host="127.0.0.1", port=0, shards=1, ray_address="local"))
    try:
        assert tracemalloc.is_tracing()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            labels = {"-".join(p.name.split("-")[:2]) if p.name.startswith("shard") else p.name.split("-")[0]
                      for p in folder.glob("*.snap")}
            if {"server", "shard-0"} <= labels:
                break
            time.sleep(0.5)
        assert {"server", "shard-0"} <= labels, sorted(p.name for p in folder.iterdir())
    finally:
        running.stop()
    assert not tracemalloc.is_tracing()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("optserve-tracemalloc")]


def test_without_the_variable_nothing_is_traced(monkeypatch):
    monkeypatch.delenv(memory_trace.DIR_ENV, raising=False)
    assert memory_trace.start_from_environment("server") is None and memory_trace.environment() == {}


@pytest.mark.parametrize("name, value", [(memory_trace.EVERY_ENV, "0"), (memory_trace.EVERY_ENV, "inf"),
                                         (memory_trace.FRAMES_ENV, "many"), (memory_trace.FRAMES_ENV, "70000")])
def test_a_bad_setting_is_refused_naming_the_variable(tmp_path, monkeypatch, name, value):
    monkeypatch.setenv(memory_trace.DIR_ENV, str(tmp_path))
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        memory_trace.start_from_environment("server")
    assert not tracemalloc.is_tracing()


@pytest.mark.parametrize("content", [b"not a snapshot", pickle.dumps({"a": 1})])
def test_a_damaged_snapshot_is_one_line_and_exit_2(tmp_path, content):
    bad = tmp_path / "bad.snap"
    bad.write_bytes(content)
    diff = _diff(bad, bad)
    assert diff.returncode == 2 and diff.stderr.count("\n") == 1 and "not a tracemalloc snapshot" in diff.stderr, \
        diff.stderr
