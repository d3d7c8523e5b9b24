"""A durable session's decided push whose staged copy is dropped after its turn came (its own call
heard a refusal for a ticket the clock decided all the same: the ticket journal could not be
written) keeps its turn until its client sends it again; the shard never takes the turn without
the gradient (it then stayed a push short of its step for good while its peers applied the retry:
the elastic session of nemesis seed 2 wedged that way).

Real pieces (a durable shard session on a real step log and ticket journal, no Ray); the drop is
the staging area's own, made between the turn check and the take, where the race put it."""

from __future__ import annotations

import concurrent.futures
import time

import numpy as np
import pytest

from optserve.optim_kernels import build_optimizer
from optserve.protos.optserve.v1 import tensor_pb2
from optserve.server.compute.updater import Updater
from optserve.server.domain.clock.home_clock import HomeClock
from optserve.server.domain.config import DType, Mode, SessionConfig, TensorSpec
from optserve.server.domain.durability import DurabilityConfig
from optserve.server.domain.errors import RejectReason, Timeout
from optserve.server.domain.shard.shard_session import PushHeader, ShardSession
from optserve.server.storage import ShardStore


def _chunk(value: float):
    return tensor_pb2.TensorChunk(name="w", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[4],
                                  data=np.full(4, value, np.float32).tobytes())


def _push(session, client_id: str, value: float):
    return session.push(PushHeader(client_id=client_id, sequence=1, base_version=0, auto_commit=True),
                        [_chunk(value)]).version


def _push_retried(session, client_id: str, value: float):
    """As the SDK does: a push whose step timed out is sent again (the same sequence)."""
    for _ in range(3):
        try:
            return _push(session, client_id, value)
        except Timeout:
            continue
    return _push(session, client_id, value)


def test_a_decided_push_dropped_before_it_was_taken_keeps_its_turn_until_it_is_sent_again(tmp_path):
    config = SessionConfig("dropped", (TensorSpec("w", DType.FLOAT32, (4,)),), "sgd", {"learning_rate": 0.1},
                           mode=Mode.SYNC, num_workers=2)
    store = ShardStore(str(tmp_path), "dropped", 0, DurabilityConfig(str(tmp_path)), home=True)
    clock = HomeClock(config, journal=store.log.journal_entry)
    session = ShardSession(config, ["w"], 0, clock, Updater(build_optimizer("sgd", {"learning_rate": 0.1})),
                           step_timeout_s=2.0, vote_timeout_s=2.0)
    session.initialize([_chunk(1.0)])
    store.start_logs(None)
    session.durability.attach_store(store)
    staging = session._staging
    take = staging.take
    dropped = []

    def dropped_by_its_call_first(key):  # b's call drops its push between the turn check and the take
        if key == ("b", 1) and not dropped:
            dropped.append(staging.drop(key, RejectReason.ABORTED))
        return take(key)

    staging.take = dropped_by_its_call_first
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(_push_retried, session, "a", 0.5)
        deadline = time.monotonic() + 10
        while session.clock.status().accepted < 1 and time.monotonic() < deadline:  # "a" joined the step
            time.sleep(0.01)
        with pytest.raises(Timeout, match="not staged"):  # b's call ends refused (its push was dropped)
            _push(session, "b", 1.5)
        assert dropped == [True] and session.version == 0
        assert _push(session, "b", 1.5) == 1  # the client's retry: the same push, applied in its turn
        assert first.result(timeout=10) == 1
    np.testing.assert_allclose(session.snapshot()[1]["w"], np.full(4, 1.0 - 0.1 * 1.0, np.float32))
    session.durability.close_store()
