"""The pieces of durability on their own (no Ray, no server): the checkpoint policy, the clock's
checkpoint marks and journal, the step log's framing, and checkpoints on disk."""

from __future__ import annotations

import json
import os
import time
import zlib

import numpy as np
import pytest

from optserve.server.domain.clock.home_clock import HomeClock, Ticket
from optserve.server.domain.config import DType, Mode, SessionConfig, TensorSpec
from optserve.server.storage import CorruptCheckpoint, ShardStore, read_step_log
from optserve.server.storage.format import SEGMENT_HEADER
from optserve.server.domain.durability import (MIN_DEFAULT_LOG_BYTES, CheckpointPolicy, DurabilityConfig, FsyncPolicy,
                                               LogIO, ShardProgress, StepRecord)
from optserve.server.domain.errors import InvalidArgument
from tests._store_helpers import log_step


def _config(mode=Mode.ASYNC) -> SessionConfig:
    return SessionConfig("units", (TensorSpec("w", DType.FLOAT32, (4, 3)), TensorSpec("b", DType.FLOAT32, (3,))),
                         "sgd", {"learning_rate": 0.1}, mode=mode)


def test_checkpoint_policy_is_due_by_steps_by_seconds_or_by_log_bytes():
    policy = CheckpointPolicy(every_steps=10, every_s=60.0, max_log_bytes=1000, step_bytes=300)
    assert not policy.due(0, 1e9)  # nothing new since the last one
    assert not policy.due(3, 1.0)
    assert policy.due(4, 1.0)  # 4 x 300 bytes >= 1000
    assert policy.due(1, 61.0)
    assert CheckpointPolicy(10, 60.0, 10**12, 1).due(10, 0.0)


def test_default_log_bound_is_twice_the_parameters_but_never_below_the_floor():
    config = DurabilityConfig("/tmp/x")
    assert config.policy(400 << 20).max_log_bytes == 800 << 20
    assert config.policy(1 << 10).max_log_bytes == MIN_DEFAULT_LOG_BYTES
    assert DurabilityConfig("/tmp/x", max_log_bytes=5).policy(1 << 30).max_log_bytes == 5


@pytest.mark.parametrize("kwargs, named", [({"every_steps": 0}, "--checkpoint-every-steps"),
                                           ({"every_s": 0}, "--checkpoint-every-s"),
                                           ({"fsync_every_steps": 0}, "--fsync-every-steps"),
                                           ({"checkpoint_dir": ""}, "--checkpoint-dir")])
def test_durability_options_are_validated_naming_the_flag(kwargs, named):
    with pytest.raises(InvalidArgument, match=named):
        DurabilityConfig(**{"checkpoint_dir": "/tmp/x", **kwargs})


def test_fsync_policy_flushes_every_step_every_n_or_only_at_checkpoints():
    assert DurabilityConfig("/d", fsync=FsyncPolicy.STEP).fsync_due(1)
    every_3 = DurabilityConfig("/d", fsync=FsyncPolicy.EVERY_N, fsync_every_steps=3)
    assert [every_3.fsync_due(n) for n in (1, 2, 3)] == [False, False, True]
    assert not DurabilityConfig("/d").fsync_due(10**6)


def test_clock_marks_checkpoint_due_steps_and_a_restored_clock_decides_the_same_tickets():
    journal: list = []
    policy = CheckpointPolicy(every_steps=3, every_s=1e9, max_log_bytes=10**12, step_bytes=1)
    clock = HomeClock(_config(), checkpoints=policy, journal=journal.append)
    tickets = [clock.commit("a", s, s - 1) for s in range(1, 8)]
    assert [t.checkpoint for t in tickets] == [False, False, True, False, False, True, False]
    assert [Ticket.from_json(e) for e in journal] == tickets  # every ticket journaled, in order
    state = clock.durable_state(lambda: None)
    journal.clear()
    later = [clock.commit("b", s, 7) for s in range(1, 4)]  # journaled after the checkpoint's state

    restored = HomeClock(_config(), checkpoints=policy)
    restored.restore(json.loads(json.dumps(state)), json.loads(json.dumps(journal)))
    assert restored.commit("b", 3, 7) == later[2]  # a retry gets the ticket it had
    assert restored.commit("a", 8, 7) == clock.commit("a", 8, 7)  # and new pushes the same decision
    import dataclasses

    # when each worker last pushed is not durable: a restored clock learns it afresh
    assert dataclasses.replace(restored.status(), last_activity_unix_s=0, workers=()) == dataclasses.replace(
        clock.status(), last_activity_unix_s=0, workers=())


