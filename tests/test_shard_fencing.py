"""Fencing a replaced shard (server/storage/ownership.py): once the server claims a newer
ownership epoch for a shard, the process holding the older one writes nothing more of the
session's files (no log record, no journal line, no checkpoint, no deletion) and acknowledges
nothing; a real shard actor so superseded exits on its own, and its replacement trains on exactly.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from optserve.server.domain.durability import DurabilityConfig, ShardProgress, StepRecord
from optserve.server.storage import ShardStore, read_step_log
from optserve.server.storage.manifests import checkpoint_versions
from optserve.server.storage.ownership import ShardFence, Superseded, claim_shard, current_epoch
from tests._store_helpers import log_step


def _fenced_store(root: str, epoch: int) -> ShardStore:
    fence = ShardFence(root, 0, epoch)
    return ShardStore(root, "fenced", 0, DurabilityConfig(root), home=True, fence=fence)


def _grads(seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal(3).astype(np.float32)]


def _buffers() -> dict:
    return {"w": np.empty((4, 3), np.float32), "b": np.empty(3, np.float32)}


def _sizes(folder: str) -> dict:
    return {name: os.path.getsize(os.path.join(folder, name)) for name in sorted(os.listdir(folder))
            if name.endswith(".log")}


def test_claims_raise_the_epoch_durably_one_at_a_time(tmp_path):
    root = str(tmp_path)
    assert current_epoch(root, 3) == 0
    assert [claim_shard(root, 3) for _ in range(3)] == [1, 2, 3]
    assert current_epoch(root, 3) == 3 and current_epoch(root, 2) == 0
    ShardFence(root, 3, 3).check("a write")  # the current owner passes
    with pytest.raises(Superseded, match=r"shard 3 was replaced \(ownership epoch 3, this process holds 2\)"):
        ShardFence(root, 3, 2).check("a write")


def test_a_superseded_store_writes_no_record_journal_line_or_checkpoint(tmp_path):
    root = str(tmp_path)
    store = _fenced_store(root, claim_shard(root, 0))
    store.start_logs(None)
    log_step(store.log, StepRecord(1, ((0, "c", 1),), 1.0, 0.0), _grads(1))
    store.log.journal_entry({"ticket": 1})
    store.log.wait_logged(1)
    before = _sizes(store.folder)

    claim_shard(root, 0)  # the server replaced this shard (it was cut off): a newer owner exists
    log_step(store.log, StepRecord(2, ((1, "c", 2),), 1.0, 0.0), _grads(2))
    with pytest.raises(OSError, match="shard 0 was replaced"):
        store.log.wait_logged(2)  # never acknowledged
    with pytest.raises(Superseded):
        store.log.journal_entry({"ticket": 2})
    params, state = {"b": np.zeros(3, np.float32), "w": np.zeros((4, 3), np.float32)}, (np.array(1, np.int32),)
    with pytest.raises(Superseded):  # not even a fresh segment for it
        store.checkpoint(ShardProgress(1, 1, {"c": 1}), params, state,
                         clock_state_fn=lambda rotate: (rotate(), {"version": 1})[1], wait=True)

    assert checkpoint_versions(store.folder) == set() and store.latest() is None  # no checkpoint committed
    assert _sizes(store.folder) == before  # not one byte more, not one file more
    (first,) = [os.path.join(store.folder, n) for n in before if n.startswith("steps-")]
    assert [StepRecord.from_json(h).version for h, _ in read_step_log(first, _buffers)] == [1]
    store.close()


def test_the_current_owner_writes_on_after_an_older_owner_is_fenced(tmp_path):
    root = str(tmp_path)
    old = _fenced_store(root, claim_shard(root, 0))
    old.start_logs(None)
    log_step(old.log, StepRecord(1, ((0, "c", 1),), 1.0, 0.0), _grads(1))
    old.log.wait_logged(1)
    new = _fenced_store(root, claim_shard(root, 0))
    new.start_logs(None, 1)
    log_step(new.log, StepRecord(2, ((1, "c", 2),), 1.0, 0.0), _grads(2))
    new.log.wait_logged(2)
    log_step(old.log, StepRecord(2, ((1, "c", 2),), 1.0, 0.0), _grads(99))  # the old one's stray step
    with pytest.raises(OSError, match="replaced"):
        old.log.wait_logged(2)
    versions = [StepRecord.from_json(h).version for s in new.log.segments(None) for h, _ in read_step_log(s, _buffers)]
    assert versions == [1, 2]
    old.close()
    new.close()


def test_a_late_record_of_a_replaced_owner_past_its_successors_seal_is_no_part_of_the_log(tmp_path):
    """The race the checks leave: the old owner passed its check just before the claim and its
    record lands after the new owner read the log. The new owner's fresh segment is sealed to
    start after the version it restored, so that record never counts (here: the log reaches 2,
    not the stray 3; the new owner's own step 3 then does)."""
    root = str(tmp_path)
    old = _fenced_store(root, claim_shard(root, 0))
    old.start_logs(None)
    params, state = {"b": np.zeros(3, np.float32), "w": np.zeros((4, 3), np.float32)}, (np.array(0, np.int32),)
    old.checkpoint(ShardProgress(0, 0, {}), params, state, clock_state_fn=lambda rotate: (rotate(), {})[1], wait=True)
    for version in (1, 2):
        log_step(old.log, StepRecord(version, ((version, "c", version),), 1.0, 0.0), _grads(version))
    old.log.wait_logged(2)
    new = _fenced_store(root, claim_shard(root, 0))
    new.start_logs(new.latest(), 2)  # restored up to 2: its own records go to a fresh, sealed segment
    old.log._steps.write_payload(_grads(99))  # the old owner's write that was under way at the claim
    old.log._steps.write_record_end(json.dumps(StepRecord(3, ((3, "c", 3),), 1.0, 0.0).to_json()).encode())

    def reach() -> int:
        reader = ShardStore(root, "fenced", 0, DurabilityConfig(root), home=False)
        try:
            return reader.reachable(_buffers).logged_version
        finally:
            reader.close()

    assert reach() == 2
    with open(old.log.segments(None)[-2], "ab") as fh:  # more of the old owner's bytes, half a record
        fh.write(b"OSLR" + bytes(40))
    assert reach() == 2  # never read: no CorruptCheckpoint for what lies past the seal
    log_step(new.log, StepRecord(3, ((3, "c", 3),), 1.0, 0.0), _grads(3))
    new.log.wait_logged(3)
    assert reach() == 3
    old.close()
    new.close()


def test_a_replaced_owner_never_rotates_into_its_successors_segment(tmp_path):
    """The old owner passed its check just before the claim and rotates (a checkpoint) after its
    successor opened its fresh segment: it does not open that segment (nor remove it)."""
    root = str(tmp_path)
    old = ShardStore(root, "fenced", 0, DurabilityConfig(root), home=True)  # its check passed: no fence to stop it
    old.start_logs(None)
    log_step(old.log, StepRecord(1, ((1, "c", 1),), 1.0, 0.0), _grads(1))
    old.log.wait_logged(1)
    new = _fenced_store(root, claim_shard(root, 0))
    new.start_logs(None, 1)
    log_step(new.log, StepRecord(2, ((2, "c", 2),), 1.0, 0.0), _grads(2))
    new.log.wait_logged(2)
    successor = new.log.segments(None)[-1]
    size = os.path.getsize(successor)
    params, state = {"b": np.zeros(3, np.float32), "w": np.zeros((4, 3), np.float32)}, (np.array(1, np.int32),)
    with pytest.raises(FileExistsError):
        old.checkpoint(ShardProgress(1, 1, {"c": 1}), params, state,
                       clock_state_fn=lambda rotate: (rotate(), {})[1], wait=True)
    assert os.path.getsize(successor) == size and old.latest() is None
    versions = [StepRecord.from_json(h).version for h, _ in read_step_log(successor, _buffers)]
    assert versions == [2]
    old.close()
    new.close()


def test_a_superseded_shard_actor_exits_and_its_replacement_trains_on_exactly(ray_local, tmp_path, unique_name):
    """The claim a replacement makes, made while the shard is alive and idle: it exits within its
    watch period (not at its next write), the server's watch replaces it, and the session goes
    on from the checkpoint and log, equal to an uninterrupted run."""
    from optserve.client import Client
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig
    from tests._service_helpers import InProcess, make_grads, make_params

    root = str(tmp_path / "checkpoints")
    running = start_server(ServerConfig(host="127.0.0.1", port=0, shards=2, min_shard_bytes=0,
                                        durability=DurabilityConfig(root, every_steps=3)))
    try:
        optimizer = {"name": "adam", "args": {"learning_rate": 0.01}}
        params = make_params(5, {"a": (40, 30), "b": (30,), "c": (30, 20), "d": (20,)})
        reference = InProcess(optimizer["name"], optimizer["args"], params)
        with Client(running.address, timeout=60.0) as client:
            session = client.create_session(unique_name, params, optimizer=optimizer)
            for step in range(4):
                session.push_pull(make_grads(params, step))
                reference.step(make_grads(params, step))
            pid = running.fleet.pids()[1]
            epoch = current_epoch(root, 1)
            claim_shard(root, 1)
            deadline = time.monotonic() + 10.0
            while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not os.path.exists(f"/proc/{pid}"), "the superseded shard is still running"
            for step in range(4, 8):
                got = session.push_pull(make_grads(params, step))
                expected = reference.step(make_grads(params, step))
            for name in params:
                np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=1e-6)
            assert running.fleet.pids()[1] != pid and current_epoch(root, 1) == epoch + 2  # the watch's own claim
            session.close()
    finally:
        running.stop()
