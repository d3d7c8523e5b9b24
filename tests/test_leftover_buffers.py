"""An update that fails gives its gradient buffers back to the shard's pool, as one that succeeds
does (``StepJournal.run``), in every log order.

The failure is a real one (tests/test_kernel_failure_clock.py): SGD whose update asks a host
callback about the gradient, which raises for a huge one, so the step fails while it runs. A shard
session of one shard, async (each push's own buffers go into its update), in process; the pool's
free sets are counted around the failing step. In the overlapped log order the log may still be
writing the failed step's gradient (the record it marks aborted), so its buffers come back after
the log's next record or when the session's log closes, never while the log reads them.
"""

from __future__ import annotations

import numpy as np
import pytest

from optserve.server.domain.errors import SessionLost
from optserve.server.storage import ShardStore, read_step_log
from tests.test_kernel_failure_clock import HUGE, _chunk, _explodes_on_huge_gradients, _header


def _async_session(name: str, store=None):
    from optserve.server.compute.updater import Updater
    from optserve.server.domain.clock.home_clock import HomeClock
    from optserve.server.domain.config import DType, Mode, SessionConfig, TensorSpec
    from optserve.server.domain.shard.shard_session import ShardSession

    config = SessionConfig(name=name, tensors=(TensorSpec("w", DType.FLOAT32, (4,)),),
                           optimizer_name="explodes_on_huge_gradients", optimizer_args={}, mode=Mode.ASYNC)
    session = ShardSession(config, ["w"], 0, HomeClock(config), Updater(_explodes_on_huge_gradients()),
                           step_timeout_s=30.0, vote_timeout_s=30.0)
    if store is not None:
        store.start_logs(None)
        session.durability.attach_store(store)
    session.initialize([_chunk("w", np.ones(4, np.float32))])
    return session


def _free_sets(session) -> int:
    return session._staging._pool.free_sets


def _push(session, sequence: int, value: float):
    receipt = session.push(_header("worker", sequence, sequence - 1), [_chunk("w", np.full(4, value, np.float32))])
    receipt.durable()  # acknowledged: its record is written, and its buffers given back
    return receipt


def test_a_failed_update_gives_its_gradient_buffers_back_to_the_pool():
    session = _async_session("buffers back")
    assert _push(session, 1, 0.5).version == 1
    assert _free_sets(session) == 1  # the step's set, back for the next push
    with pytest.raises(SessionLost):
        _push(session, 2, 10 * HUGE)  # takes that set, and its update fails
    assert _free_sets(session) == 1


def test_a_failed_update_of_a_durable_session_gives_its_buffers_back_once_the_log_wrote_them(tmp_path):
    from optserve.server.domain.durability import DurabilityConfig

    store = ShardStore(str(tmp_path), "durable buffers back", 0, DurabilityConfig(str(tmp_path)), home=True)
    session = _async_session("durable buffers back", store)
    assert not store.log.write_ahead  # the overlapped order: the gradient is logged while the update runs
    assert _push(session, 1, 0.5).version == 1
    assert _free_sets(session) == 1
    with pytest.raises(SessionLost):
        _push(session, 2, 10 * HUGE)
    assert _free_sets(session) == 0  # held: the log may still be writing them (its next record, or its close)
    session.durability.close_store()  # the log has written everything queued: the failed step's buffers are back
    assert _free_sets(session) == 1
    (segment,) = store.log.segments(None)
    records = list(read_step_log(segment, lambda: {"w": np.empty(4, np.float32)}))  # the aborted one is intact
    assert [header["version"] for header, _ in records] == [1]