def test_tickets_a_restore_settled_away_stay_forgotten_by_the_next_restore():
    """A restore settled the clock at version 2 (the shards logged no later step), forgetting
    tickets 3 and 4 that are still lines of the journal; then one new push was decided (3). A
    second restore from the same journal must not take the forgotten ticket 4 for a decided step
    (its version and history would hold a step no shard applied)."""
    journal: list = []
    clock = HomeClock(_config(), journal=journal.append)
    decided = [clock.commit("a", s, s - 1) for s in range(1, 5)]
    settled = HomeClock(_config(), journal=journal.append)
    settled.restore(None, list(journal), settle_at=(2, decided[2].ordinal))
    settled.journal_settled()
    fresh = settled.commit("b", 1, 2)
    assert (fresh.target_version, settled.status().version) == (3, 3)

    again = HomeClock(_config())
    again.restore(None, json.loads(json.dumps(journal)))
    assert again.status().version == 3
    assert [(r.version, r.participants) for r in again.history(0)] == [(1, ("a",)), (2, ("a",)), (3, ("b",))]
    assert again.commit("b", 1, 2) == fresh  # a retry of the new push gets its ticket
    assert again.commit("a", 4, 2).target_version == 4  # the forgotten push is decided afresh, after it


def test_a_settled_restore_forgets_the_cross_shard_sums_of_the_steps_it_forgot():
    """Step 3's sum was journaled, then the restore settled at 2: step 3 is decided afresh (maybe of
    other pushes), so its sum is reduced afresh, not answered from the journal."""
    import threading

    journal: list = []
    clock = HomeClock(_config(), participants=2, journal=journal.append)
    other = threading.Thread(target=clock.reduce_sum, args=(3, 1, 2.5))
    other.start()
    assert clock.reduce_sum(3, 0, 1.0) == 3.5
    other.join()
    restored = HomeClock(_config(), participants=2)
    restored.restore(None, journal, settle_at=(2, 0))
    results = {}
    other = threading.Thread(target=lambda: results.update(one=restored.reduce_sum(3, 1, 4.0)))
    other.start()
    results["zero"] = restored.reduce_sum(3, 0, 1.0)
    other.join()
    assert results == {"zero": 5.0, "one": 5.0}


def test_a_restarted_clock_answers_a_cross_shard_sum_from_its_journal():
    import threading

    journal: list = []
    clock = HomeClock(_config(), participants=2, journal=journal.append)
    results = {}
    other = threading.Thread(target=lambda: results.update(one=clock.reduce_sum(5, 1, 2.5)))
    other.start()
    results["zero"] = clock.reduce_sum(5, 0, 1.0)
    other.join()
    assert results == {"zero": 3.5, "one": 3.5}
    restored = HomeClock(_config(), participants=2)
    restored.restore(None, journal)
    assert restored.reduce_sum(5, 1, 2.5) == 3.5  # no wait for shard 0's part: it was summed before


def _store(tmp_path, home=True, **config) -> ShardStore:
    return ShardStore(str(tmp_path), "units", 0, DurabilityConfig(str(tmp_path), **config), home=home)


