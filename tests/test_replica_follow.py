"""A standby session fed its primary's applied steps holds the primary's state bit for bit
(active replication, docs/plans/hot_standby.md), and a step is acknowledged only once the standby
holds it.

Real pieces, no Ray: two shard sessions of one session on one shard (the primary's home clock
passes its journal entries to the standby's clock, its step journal ships each applied step),
linked in this process (:class:`LocalLink`)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest

from optserve.optim_kernels import build_optimizer
from optserve.server.domain.clock.home_clock import HomeClock
from optserve.server.domain.config import Mode
from optserve.server.domain.durability import StepRecord
from optserve.server.domain.errors import Unavailable
from optserve.server.domain.shard.replica import (DIGEST_EVERY, HeldVersions, LocalLink, ReplicaDiverged, ReplicaGap,
                                                  StandbyFollower)
from optserve.server.domain.shard.shard_session import PushHeader
from tests._replica_pair import ADAM, SHAPES, Pair, chunks, clock_json, config_of, shard_session, values


def test_an_async_standby_holds_the_primarys_parameters_state_and_clock_bit_for_bit():
    pair = Pair(config_of(Mode.ASYNC))
    try:
        version = 0
        for step in range(10):
            for client in ("a", "b"):  # b computes from one version back: scaled by its staleness
                base = version if client == "a" else max(0, version - 1)
                version, scale = pair.push(client, step, base, seed=10 * step + (client == "b"))
                assert scale == (1.0 if client == "a" else 0.5)
            if step == 4:  # from the next step on, on both
                pair.primary.home.set_hyperparams({"learning_rate": 0.05})
        assert version == 20
        assert pair.primary.updater.hyper != build_optimizer(*ADAM).hyperparams
        pair.primary.home.set_hyperparams({"learning_rate": 0.02})  # asked for, not in force until a step
        pair.assert_equal()
    finally:
        pair.close()


def test_a_sync_standby_holds_the_mean_of_each_step_as_the_primary_applied_it():
    pair = Pair(config_of(Mode.SYNC, workers=2))
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for step in range(6):
                pushes = [pool.submit(pair.push, client, step, step, 2 * step + i) for i, client in enumerate("ab")]
                assert [p.result(timeout=60) for p in pushes] == [(step + 1, 1.0)] * 2
        pair.assert_equal()
        assert pair.standby.status().version == 6
    finally:
        pair.close()


def test_a_standby_shipped_a_step_that_does_not_follow_stops_and_later_steps_are_not_acknowledged():
    pair = Pair(config_of(Mode.ASYNC))
    try:
        pair.push("a", 0, 0, seed=1)
        grads = [values(2)[n] for n in SHAPES]
        with pytest.raises(ReplicaGap, match=r"holds steps up to version 1 \(started\) and was shipped version 3"):
            pair.follower.receive(StepRecord(3, ((5, "a", 4),), 1.0, 0.0), grads)
        with pytest.raises(Unavailable, match="standby"):  # nothing more is acknowledged
            pair.primary.push(PushHeader("a", 1, 1), chunks(values(3))).durable()
        assert pair.follower.wait_applied(1, timeout_s=30) and not pair.follower.wait_applied(2, timeout_s=0.5)
        assert pair.standby.version == 1  # the step it held before the gap: applied all the same
    finally:
        pair.close()


def test_a_standby_starts_from_the_primarys_memory_at_a_step_boundary_and_follows_on_bit_for_bit():
    # The primary has run 3 sync steps alone and holds half of the fourth (a's push, waiting
    # for b's): a standby cannot start inside a step (a's push counts as applied here, its
    # gradient is only in the partial sum); once b's push closed the step, it starts and follows.
    config = config_of(Mode.SYNC, workers=2)
    primary = shard_session(config, HomeClock(config))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for step in range(3):
            pushes = [pool.submit(primary.push, PushHeader(c, step, step), chunks(values(2 * step + i)))
                      for i, c in enumerate("ab")]
            assert [p.result(timeout=60).version for p in pushes] == [step + 1] * 2
        primary.home.set_hyperparams({"learning_rate": 0.03})
        waiting = pool.submit(primary.push, PushHeader("a", 3, 3), chunks(values(6)))
        deadline = time.monotonic() + 10
        while primary.clock.status().accepted < 7 and time.monotonic() < deadline:  # a's push is in the step
            time.sleep(0.01)
        assert not waiting.done()
        with pytest.raises(Unavailable, match="inside step 4"):
            Pair(config, primary)
        assert primary.push(PushHeader("b", 3, 3), chunks(values(7))).version == 4
        assert waiting.result(timeout=60).version == 4
        pair = Pair(config, primary)
        try:
            assert pair.standby.version == 4 and pair.follower.applied == 4
            for step in range(4, 6):
                pushes = [pool.submit(pair.push, c, step, step, 2 * step + i) for i, c in enumerate("ab")]
                assert [p.result(timeout=60) for p in pushes] == [(step + 1, 1.0)] * 2
            pair.assert_equal()
            assert pair.follower.promote(timeout_s=30) == 6
        finally:
            pair.close()


def test_a_ticket_decided_but_never_shipped_is_applied_once_by_the_promoted_standby_when_retried():
    # The primary's clock decided c's ticket (the standby's clock holds it) and died before the
    # step ran: the promoted standby keeps c's turn until c retries, then applies it, once.
    pair = Pair(config_of(Mode.ASYNC))
    reference = shard_session(config_of(Mode.ASYNC), HomeClock(config_of(Mode.ASYNC)))
    pair.push("a", 0, 0, seed=1)
    reference.push(PushHeader("a", 0, 0), chunks(values(1)))
    assert pair.primary.clock.commit("c", 0, 1).ordinal == 1  # decided, and the primary is lost
    assert pair.follower.promote(timeout_s=30) == 1
    standby = pair.standby
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        later = pool.submit(standby.push, PushHeader("d", 0, 1), chunks(values(3)))
        time.sleep(1.0)  # d's shard asks the clock for the tickets before its own (every 0.25 s)
        assert not later.done()  # d's ticket comes after c's, which waits for its push
        retried = standby.push(PushHeader("c", 0, 1), chunks(values(2)))
        assert retried.committed and not retried.already_applied and retried.version == 2
        assert later.result(timeout=30).version == 3
    for client, seed in (("c", 2), ("d", 3)):
        reference.push(PushHeader(client, 0, 1), chunks(values(seed)))
    for name in SHAPES:
        assert standby.updater.host_state()[0][name].tobytes() == reference.updater.host_state()[0][name].tobytes()


def test_a_closed_standby_holds_nothing_more_and_its_primary_acknowledges_nothing_more():
    pair = Pair(config_of(Mode.ASYNC))
    pair.push("a", 0, 0, seed=1)
    pair.close()
    with pytest.raises(Unavailable, match="follows its primary no more"):  # refused, or never acknowledged
        pair.primary.push(PushHeader("a", 1, 1), chunks(values(2))).durable()
    with pytest.raises(Unavailable):
        pair.follower.promote(timeout_s=1)


def test_held_versions_are_done_in_order_and_fail_when_none_will_be_held():
    held = HeldVersions()
    first, second = held.future(1), held.future(2)
    held.hold(1)
    assert first.done() and not second.done() and held.future(1).done()
    held.fail(ReplicaGap("gone"))
    assert isinstance(second.exception(), ReplicaGap) and isinstance(held.future(3).exception(), ReplicaGap)


def test_a_promoted_standby_answers_a_retry_of_an_acknowledged_push_without_applying_it_again():
    # The primary is lost after acknowledging pushes up to (a, 4) and (b, 4); the clients retry
    # their last push on the promoted standby (they did not hear the answer), then go on. Every
    # push counts once: the standby's parameters equal a session that got each push once.
    pair = Pair(config_of(Mode.ASYNC))
    reference = shard_session(config_of(Mode.ASYNC), HomeClock(config_of(Mode.ASYNC)))
    version = 0
    for step in range(5):
        for client in "ab":
            version, _ = pair.push(client, step, version, seed=10 * step + (client == "b"))
            reference.push(PushHeader(client, step, version - 1), chunks(values(10 * step + (client == "b"))))
    assert pair.follower.promote(timeout_s=30) == 10
    standby = pair.standby
    retried = standby.push(PushHeader("b", 4, 9), chunks(values(41)))
    assert retried.already_applied and retried.version == 10 and standby.version == 10
    for step in range(5, 7):
        for client in "ab":
            version = standby.push(PushHeader(client, step, version), chunks(values(step))).version
            reference.push(PushHeader(client, step, version - 1), chunks(values(step)))
    assert version == reference.version == 14
    for name in SHAPES:
        assert standby.updater.host_state()[0][name].tobytes() == reference.updater.host_state()[0][name].tobytes()


class _LateLink(LocalLink):
    """A link whose standby says it holds a step only once the test lets it (a slow network)."""

    def __init__(self, follower: StandbyFollower):
        super().__init__(follower)
        self.let_go = threading.Event()

    def held_future(self, version: int) -> Future:
        late = Future()
        threading.Thread(target=lambda: (self.let_go.wait(), late.set_result(None)), daemon=True).start()
        return late


class _BrokenLink(LocalLink):
    """A faulty port: shipping raises."""

    def ship(self, record, grads, roots=(), digest=None) -> None:
        raise ConnectionError("the link broke")


def _linked(link_type):
    config = config_of(Mode.ASYNC)
    primary, standby_clock = shard_session(config, HomeClock(config)), HomeClock(config)
    standby = shard_session(config, standby_clock, initialized=False)
    follower = StandbyFollower(standby.durability.start_from, standby.durability.follow, standby_clock,
                               list(SHAPES), standby.where)
    link = link_type(follower)
    primary.durability.start_replica(link)
    return primary, standby, follower, link


def test_an_acknowledgement_waits_until_the_standby_says_it_holds_the_step():
    primary, _standby, follower, link = _linked(_LateLink)
    try:
        receipt = primary.push(PushHeader("a", 0, 0), chunks(values(1)))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            acknowledged = pool.submit(receipt.durable)
            time.sleep(0.3)
            assert not acknowledged.done()
            link.let_go.set()
            acknowledged.result(timeout=10)
    finally:
        follower.close()


def test_a_step_its_port_could_not_ship_is_applied_but_never_acknowledged():
    primary, _standby, follower, _link = _linked(_BrokenLink)
    try:
        receipt = primary.push(PushHeader("a", 0, 0), chunks(values(1)))
        assert primary.version == 1  # applied here: the primary's state is whole
        with pytest.raises(Unavailable, match="could not be shipped"):
            receipt.durable()
    finally:
        follower.close()


def test_a_standbys_clock_decides_nothing_changes_nothing_and_books_no_ticket_out_of_order():
    pair = Pair(config_of(Mode.ASYNC))
    try:
        pair.push("a", 0, 0, seed=1)
        clock = pair.standby.clock
        with pytest.raises(Unavailable, match="standby's"):
            clock.commit("b", 0, 1)
        with pytest.raises(Unavailable, match="standby's"):
            clock.set_hyperparams({"default": {"learning_rate": 0.5}})
        decided = pair.primary.clock.commit("c", 0, 1)  # ticket 1, passed to the standby's clock
        skipped = dataclasses.replace(decided, ordinal=decided.ordinal + 2, sequence=1)
        with pytest.raises(Unavailable, match="at ticket 2 and was shipped ticket 3"):
            clock.follow([skipped.to_json()])
        assert clock_json(clock)["next_ordinal"] == 2  # the real ticket 1 went to it before
    finally:
        pair.close()


def test_a_clock_entry_the_disk_refused_still_reaches_the_standby_and_the_refusal_is_raised():
    """The clock keeps a ticket it decided even when its journal line could not be written (the
    push is refused and retried, and is given that ticket): its standby's clock must hold it too,
    or a promoted standby would decide that ordinal again for another push."""
    from optserve.server.domain.clock.clock_journal import ClockJournal

    def full_disk(entry):
        raise OSError(28, "No space left on device")

    journal, shipped = ClockJournal(full_disk), []
    journal.replica = shipped.append
    with pytest.raises(OSError, match="No space left"):
        journal([7, "a", 3])
    assert shipped == [[7, "a", 3]]


def test_a_standby_whose_parameters_differ_from_its_primarys_at_a_digest_stops_and_is_never_promoted():
    # A bit of the standby's copy flipped after version 10 (damaged memory): the digest shipped
    # with version 50 finds it; the standby takes nothing more, so nothing later is acknowledged,
    # and it refuses to serve. An intact pair passes both digests of 100 steps.
    intact, damaged = Pair(config_of(Mode.ASYNC)), Pair(config_of(Mode.ASYNC))
    try:
        for step in range(DIGEST_EVERY * 2):
            intact.push("a", step, step, seed=step)
        intact.assert_equal()
        assert intact.follower.error is None
        for step in range(10):
            damaged.push("a", step, step, seed=step)
        damaged.assert_equal()
        params, opt_state = damaged.standby.updater.host_state()
        flipped = {name: np.array(value, copy=True) for name, value in params.items()}
        flipped["w"].view(np.uint32)[0, 0] ^= 1 << 22  # the mantissa's top bit: Adam's steps never wash it out
        damaged.standby.updater.restore(flipped, opt_state)
        for step in range(10, DIGEST_EVERY):
            damaged.push("a", step, step, seed=step)  # held on receipt: acknowledged
        assert not damaged.follower.wait_applied(DIGEST_EVERY, timeout_s=30)  # stopped at the digest
        assert isinstance(damaged.follower.error, ReplicaDiverged)
        assert f"after version {DIGEST_EVERY} the standby's parameters differ" in str(damaged.follower.error)
        with pytest.raises(Unavailable, match="parameters differ from its primary's"):
            damaged.primary.push(PushHeader("a", DIGEST_EVERY, DIGEST_EVERY), chunks(values(0))).durable()
        with pytest.raises(ReplicaDiverged):
            damaged.follower.promote(timeout_s=5)
    finally:
        intact.close()
        damaged.close()
