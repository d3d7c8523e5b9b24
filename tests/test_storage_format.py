"""The on-disk format is versioned: files written before versions existed (format 1, a committed
fixture) still restore exactly, and files of a newer format are refused with a message naming the
file and both versions, at every reader (catalog entry, manifest, step log, journal, server start)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from optserve.client import Client
from optserve.server.domain.durability import DurabilityConfig, ShardProgress, StepRecord
from optserve.server.storage import (FORMAT_VERSION, SessionCatalog, ShardStore, UnsupportedFormat, load_checkpoint,
                                     read_journal, read_step_log)
from optserve.server.storage.format import SEGMENT_HEADER, SEGMENT_MAGIC
from tests._service_helpers import InProcess, make_grads, max_abs_diff
from tests._store_helpers import log_step

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "format1"
NEWER = FORMAT_VERSION + 1


def _serve(checkpoint_dir: str) -> subprocess.Popen:
    """``optserve serve`` on a port it picks (``_wait_listening`` tells which)."""
    port = 0
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    # the fixture was written by a server at XLA's default optimisation level: its log replays bit
    # for bit only in the same code (conftest.py compiles the rest of the suite at level 0)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace("--xla_backend_optimization_level=0", "").strip()
    process = subprocess.Popen(
        [sys.executable, "-m", "optserve.server.cli", "serve", "--port", str(port), "--shards", "2",
         "--min-shard-bytes", "0", "--checkpoint-dir", checkpoint_dir, "--checkpoint-every-steps", "3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    return process


def _wait_listening(process: subprocess.Popen) -> str:
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith("optserve listening on "):
            return line.split()[3]
    raise AssertionError("server did not start:\n" + "".join(lines[-30:]) + process.stderr.read()[-3000:])


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()


@pytest.fixture
def format1_dir(tmp_path) -> str:
    target = tmp_path / "ckpt"
    shutil.copytree(FIXTURE / "ckpt", target)
    return str(target)


def test_a_session_written_in_format_1_restores_exactly_and_trains_on(format1_dir):
    expected = np.load(FIXTURE / "expected.npz")
    initial = {k.split("/", 1)[1]: expected[k] for k in expected.files if k.startswith("initial/")}
    at_v5 = {k.split("/", 1)[1]: expected[k] for k in expected.files if k.startswith("v5/")}
    reference = InProcess("adam", {"learning_rate": 0.01}, initial)
    for step in range(5):
        reference.step(make_grads(initial, step))
    process = _serve(format1_dir)
    try:
        address = _wait_listening(process)
        with Client(address, timeout=60.0) as client:
            session = client.session("old-format")
            assert session.version == 5
            assert max_abs_diff(session.pull(), at_v5) == 0.0  # checkpoint 3 + two replayed log records
            grads = make_grads(initial, 5)
            assert max_abs_diff(session.push_pull(grads), reference.step(grads)) <= 1e-6
            session.detach()
    finally:
        _stop(process)
    # What the restored server wrote from then on is in the current format.
    shard0 = os.path.join(format1_dir, "sessions", "old-format", "shard-0")
    newest = max(name for name in os.listdir(shard0) if name.startswith("steps-"))
    with open(os.path.join(shard0, newest), "rb") as fh:
        assert SEGMENT_HEADER.unpack(fh.read(SEGMENT_HEADER.size)) == (SEGMENT_MAGIC, FORMAT_VERSION)


def test_load_checkpoint_reads_a_format_1_checkpoint(format1_dir):
    loaded = load_checkpoint(format1_dir, "old-format")
    assert loaded["version"] == 3 and sorted(loaded["params"]) == ["b", "w"]


def _rewrite_json(path: str, **changes) -> None:
    with open(path) as fh:
        document = json.load(fh)
    document.update(changes)
    with open(path, "w") as fh:
        json.dump(document, fh)


def _assert_names_file_and_versions(exc: pytest.ExceptionInfo, path: str) -> None:
    message = str(exc.value)
    assert path in message and f"version {NEWER}" in message and f"1 to {FORMAT_VERSION}" in message, message


def test_a_catalog_entry_of_a_newer_format_is_refused(format1_dir):
    entry = os.path.join(format1_dir, "sessions", "old-format", "session.json")
    _rewrite_json(entry, format=NEWER)
    with pytest.raises(UnsupportedFormat) as exc:
        SessionCatalog(format1_dir).entries()
    _assert_names_file_and_versions(exc, entry)


def test_a_checkpoint_manifest_of_a_newer_format_is_refused(format1_dir):
    manifest = os.path.join(format1_dir, "sessions", "old-format", "shard-1", "checkpoint-3.json")
    _rewrite_json(manifest, format=NEWER)
    store = ShardStore(format1_dir, "old-format", 1, DurabilityConfig(format1_dir), home=False)
    try:
        with pytest.raises(UnsupportedFormat) as exc:
            store.latest()
        _assert_names_file_and_versions(exc, manifest)
    finally:
        store.close()


def _current_format_logs(tmp_path) -> tuple[str, str]:
    """A step-log segment and a journal segment written now: (steps path, tickets path)."""
    store = ShardStore(str(tmp_path), "fresh", 0, DurabilityConfig(str(tmp_path)), home=True)
    store.start_logs(None)
    store.log.journal_entry([0, "c", 1, 0, 1.0, True, 1, False])
    log_step(store.log, StepRecord(1, ((0, "c", 1),), 1.0, 0.0), [np.ones(3, np.float32)])
    store.log.wait_logged(1)
    store.close()
    return store.log.segments(None)[0], os.path.join(store.folder, "tickets-0.log")


def test_log_segments_carry_the_format_and_a_newer_one_is_refused(tmp_path):
    steps, tickets = _current_format_logs(tmp_path)
    records = list(read_step_log(steps, lambda: {"g": np.empty(3, np.float32)}))
    assert [StepRecord.from_json(header).version for header, _ in records] == [1]
    assert read_journal(tickets) == [[0, "c", 1, 0, 1.0, True, 1, False]]
    with open(tickets) as fh:
        assert json.loads(fh.readline()) == {"format": FORMAT_VERSION}

    with open(steps, "r+b") as fh:
        fh.write(SEGMENT_HEADER.pack(SEGMENT_MAGIC, NEWER))
    with pytest.raises(UnsupportedFormat) as exc:
        list(read_step_log(steps, lambda: {"g": np.empty(3, np.float32)}))
    _assert_names_file_and_versions(exc, steps)

    with open(tickets) as fh:
        lines = fh.readlines()
    with open(tickets, "w") as fh:
        fh.writelines([json.dumps({"format": NEWER}) + "\n"] + lines[1:])
    with pytest.raises(UnsupportedFormat) as exc:
        read_journal(tickets)
    _assert_names_file_and_versions(exc, tickets)


def test_a_manifest_written_now_carries_the_format(tmp_path):
    store = ShardStore(str(tmp_path), "fresh", 0, DurabilityConfig(str(tmp_path)), home=False)
    store.start_logs(None)
    store.checkpoint(ShardProgress(0, 0, {}), {"w": np.ones(2, np.float32)}, (), wait=True)
    assert store.latest()["format"] == FORMAT_VERSION
    store.close()


def test_a_server_on_a_folder_of_a_newer_format_exits_2_with_one_line_naming_the_file(format1_dir):
    entry = os.path.join(format1_dir, "sessions", "old-format", "session.json")
    _rewrite_json(entry, format=NEWER)
    process = _serve(format1_dir)
    started = time.monotonic()
    try:
        process.wait(timeout=180)
    finally:
        _stop(process)
    stderr_lines = [line for line in process.stderr.read().splitlines() if line.startswith("optserve")]
    assert process.returncode == 2, stderr_lines
    assert len(stderr_lines) == 1 and entry in stderr_lines[0] and f"version {NEWER}" in stderr_lines[0], stderr_lines
    assert time.monotonic() - started < 180
