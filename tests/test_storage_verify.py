"""``optserve checkpoint verify``'s checks, offline on real files: intact, torn and corrupt."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from optserve.server.domain.durability import DurabilityConfig, LogIO, ShardProgress, StepRecord
from optserve.server.storage import SessionCatalog, ShardStore
from optserve.server.storage.verify import CORRUPT, INTACT, TORN, verify_directory
from tests._store_helpers import log_step

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "format1" / "ckpt"
SHAPES = {"w": (4, 3), "b": (3,)}


def _write_session(root: str) -> ShardStore:
    """A one-shard session with a checkpoint at 0 and three logged steps (the store is closed)."""
    SessionCatalog(root).save("s", {"config": {"tensors": [[n, "FLOAT32", list(s)] for n, s in SHAPES.items()]},
                                    "placement": {"0": list(SHAPES)}})
    store = ShardStore(root, "s", 0, DurabilityConfig(root, log_io=LogIO.BUFFERED), home=True)  # plain offsets
    store.start_logs(None)
    params = {n: np.ones(s, np.float32) for n, s in SHAPES.items()}
    store.checkpoint(ShardProgress(0, 0, {}), params, (), clock_state_fn=lambda rotate: (rotate(), {})[1], wait=True)
    for i in range(3):
        store.log.journal_entry([i, "c", i + 1, 0, 1.0, True, i + 1, False])
        log_step(store.log, StepRecord(i + 1, ((i, "c", i + 1),), 1.0, 0.0),
                       [np.full(s, i, np.float32) for s in SHAPES.values()])
    store.log.wait_logged(3)
    store.close()
    return store


def _states(report) -> dict[str, str]:
    return {os.path.basename(f.path): f.state for f in report.files}


def test_an_intact_directory_verifies_clean_including_format_1(tmp_path):
    store = _write_session(str(tmp_path))
    report = verify_directory(str(tmp_path))
    assert report.exit_status == 0 and set(_states(report).values()) == {INTACT}
    assert any("steps 1-3" in f.detail for f in report.files)
    shutil.copytree(FIXTURE, tmp_path / "old")
    old = verify_directory(str(tmp_path / "old"))
    assert old.exit_status == 0 and old.counts()[INTACT] >= 6
    assert store.folder


def test_a_torn_tail_is_torn_and_a_damaged_record_is_corrupt(tmp_path):
    store = _write_session(str(tmp_path))
    (segment,) = store.log.segments(None)
    size = os.path.getsize(segment)
    os.truncate(segment, size - 7)
    report = verify_directory(str(tmp_path))
    assert _states(report)[os.path.basename(segment)] == TORN and report.exit_status == 1
    with open(segment, "r+b") as fh:  # a byte of the first record's gradient
        fh.seek(8 + 12 + 5)
        byte = fh.read(1)
        fh.seek(8 + 12 + 5)
        fh.write(bytes([byte[0] ^ 0xFF]))
    report = verify_directory(str(tmp_path))
    verdict = next(f for f in report.files if f.path == segment)
    assert verdict.state == CORRUPT and "byte 8" in verdict.detail and report.exit_status == 3


def test_a_damaged_checkpoint_array_and_a_missing_definition_are_corrupt(tmp_path):
    store = _write_session(str(tmp_path))
    for folder, _, names in os.walk(os.path.join(store.folder, "checkpoint-0")):
        for name in names:
            path = os.path.join(folder, name)
            if f"{os.sep}d{os.sep}" in path:
                with open(path, "r+b") as fh:
                    fh.seek(os.path.getsize(path) // 2)
                    fh.write(b"\x00\xff\x00\xff")
    os.makedirs(tmp_path / "sessions" / "orphan")
    report = verify_directory(str(tmp_path))
    states = {f.path: f.state for f in report.files}
    assert states[os.path.join(store.folder, "checkpoint-0")] == CORRUPT
    assert states[str(tmp_path / "sessions" / "orphan")] == CORRUPT
    assert report.exit_status == 3


def test_a_folder_that_is_not_a_checkpoint_directory_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="not an optserve checkpoint directory"):
        verify_directory(str(tmp_path))


def _verify_cli(directory: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "optserve.server.cli", "checkpoint", "verify", directory],
                          capture_output=True, text=True, timeout=120)


def test_the_verify_command_prints_each_file_and_exits_with_what_it_found(tmp_path):
    store = _write_session(str(tmp_path))
    intact = _verify_cli(str(tmp_path))
    assert intact.returncode == 0, intact.stderr
    assert all(line.split()[0] == "intact" for line in intact.stdout.splitlines()[:-1])
    (segment,) = store.log.segments(None)
    os.truncate(segment, os.path.getsize(segment) - 7)
    torn = _verify_cli(str(tmp_path))
    assert torn.returncode == 1 and f"torn     {segment}" in torn.stdout, torn.stdout
    assert torn.stdout.splitlines()[-1].endswith("1 torn, 0 corrupt")
    refused = _verify_cli(str(tmp_path / "nowhere"))
    assert refused.returncode == 2 and refused.stdout == ""
    assert len(refused.stderr.strip().splitlines()) == 1 and "not an optserve checkpoint directory" in refused.stderr
