"""A step's waits as values (server/domain/waits.py) and their driver on an event loop
(server/wire/loop_calls.py): waits that hold no thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from optserve.server.domain.clock.votes import ShardVotes
from optserve.server.domain.clock.clock_records import Ticket
from optserve.server.domain.errors import PeerRefused
from optserve.server.domain import waits
from optserve.server.domain.waits import SignalCondition, Wait, drive
from optserve.server.wire.loop_calls import PoolRuns


def _ticket(client_id: str, sequence: int, ordinal: int) -> Ticket:
    return Ticket(ordinal, client_id, sequence, 0, 1.0, True, ordinal + 1, False, "")


def test_drive_waits_in_this_thread_and_returns_the_generators_value():
    cond = SignalCondition()
    ready = []

    def steps():
        while True:
            with cond:
                if ready:
                    return ready[0]
                wait = cond.wait_step(5.0)
            yield wait

    def later():
        time.sleep(0.05)
        with cond:
            ready.append("done")
            cond.notify_all()

    threading.Thread(target=later).start()
    assert drive(steps()) == "done"


def test_a_wait_that_times_out_says_so_and_its_waiter_is_dropped_at_the_next_notify():
    cond = SignalCondition()
    with cond:
        wait = cond.wait_step(0.01)
    assert wait.block() is False
    assert wait.future.cancelled()
    with cond:
        cond.notify_all()  # a cancelled waiter is skipped, not an error
        assert cond.wait_step(None).future.done() is False


def test_a_wait_on_a_future_done_already_ends_at_once():
    cond = SignalCondition()
    with cond:
        wait = cond.wait_step(10.0)
        cond.notify_all()
    started = time.monotonic()
    assert Wait(wait.future, 10.0).block() is True
    assert time.monotonic() - started < 1.0


def test_two_hundred_votes_wait_on_the_loop_with_a_pool_of_two_threads():
    # Shard 0's part of 200 pushes votes first: each waits for shard 1's vote. Were a waiting
    # vote to hold a thread, the pool's 2 threads would be taken by the first two votes and
    # shard 1's votes (run in the same pool) could never be counted: every vote refused at its
    # timeout. Waiting on the loop, all 200 are decided as soon as shard 1 voted.
    pushes = 200
    cond = SignalCondition()
    decided = iter(range(10 ** 6))
    votes = ShardVotes(2, cond, lambda client, sequence, base: _ticket(client, sequence, next(decided)))
    pool = ThreadPoolExecutor(2)

    async def main():
        first = [asyncio.ensure_future(PoolRuns(pool).result(
            votes.vote_steps("c", sequence, 0, 0, True, timeout_s=20.0))) for sequence in range(pushes)]
        await asyncio.sleep(0.2)
        assert not any(f.done() for f in first)  # waiting for shard 1, and no thread held
        second = [PoolRuns(pool).result(votes.vote_steps("c", sequence, 0, 1, True, timeout_s=20.0))
                  for sequence in range(pushes)]
        return await asyncio.wait_for(asyncio.gather(*first, *second), 15.0)

    try:
        started = time.monotonic()
        tickets = asyncio.run(main())
        assert time.monotonic() - started < 10.0
    finally:
        pool.shutdown()
    assert [t.sequence for t in tickets[:pushes]] == list(range(pushes))
    assert tickets[:pushes] == tickets[pushes:]  # both shards got the same ticket


def test_a_vote_no_peer_answers_is_refused_at_its_timeout_on_the_loop():
    votes = ShardVotes(2, SignalCondition(), lambda client, sequence, base: _ticket(client, sequence, 0))
    pool = ThreadPoolExecutor(1)
    try:
        with pytest.raises(PeerRefused, match=r"shards \[1\] did not vote"):
            asyncio.run(PoolRuns(pool).result(votes.vote_steps("c", 1, 0, 0, True, timeout_s=0.2)))
    finally:
        pool.shutdown()


class _CountingPool(ThreadPoolExecutor):
    """A pool that counts what is handed to it."""

    def __init__(self, workers: int):
        super().__init__(workers)
        self.submitted = 0

    def submit(self, fn, *args, **kwargs):
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


def test_the_stretch_after_a_wait_starts_in_the_pool_while_the_loop_is_busy():
    # The thread that completes a wait's future hands the step's next stretch to the pool
    # itself: the loop (here stuck in a blocking call) is not needed between the wait and it.
    cond = SignalCondition()
    resumed = threading.Event()

    def steps():
        with cond:
            wait = cond.wait_step(10.0)
        assert (yield wait) is True
        resumed.set()
        return "resumed"

    pool = ThreadPoolExecutor(1)

    async def main():
        run = asyncio.ensure_future(PoolRuns(pool).result(steps()))
        await asyncio.sleep(0.2)  # the step waits: no thread held
        with cond:
            cond.notify_all()
        resumed_while_busy = resumed.wait(5.0)  # blocks the loop's only thread
        return resumed_while_busy, await asyncio.wait_for(run, 5.0)

    try:
        assert asyncio.run(main()) == (True, "resumed")
    finally:
        pool.shutdown()


def test_a_step_runs_in_one_stretch_when_its_waits_are_over_and_its_last_answer_is_returned():
    # A wait over when yielded is answered in the same stretch, and an answer returned with the
    # step's value (Answered) needs no further stretch: one pool task for the whole step.
    from optserve.server.wire.loop_calls import Answered, Returned

    done = SignalCondition()
    with done:
        over = done.wait_step(10.0)
        done.notify_all()

    def steps():
        assert (yield over) is True
        assert (yield Wait(over.future, None)) is True
        return Answered("the answer", "the value")

    pool = _CountingPool(1)

    async def main():
        return [item async for item in PoolRuns(pool).run(steps())]

    try:
        items = asyncio.run(main())
    finally:
        pool.shutdown()
    assert items[0] == "the answer" and isinstance(items[1], Returned) and items[1].value == "the value"
    assert pool.submitted == 1


def test_a_wait_that_times_out_resumes_the_step_with_false_and_its_waiter_is_cancelled():
    cond = SignalCondition()
    seen = []

    def steps():
        with cond:
            wait = cond.wait_step(0.1)
        seen.append((yield wait))
        seen.append(wait.future.cancelled())
        return len(seen)

    pool = ThreadPoolExecutor(1)
    try:
        assert asyncio.run(PoolRuns(pool).result(steps())) == 2
    finally:
        pool.shutdown()
    assert seen == [False, True]


def test_an_acknowledgment_waits_for_its_log_record_without_a_thread(tmp_path):
    # A durable session's answer waits for the step's log record. With the log's writer busy (as
    # on a slow disk; here its one thread is held), two steps' acknowledgments wait on the loop:
    # the pool's only thread stays free, and both end once their records are written.
    import numpy as np

    from optserve.server.domain.durability import DurabilityConfig
    from optserve.server.storage import ShardStore
    from tests.test_kernel_failure_clock import _chunk, _header
    from tests.test_leftover_buffers import _async_session

    store = ShardStore(str(tmp_path), "acks", 0, DurabilityConfig(str(tmp_path)), home=True)
    session = _async_session("acks", store)
    writing = threading.Event()
    store.log._thread.submit(writing.wait)  # the log's writer thread is busy until `writing` is set
    receipts = [session.push(_header("worker", sequence, sequence - 1), [_chunk("w", np.full(4, 0.1, np.float32))])
                for sequence in (1, 2)]
    pool = ThreadPoolExecutor(1)

    async def main():
        acks = [asyncio.ensure_future(PoolRuns(pool).result(receipt.durable_steps())) for receipt in receipts]
        await asyncio.sleep(0.2)
        assert not any(ack.done() for ack in acks)  # the records are not written yet
        assert await asyncio.wait_for(asyncio.wrap_future(pool.submit(lambda: "free")), 2.0) == "free"
        writing.set()
        await asyncio.wait_for(asyncio.gather(*acks), 10.0)

    try:
        asyncio.run(main())
    finally:
        writing.set()
        pool.shutdown()
        session.durability.close_store()
    assert [receipt.version for receipt in receipts] == [1, 2]


def test_a_step_whose_call_is_cancelled_just_as_its_stretch_ends_goes_on_to_its_end():
    # The stretch ends (its outcome queued for the loop) and then the call is cancelled, before
    # the loop took the outcome: the step still goes on without its call, past its next wait.
    reached, finished = threading.Event(), threading.Event()
    later = concurrent.futures.Future()

    def steps():
        reached.set()
        yield Wait(later, 10.0)
        finished.set()
        return "done"

    pool = ThreadPoolExecutor(1)

    async def main():
        runs = PoolRuns(pool)

        async def consume():
            async for _ in runs.run(steps()):
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0)  # the first stretch goes to the pool
        assert reached.wait(5.0)
        time.sleep(0.3)  # the loop held: the stretch's outcome is queued behind this callback
        task.cancel()  # cancelled before the loop takes that outcome
        later.set_result(True)
        with pytest.raises(asyncio.CancelledError):
            await task
        cleaned = asyncio.get_running_loop().create_future()
        loop = asyncio.get_running_loop()
        runs.after(lambda: loop.call_soon_threadsafe(cleaned.set_result, True))
        await asyncio.wait_for(cleaned, 5.0)

    try:
        asyncio.run(main())
    finally:
        pool.shutdown(wait=False)
    assert finished.is_set()


def _holds(cond: SignalCondition, took: list):
    """A step that takes ``cond`` without a thread and notes it took it."""
    with (yield from cond.hold_steps()):
        took.append(threading.get_ident())


def test_steps_waiting_for_a_held_lock_hold_no_thread_and_go_on_at_its_release(monkeypatch):
    # An update holds the session's lock; 100 steps arrive wanting it. Were each to block on the
    # lock, the pool's 2 threads would be taken and a job of another session could not run.
    monkeypatch.setattr(waits, "LOCK_POLL_S", 60.0)  # only the releases end the waits
    cond = SignalCondition()
    took: list = []
    pool = ThreadPoolExecutor(2)
    held, release = threading.Event(), threading.Event()

    def update():
        with cond:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=update)
    holder.start()
    held.wait(5)

    async def main():
        steps = [asyncio.ensure_future(PoolRuns(pool).result(_holds(cond, took))) for _ in range(100)]
        await asyncio.sleep(0.3)
        assert not took  # all waiting for the lock
        other = asyncio.get_running_loop().run_in_executor(pool, lambda: "other session")
        assert await asyncio.wait_for(other, 2.0) == "other session"  # the pool is free
        released_at = time.monotonic()
        release.set()
        await asyncio.wait_for(asyncio.gather(*steps), 10.0)
        return time.monotonic() - released_at

    try:
        after_release_s = asyncio.run(main())
    finally:
        release.set()
        holder.join(5)
        pool.shutdown()
    assert len(took) == 100 and after_release_s < 3.0


def test_a_step_takes_a_lock_its_own_thread_holds_at_once_and_leaves_it_held():
    cond = SignalCondition()
    took: list = []
    with cond:
        drive(_holds(cond, took))  # re-entrant: no wait
        assert cond._is_owned()
    assert took == [threading.get_ident()] and not cond._is_owned()


def test_a_lock_released_inside_a_condition_wait_is_taken_by_a_waiting_step(monkeypatch):
    # cond.wait() lets the lock go through its own release: that ends the step's wait too.
    monkeypatch.setattr(waits, "LOCK_POLL_S", 60.0)
    cond = SignalCondition()
    took: list = []
    holding, done = threading.Event(), threading.Event()

    def waiter():
        with cond:
            holding.set()
            time.sleep(0.3)  # the step tries meanwhile, and waits
            cond.wait_for(done.is_set, timeout=90)

    thread = threading.Thread(target=waiter)
    thread.start()
    holding.wait(5)
    started = time.monotonic()
    drive(_holds(cond, took))  # the holder sits in cond.wait, its lock released
    assert took and time.monotonic() - started < 30.0  # not the poll's 60 s
    done.set()
    with cond:
        cond.notify_all()
    thread.join(5)
