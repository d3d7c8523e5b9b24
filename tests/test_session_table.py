"""The coordinator's session table and consistent restore, without Ray: each session's state and
its transitions (server/domain/sessions/session_table.py), the records built from a placement
(session_records.py), and the choice of the one version every shard restores to (session_restore.py)."""

from __future__ import annotations

import threading

import pytest

from optserve.server.domain.config import DType, SessionConfig, TensorSpec
from optserve.server.domain.errors import AlreadyExists, NotFound, PermissionDenied
from optserve.server.domain.sessions.session_records import SessionRecord
from optserve.server.domain.sessions.session_restore import common_version
from optserve.server.domain.sessions.session_table import SessionState, SessionTable


def _record(name: str = "s", owner: str = "alice") -> SessionRecord:
    config = SessionConfig(name, (TensorSpec("w", DType.FLOAT32, (4, 3)), TensorSpec("b", DType.FLOAT32, (3,))),
                           "adam", {})
    return SessionRecord.placed(config, [(0, ("w",)), (1, ("b",))], ["h:0", "h:1"], owner)


def test_a_placed_record_builds_its_openings_and_estimate_from_one_placement():
    record = _record()
    assert [(a.shard_index, a.address, a.tensor_names, a.param_bytes) for a in record.assignments] == [
        (0, "h:0", ("w",), 48), (1, "h:1", ("b",), 12)]
    openings = record.openings(["c:0", "c:1"])
    assert [(o.shard_index, o.participants, o.home_clock) for o in openings] == [(0, 2, None), (1, 2, "c:0")]
    estimated = record.estimated_bytes(workers=False)
    assert set(estimated) == {0, 1} and estimated[0] > 48 and estimated[1] > 12


def test_an_opening_session_takes_its_name_and_its_memory_but_no_call_finds_it_until_opened():
    table = SessionTable()
    table.opening(_record(), {0: 10})
    with pytest.raises(AlreadyExists):
        table.wait_until_free("s", closing_s=0.0, opening_s=0.0)
    with pytest.raises(AlreadyExists):  # a second create that got past the wait
        table.opening(_record(), {0: 10})
    with pytest.raises(NotFound):
        table.owned("s", "alice")
    # other creates, placed while it opens, count it: budget, placement and the tenant's sessions
    assert table.records() == {} and table.estimated_on(0) == 10 and table.shard_loads(2) == [48, 12]
    assert table.held_by("alice") == 1 and table.held_by("bob") == 0
    table.opened("s")
    assert table.owned("s", "alice").state is SessionState.LIVE and table.estimated_on(0) == 10


def _create_in_a_thread(table: SessionTable) -> tuple[threading.Thread, list[str]]:
    """A create of "s" waiting for the name (up to 60 s): its outcome, "free" or "exists", once it ends."""
    outcome: list[str] = []

    def create():
        try:
            table.wait_until_free("s", closing_s=60.0, opening_s=60.0)
            outcome.append("free")
        except AlreadyExists:
            outcome.append("exists")

    waiting = threading.Thread(target=create)
    waiting.start()
    return waiting, outcome


def test_a_create_of_an_opening_name_waits_for_it_to_be_opened_then_finds_it():
    table = SessionTable()
    table.opening(_record(), {0: 10})
    waiting, outcome = _create_in_a_thread(table)
    waiting.join(0.3)
    assert waiting.is_alive() and outcome == []  # still opening: it waits
    table.opened("s")
    waiting.join(10)
    assert outcome == ["exists"] and table.owned("s", "alice").state is SessionState.LIVE


def test_a_create_waiting_for_a_closing_name_waits_again_when_another_create_opens_it():
    table = SessionTable()
    table.restored(_record(), {})
    table.closing("s", "alice")
    waiting, outcome = _create_in_a_thread(table)
    waiting.join(0.2)  # waiting for the close
    table.dropped("s")
    table.opening(_record(), {0: 10})  # another create took the name as it was dropped
    waiting.join(0.3)
    assert waiting.is_alive() and outcome == []  # it waits for that create, not refused at once
    table.opened("s")
    waiting.join(10)
    assert outcome == ["exists"] and table.owned("s", "alice").state is SessionState.LIVE


def test_an_abandoned_opening_leaves_the_name_free():
    table = SessionTable()
    table.opening(_record(), {0: 10})
    table.abandoned("s")
    table.wait_until_free("s", closing_s=0.0, opening_s=0.0)
    assert table.entry("s") is None


def test_a_lost_session_stays_listed_and_counted_until_closed_and_dropped():
    table = SessionTable()
    table.restored(_record(), {0: 10, 1: 5})
    table.lost({"s": "shard 1 died"})
    assert table.why_lost("s") == "shard 1 died" and table.lost_sessions() == {"s": "shard 1 died"}
    assert list(table.records("alice")) == ["s"] and table.shard_loads(2) == [48, 12] and table.live_on(1) == {}
    with pytest.raises(PermissionDenied):
        table.closing("s", "bob")
    table.closing("s", "alice")
    assert table.records() == {} and table.estimated_on(0) == 0 and table.lost_sessions() == {}
    with pytest.raises(AlreadyExists):  # still closing
        table.wait_until_free("s", closing_s=0.0, opening_s=0.0)
    table.dropped("s")
    table.wait_until_free("s", closing_s=0.0, opening_s=0.0)


def test_only_a_live_session_is_lost_unloaded_or_reloaded():
    table = SessionTable()
    table.restored(_record(), {})
    assert table.unloaded("s") and table.entry("s").state is SessionState.UNLOADED
    table.lost({"s": "gone"})  # an unloaded session holds nothing on its shards: not lost by a shard's death
    assert table.why_lost("s") is None and table.live_on(0) == {}
    table.reloaded("s", None)
    assert table.entry("s").state is SessionState.LIVE and table.live_on(1) == {0: ["s"]}
    assert not table.unloaded("missing")


def test_expiry_closes_idle_live_and_lost_sessions_and_keeps_unreported_ones():
    table = SessionTable()
    table.restored(_record("idle"), {})
    table.restored(_record("busy"), {})
    table.restored(_record("silent"), {})
    expired = table.expired({"idle": 0.0, "busy": 95.0}, now=100.0, idle_s=10.0, close=True)
    assert [name for name, _ in expired] == ["idle"] and table.entry("idle").state is SessionState.CLOSING
    assert sorted(table.records()) == ["busy", "silent"]


def test_a_rollback_is_remembered_for_status_and_forgotten_with_the_session():
    table = SessionTable()
    table.restored(_record(), {})
    table.rolled_back("s", 7)
    assert table.rolled_back_from("s") == 7
    table.closing("s", "alice")
    table.dropped("s")
    table.restored(_record(), {})
    assert table.rolled_back_from("s") == 0


def test_the_common_version_is_the_least_any_shard_reaches_and_a_checkpoint_past_it_is_refused():
    assert common_version("s", {0: (4, 9, "a"), 1: (4, 7, "b")}) == (7, 9, None)
    _, _, why = common_version("s", {0: (8, 9, "a"), 1: (4, 7, "b")})
    assert "shard 0's checkpoint a is at version 8, but shard 1's checkpoint and log reach only version 7" in why
    _, _, why = common_version("s", {0: (-1, -1, "a"), 1: (4, 7, "b")})
    assert "shard 0 has no checkpoint in a" in why