def _grads(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((4, 3)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}


def _buffers() -> dict:
    return {"w": np.empty((4, 3), np.float32), "b": np.empty(3, np.float32)}


def test_step_log_reads_back_every_record_and_ends_at_a_torn_tail(tmp_path):
    store = _store(tmp_path)
    store.start_logs(None)
    written = [_grads(i) for i in range(3)]
    for i, grads in enumerate(written):
        log_step(store.log, StepRecord(i + 1, ((i, "c", i + 1),), 1.0, 0.5 * i), list(grads.values()))
    store.log.wait_logged(3)
    (segment,) = store.log.segments(None)
    with open(segment, "ab") as fh:  # a crash in the middle of a fourth record
        fh.write(b"OSLR" + (60).to_bytes(8, "little") + b"\0" * 20)
    records = list(read_step_log(segment, _buffers))
    assert [StepRecord.from_json(h).version for h, _ in records] == [1, 2, 3]
    for (header, grads), expected in zip(records, written):
        assert all(np.array_equal(grads[k], expected[k]) for k in expected)
    assert StepRecord.from_json(records[2][0]).global_stat == 1.0
    store.close()


def test_step_whose_update_failed_is_skipped_on_replay_and_later_steps_still_read(tmp_path):
    store = _store(tmp_path)
    store.start_logs(None)
    log_step(store.log, StepRecord(1, ((0, "c", 1),), 1.0, 0.0), list(_grads(0).values()))
    store.log.begin_step(list(_grads(99).values()))  # its payload is written while the update runs ...
    store.log.abort_step()  # ... which fails: the record is marked, not applied
    store.log.begin_step(list(_grads(1).values()))
    store.log.end_step(StepRecord(2, ((1, "c", 2),), 1.0, 0.0))
    store.log.wait_logged(2)
    (segment,) = store.log.segments(None)
    records = list(read_step_log(segment, _buffers))
    assert [StepRecord.from_json(h).version for h, _ in records] == [1, 2]
    assert all(np.array_equal(records[1][1][k], _grads(1)[k]) for k in ("w", "b"))
    assert store.log.records == 2
    store.close()


def test_step_log_damaged_before_its_end_is_reported_not_replayed(tmp_path):
    store = _store(tmp_path, log_io=LogIO.BUFFERED)  # the byte offsets below: records written through the page cache
    store.start_logs(None)
    for i in range(2):
        log_step(store.log, StepRecord(i + 1, ((i, "c", i + 1),), 1.0, 0.0), list(_grads(i).values()))
    store.log.wait_logged(2)
    (segment,) = store.log.segments(None)
    with open(segment, "r+b") as fh:
        fh.seek(SEGMENT_HEADER.size + 4 + 8 + 60 + 4 + 5)  # inside the first record's header (after the segment header)
        fh.write(b"#")
    with pytest.raises(CorruptCheckpoint, match="damaged"):
        list(read_step_log(segment, _buffers))
    store.close()


def test_checkpoint_round_trips_and_truncates_the_log_and_a_damaged_one_is_refused(tmp_path):
    import jax

    store = _store(tmp_path)
    store.start_logs(None)
    params = {"b": np.arange(3, dtype=np.float32), "w": np.ones((4, 3), np.float32)}
    state = ({"b": np.zeros(3, np.float32), "w": np.full((4, 3), 2.0, np.float32)}, np.array(7, np.int32))
    log_step(store.log, StepRecord(1, ((0, "c", 1),), 1.0, 0.0), list(_grads(0).values()))
    store.checkpoint(ShardProgress(1, 1, {"c": 1}), params, state,
                     clock_state_fn=lambda rotate: (rotate(), {"version": 1})[1], wait=True)
    manifest = store.latest()
    assert manifest["progress"] == {"version": 1, "next_ordinal": 1, "applied_sequence": {"c": 1}}
    assert manifest["clock"] == {"version": 1} and store.durable_version == 1
    assert store.log.segments(manifest) == [os.path.join(store.folder, "steps-1.log")]  # segment 0 deleted
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), {"params": params, "opt_state": state})
    restored = store.restore_arrays(manifest, abstract)
    assert np.array_equal(restored["params"]["b"], params["b"]) and int(restored["opt_state"][1]) == 7
    assert "crc32c" in manifest
    older = {k: v for k, v in manifest.items() if k != "crc32c"}  # written before CRC-32C: zlib's CRC-32
    older["crc32"] = [zlib.crc32(np.ascontiguousarray(a)) for a in jax.tree.leaves({"params": params, "opt_state": state})]
    assert np.array_equal(store.restore_arrays(older, abstract)["params"]["w"], params["w"])
    manifest["crc32c"][0] ^= 1  # as if the arrays on disk had changed
    with pytest.raises(CorruptCheckpoint, match="checksums"):
        store.restore_arrays(manifest, abstract)
    older["crc32"][1] ^= 1
    with pytest.raises(CorruptCheckpoint, match="checksums"):
        store.restore_arrays(older, abstract)
    store.close()


