"""A session clock's record of each version, in every mode (no Ray, no server): what each record
holds, its bound, and a restored clock (checkpoint state + ticket journal) answering the same
history. The same behaviour through a real server: tests/test_history_modes.py,
tests/test_history_durable.py."""

from __future__ import annotations

import json

from optserve.protos.status_records import RoundRecord
from optserve.server.domain.clock.home_clock import HomeClock
from optserve.server.domain.clock.version_history import VersionHistory
from optserve.server.domain.config import DType, Mode, SessionConfig, StalenessPolicy, TensorSpec


def _config(mode: Mode, num_workers: int = 1, **kwargs) -> SessionConfig:
    return SessionConfig("history", (TensorSpec("w", DType.FLOAT32, (4,)),), "sgd", {"learning_rate": 0.1},
                         mode=mode, num_workers=num_workers, **kwargs)


def _record(version: int) -> RoundRecord:
    return RoundRecord(version, ("a",), (1.0,), (), 0.0, "push", ("a/1",), (version,), (0,))


def test_sync_clock_records_each_round_with_its_pushes_in_ticket_order():
    clock = HomeClock(_config(Mode.SYNC, num_workers=2))
    for version in range(2):
        clock.commit("b/x", version + 1, version)
        clock.commit("a/y", version + 1, version)
    first, second = clock.history(0)
    assert (first.version, first.participants, first.clients, first.sequences) == (1, ("b", "a"), ("b/x", "a/y"),
                                                                                   (1, 1))
    assert (first.scales, first.staleness, first.base_versions, first.closed_by) == ((1.0, 1.0), (0, 0), (0, 0),
                                                                                     "num_workers")
    assert second.version == 2 and second.base_versions == (1, 1)
    assert clock.history(1) == [second]  # paged by version


def test_async_clock_records_each_push_with_its_base_version_staleness_and_scale():
    clock = HomeClock(_config(Mode.ASYNC, staleness_policy=StalenessPolicy.SCALE))
    clock.commit("a/1", 1, 0)  # -> 1, fresh
    clock.commit("b/1", 1, 0)  # -> 2, one version stale
    clock.commit("a/1", 2, 2)  # -> 3
    clock.commit("b/1", 2, 1)  # -> 4, two versions stale
    history = clock.history(0)
    assert [r.version for r in history] == [1, 2, 3, 4]
    assert [r.clients for r in history] == [("a/1",), ("b/1",), ("a/1",), ("b/1",)]
    assert [r.sequences for r in history] == [(1,), (1,), (2,), (2,)]
    assert [r.base_versions for r in history] == [(0,), (0,), (2,), (1,)]
    assert [r.staleness for r in history] == [(0,), (1,), (0,), (2,)]
    assert [r.scales for r in history] == [(1.0,), (0.5,), (1.0,), (1.0 / 3.0,)]
    assert {r.closed_by for r in history} == {"push"}


def test_history_keeps_only_the_latest_versions():
    history = VersionHistory(keep=3)
    for version in range(1, 6):
        history.keep(_record(version))
    assert [r.version for r in history.since(0)] == [3, 4, 5]
    history.keep(_record(4))  # a journaled record replaces the one rebuilt for its version
    history.forget_after(4)
    assert [r.version for r in history.since(0)] == [3, 4]


def test_a_restored_clock_answers_the_same_history_with_a_round_open_across_its_checkpoint():
    """Checkpoint state taken while a sync round is half decided, then the rest of the journal:
    the restored clock's records equal the running clock's, the straddling round whole."""
    for config in (_config(Mode.SYNC, num_workers=2), _config(Mode.ASYNC, staleness_policy=StalenessPolicy.SCALE)):
        journal: list = []
        clock = HomeClock(config, journal=journal.append)
        clock.commit("a/1", 1, 0), clock.commit("b/1", 1, 0)
        clock.commit("a/1", 2, 1 if config.mode is Mode.SYNC else 0)  # sync: opens round 2
        state = json.loads(json.dumps(clock.durable_state(journal.clear)))
        clock.commit("b/1", 2, 1)
        clock.commit("a/1", 3, 2 if config.mode is Mode.SYNC else 1)
        assert [r.version for r in clock.history(0)] == ([1, 2] if config.mode is Mode.SYNC else [1, 2, 3, 4, 5])
        restored = HomeClock(config)
        restored.restore(state, json.loads(json.dumps(journal)))
        assert restored.history(0) == clock.history(0), config.mode
        if config.mode is Mode.SYNC:
            assert restored.history(1)[0].clients == ("a/1", "b/1")
        restored.restore(state, [], settle_at=(1, 2))  # a whole-server restore at version 1: later records go
        assert [r.version for r in restored.history(0)] == [1]


def test_only_records_their_tickets_cannot_rebuild_are_journaled():
    """A sync round of several pushes journals its record (its duration); an async push's record
    and a one-push sync step's are their tickets', and a restored clock rebuilds them exactly."""
    for config, rounds_journaled in ((_config(Mode.SYNC, num_workers=2), 2), (_config(Mode.SYNC), 0),
                                     (_config(Mode.ASYNC), 0)):
        journal: list = []
        clock = HomeClock(config, journal=journal.append)
        for version in range(2):
            for client in ("a/1", "b/1")[:config.num_workers]:
                clock.commit(client, version + 1, version)
        assert sum(isinstance(e, dict) and "round" in e for e in journal) == rounds_journaled
        restored = HomeClock(config)
        restored.restore(None, json.loads(json.dumps(journal)))
        assert restored.history(0) == clock.history(0) and len(clock.history(0)) == 2


def test_records_of_one_client_share_its_strings_and_carry_no_instance_dict():
    """A home shard keeps thousands of records per session naming the same few clients: each
    client id and worker id is one string object across them (also after a restore from JSON),
    and a record has no per-instance dict."""
    clock = HomeClock(_config(Mode.SYNC, num_workers=2))
    for version in range(3):  # each request's client id arrives as a new string
        clock.commit("".join(["b", "/x"]), version + 1, version)
        clock.commit("".join(["a", "/y"]), version + 1, version)
    first, _, third = clock.history(0)
    assert first.clients == third.clients and all(a is b for a, b in zip(first.clients, third.clients))
    assert all(a is b for a, b in zip(first.participants, third.participants))
    restored = [RoundRecord.from_json(json.loads(json.dumps(r.to_json()))) for r in (first, third)]
    assert restored == [first, third] and restored[0].clients[0] is restored[1].clients[0]
    assert not hasattr(first, "__dict__")