def test_a_checkpoint_holds_the_state_of_its_version_while_later_steps_reuse_the_buffers(tmp_path):
    """The snapshot is a copy: the update goes on donating (overwriting) its buffers while the
    checkpoint is written in the background, and the checkpoint still holds its own version."""
    import threading

    import jax

    store = _store(tmp_path)
    store.start_logs(None)
    params = {"b": np.arange(3, dtype=np.float32), "w": np.ones((4, 3), np.float32)}
    state = ({"b": np.zeros(3, np.float32), "w": np.full((4, 3), 2.0, np.float32)}, np.array(7, np.int32))
    expected = jax.tree.map(np.copy, {"params": params, "opt_state": state})
    writer_free = threading.Event()
    store._writer.submit(writer_free.wait)  # the writer is busy: the checkpoint waits its turn
    store.checkpoint(ShardProgress(1, 1, {"c": 1}), params, state, clock_state_fn=lambda rotate: (rotate(), {})[1])
    for leaf in jax.tree.leaves({"params": params, "opt_state": state}):  # later steps, in place
        leaf[...] = -1
    writer_free.set()
    store.wait()
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), expected)
    restored = store.restore_arrays(store.latest(), abstract)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(expected)))
    store.close()


def test_a_record_of_more_tensors_than_one_writev_takes_is_logged_whole(tmp_path):
    """writev takes at most IOV_MAX (1024) buffers: a shard with thousands of tensors (and empty
    ones among them) still logs every byte of every step."""
    store = _store(tmp_path)
    store.start_logs(None)
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(5).astype(np.float32) if i % 7 else np.zeros(0, np.float32) for i in range(3000)]
    log_step(store.log, StepRecord(1, ((0, "c", 1),), 1.0, 0.0), grads)
    store.log.wait_logged(1)
    (segment,) = store.log.segments(None)
    buffers = lambda: {str(i): np.empty(g.shape, np.float32) for i, g in enumerate(grads)}  # noqa: E731
    ((header, read),) = list(read_step_log(segment, buffers))
    assert StepRecord.from_json(header).version == 1
    assert all(np.array_equal(read[str(i)], g) for i, g in enumerate(grads))
    store.close()


def _direct_io_grads(seed: int) -> dict:
    """Gradients as a shard holds them, in every shape direct I/O meets: page-aligned memory of
    whole blocks, page-aligned memory with a partial last block, memory that is not page aligned
    (written through the page cache), an empty tensor and a tiny one."""
    from optserve.server.compute.buffers import IO_ALIGNMENT, aligned_empty

    rng = np.random.default_rng(seed)
    whole, partial = aligned_empty((3, 4096), np.float32, IO_ALIGNMENT), aligned_empty((5000,), np.float32, IO_ALIGNMENT)
    whole[...] = rng.standard_normal(whole.shape)
    partial[...] = rng.standard_normal(partial.shape)
    unaligned = aligned_empty((2049,), np.float32, IO_ALIGNMENT)[1:]
    unaligned[...] = rng.standard_normal(unaligned.shape)
    return {"whole": whole, "partial": partial, "unaligned": unaligned, "empty": np.zeros((0, 3), np.float32),
            "tiny": rng.standard_normal(3).astype(np.float32)}


def _direct_io_buffers() -> dict:
    return {name: np.empty(g.shape, np.float32) for name, g in _direct_io_grads(0).items()}


def test_direct_io_step_log_reads_back_every_kind_of_tensor_and_ends_at_a_torn_tail(tmp_path):
    """--log-io direct: payloads block aligned in the file (the page-aligned bulk of a tensor goes
    by direct I/O, the rest through the page cache); records read back exactly, an aborted one is
    skipped, and a crash inside a record ends the log there."""
    store = _store(tmp_path, log_io=LogIO.DIRECT)
    store.start_logs(None)
    assert store.log.writes_direct  # the test folder's filesystem takes O_DIRECT
    written = [_direct_io_grads(i) for i in range(3)]
    log_step(store.log, StepRecord(1, ((0, "c", 1),), 1.0, 0.0), list(written[0].values()))
    store.log.begin_step(list(_direct_io_grads(99).values()))
    store.log.abort_step()
    for i in (1, 2):
        log_step(store.log, StepRecord(i + 1, ((i, "c", i + 1),), 1.0, 0.0), list(written[i].values()))
    store.log.wait_logged(3)
    # by direct I/O: the whole-block tensor and the partial one's whole blocks, in each of the 4 records
    assert store.log.direct_bytes == 4 * (3 * 4096 * 4 + 4 * 4096)
    (segment,) = store.log.segments(None)
    raw = open(segment, "rb").read()
    first = raw.index(written[2]["whole"].tobytes())  # the last record's page-aligned tensor ...
    assert first % 4096 == 0  # ... starts a block of the file
    records = list(read_step_log(segment, _direct_io_buffers))
    assert [StepRecord.from_json(h).version for h, _ in records] == [1, 2, 3]
    for (_, grads), expected in zip(records, written):
        assert all(np.array_equal(grads[k], expected[k]) for k in expected)
    store.close()
    with open(segment, "r+b") as fh:  # a crash while the last record's payload was being written
        fh.truncate(first + 4096)
    assert [StepRecord.from_json(h).version for h, _ in read_step_log(segment, _direct_io_buffers)] == [1, 2]


def test_a_direct_io_log_goes_on_after_a_checkpoint_in_a_fresh_segment(tmp_path):
    store = _store(tmp_path, log_io=LogIO.DIRECT)
    store.start_logs(None)
    params = {"b": np.arange(3, dtype=np.float32)}
    log_step(store.log, StepRecord(1, ((0, "c", 1),), 1.0, 0.0), list(_direct_io_grads(0).values()))
    store.checkpoint(ShardProgress(1, 1, {"c": 1}), params, (), clock_state_fn=lambda rotate: (rotate(), {})[1],
                     wait=True)
    assert store.log.writes_direct
    log_step(store.log, StepRecord(2, ((1, "c", 2),), 1.0, 0.0), list(_direct_io_grads(1).values()))
    store.log.wait_logged(2)
    (segment,) = store.log.segments(store.latest())
    ((header, grads),) = list(read_step_log(segment, _direct_io_buffers))
    assert StepRecord.from_json(header).version == 2
    assert all(np.array_equal(grads[k], v) for k, v in _direct_io_grads(1).items())
    store.close()


def test_replay_reads_keep_reading_until_a_tensor_is_full():
    """One read returns at most ~2 GiB (and a pipe less): replay reads each tensor until it is
    full or the file ends, or a big tensor would look like a torn record."""
    import threading

    from optserve.server.storage.log_reader import read_fully as _read_fully

    data = np.random.default_rng(5).standard_normal(50_000).astype(np.float32)
    read_end, write_end = os.pipe()

    def trickle():  # the bytes arrive in small pieces
        raw = data.tobytes()
        for start in range(0, len(raw), 4096):
            os.write(write_end, raw[start:start + 4096])
        os.close(write_end)

    writer = threading.Thread(target=trickle)
    writer.start()
    target = np.empty(60_000, np.float32)
    with open(read_end, "rb", buffering=0) as fh:
        got = _read_fully(fh, memoryview(target).cast("B"))
    writer.join()
    assert got == data.nbytes  # everything there was, then the end of the file
    assert np.array_equal(target[:50_000], data)


@pytest.mark.parametrize("first_failure", ["vote-timeout", "peer-down"])
def test_a_push_whose_vote_failed_for_a_missing_shard_commits_when_retried(first_failure):
    """A round decided without a shard's vote (it never staged in time, or it died) is one the
    client retries: the retry's votes meet in a fresh round, whichever shard votes first. (The
    missing shard's next vote used to take the old round's refusal while the other's opened a
    round that waited in vain, so every retry failed the same way.)"""
    import concurrent.futures

    from optserve.server.domain.errors import PeerRefused, Unavailable

    clock = HomeClock(_config(), participants=2)
    if first_failure == "vote-timeout":
        with pytest.raises(PeerRefused, match="did not vote"):
            clock.vote("c", 1, 0, 1, True, timeout_s=0.2)  # shard 0 never staged this attempt
    else:
        clock.peer_down(0, Unavailable("shard 0 is restarting"))
        with pytest.raises(Unavailable):
            clock.vote("c", 1, 0, 1, True, timeout_s=5.0)
        clock.peer_up(0)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the retry: the missing shard votes first
        home = pool.submit(clock.vote, "c", 1, 0, 0, True, 5.0)
        time.sleep(0.1)
        other = pool.submit(clock.vote, "c", 1, 0, 1, True, 5.0)
        tickets = home.result(timeout=10), other.result(timeout=10)
    assert tickets[0] == tickets[1] and tickets[0].target_version == 1
