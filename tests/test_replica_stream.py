"""A primary shard session keeps its standby in step over a real ``ShardReplica`` gRPC stream
(server/wire/replica_channel.py, replica_service.py, replica_frames.py): the standby holds the
primary's state bit for bit, a step is acknowledged only once the standby holds it, and a refusal,
a broken stream or a stranger's stream fails acknowledgements at once instead of hanging them.

Real pieces, no Ray: the standby's service on a loopback ``LoopServer`` behind the internal secret,
the primary's ``ReplicaChannel`` dialing it, the sessions of tests/_replica_pair.py."""

from __future__ import annotations

import concurrent.futures
import time

import grpc
import ml_dtypes
import numpy as np
import pytest

from optserve.protos.optserve.v1 import replica_pb2
from optserve.server.compute.root_offload import RootInstall
from optserve.server.domain.clock.home_clock import HomeClock
from optserve.server.domain.config import Mode
from optserve.server.domain.durability import ShardProgress, StepRecord
from optserve.server.domain.errors import NotFound, Unavailable
from optserve.server.domain.shard.replica import ReplicaStart, StandbyFollower, StateLeaves
from optserve.server.domain.shard.shard_session import PushHeader
from optserve.server.wire.loop_server import LoopServer
from optserve.server.wire.replica_channel import ReplicaChannel, ReplicaTraffic
from optserve.server.wire.replica_frames import FrameAssembler, StartMessage, StepMessage, start_frames, step_frames
from optserve.server.wire.replica_service import SERVICE, ReplicaServicer, add_replica_service
from optserve.server.wire.security import InternalSecretInterceptor, InternalTrust
from optserve.server.wire.thread_pool import ShrinkingThreadPool
from tests._replica_pair import SHAPES, Pair, chunks, config_of, shard_session, values


class _Standby:
    """A standby process's ShardReplica service on loopback, with the followers it serves."""

    def __init__(self, trust: InternalTrust, serve: bool = True):
        self.followers: dict[str, StandbyFollower] = {}
        self._pool = ShrinkingThreadPool(8, thread_name_prefix="test-standby")
        self.server = LoopServer(self._pool, interceptors=[InternalSecretInterceptor(trust.secret)])
        add_replica_service(self.server, ReplicaServicer(self._follower, self._pool))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        if serve:
            self.server.start()

    def _follower(self, session: str) -> StandbyFollower:
        try:
            return self.followers[session]
        except KeyError:
            raise NotFound(f"session {session!r} has no standby here") from None

    def link(self, channel: ReplicaChannel, session: str):
        """``Pair``'s link: the follower registered here, the primary's port over ``channel``."""
        def make(follower: StandbyFollower):
            self.followers[session] = follower
            return channel.port(session)
        return make

    def stop(self) -> None:
        self.server.stop(0)
        self._pool.shutdown(wait=False)


@pytest.fixture
def trust():
    return InternalTrust.generate(with_tls=False)


@pytest.fixture
def standby(trust):
    served = _Standby(trust)
    yield served
    served.stop()


def _push_async(pair: Pair, steps: int) -> int:
    version = 0
    for step in range(steps):
        for client in ("a", "b"):  # b computes from one version back: scaled by its staleness
            base = version if client == "a" else max(0, version - 1)
            version, _scale = pair.push(client, step, base, seed=10 * step + (client == "b"))
        if step == 3:
            pair.primary.home.set_hyperparams({"learning_rate": 0.05})
    return version


def test_a_standby_over_the_stream_holds_the_primarys_parameters_state_and_clock_bit_for_bit(trust, standby):
    # Parts of 16 bytes: every array of the start and of each step crosses in several frames.
    channel = ReplicaChannel(standby.address, trust, chunk_bytes=16)
    pair = Pair(config_of(Mode.ASYNC), link=standby.link(channel, "mirrored"))
    try:
        assert _push_async(pair, 8) == 16
        pair.assert_equal()
    finally:
        pair.close()
        channel.close()


def test_a_sync_standby_over_the_stream_holds_each_steps_mean_and_round_and_the_bytes_are_counted(trust, standby):
    counted = {"sent": 0, "received": 0}

    def count(way):
        return lambda n: counted.__setitem__(way, counted[way] + n)

    channel = ReplicaChannel(standby.address, trust, traffic=ReplicaTraffic(count("sent"), count("received")))
    pair = Pair(config_of(Mode.SYNC, workers=2), link=standby.link(channel, "mirrored"))
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for step in range(4):
                pushes = [pool.submit(pair.push, c, step, step, 2 * step + i) for i, c in enumerate("ab")]
                assert [p.result(timeout=60) for p in pushes] == [(step + 1, 1.0)] * 2
        pair.assert_equal()
        gradient = sum(4 * int(np.prod(s)) for s in SHAPES.values())
        # the start (parameters and Adam's two moments) and four steps' mean gradients went out
        assert counted["sent"] >= 3 * gradient + 4 * gradient, counted
        assert 4 <= counted["received"] < counted["sent"], counted
    finally:
        pair.close()
        channel.close()


def test_a_session_its_standby_refuses_is_not_acknowledged_while_another_on_the_stream_goes_on(trust, standby):
    channel = ReplicaChannel(standby.address, trust)
    one = Pair(config_of(Mode.ASYNC), link=standby.link(channel, "one"))
    two = Pair(config_of(Mode.ASYNC), link=standby.link(channel, "two"))
    try:
        one.push("a", 0, 0, seed=1)
        two.push("a", 0, 0, seed=1)
        one.follower.close()  # the standby follows session one no more
        with pytest.raises(Unavailable, match="standby"):
            one.primary.push(PushHeader("a", 1, 1), chunks(values(2))).durable()
        for step in range(1, 4):
            two.push("a", step, step, seed=step)
        two.assert_equal()
    finally:
        one.close()
        two.close()
        channel.close()


def test_a_standby_counts_as_started_only_once_it_answered_the_start_sent_to_it(trust):
    # Its process does not serve yet: the start waits in the stream, and the status must not
    # call a standby that holds nothing "in sync" (it could not serve in the primary's place).
    standby = _Standby(trust, serve=False)
    channel = ReplicaChannel(standby.address, trust)
    pair = Pair(config_of(Mode.ASYNC), link=standby.link(channel, "late"))
    durability = pair.primary.durability
    try:
        time.sleep(0.5)
        assert durability.in_sync and not durability.standby_started
        standby.server.start()
        deadline = time.monotonic() + 30
        while not durability.standby_started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert durability.standby_started
        pair.push("a", 0, 0, seed=1)
        pair.assert_equal()
        pair.follower.close()  # it follows no more: not started any longer, once its refusal is back
        with pytest.raises(Unavailable, match="standby"):
            pair.primary.push(PushHeader("a", 1, 1), chunks(values(2))).durable()
        assert not durability.standby_started
    finally:
        pair.close()
        channel.close()
        standby.stop()


def test_a_stream_that_breaks_fails_the_acknowledgements_at_once_instead_of_hanging(trust, standby):
    channel = ReplicaChannel(standby.address, trust, clock_timeout_s=30.0)
    pair = Pair(config_of(Mode.ASYNC), link=standby.link(channel, "mirrored"))
    try:
        pair.push("a", 0, 0, seed=1)
        standby.stop()  # the standby's process is gone
        began = time.monotonic()
        with pytest.raises(Unavailable, match="standby"):
            pair.primary.push(PushHeader("a", 1, 1), chunks(values(2))).durable()
        assert time.monotonic() - began < 20  # the broken stream said so; no clock timeout waited out
        assert pair.primary.version <= 2
    finally:
        pair.close()
        channel.close()


def test_a_stream_without_the_internal_secret_is_refused_and_no_standby_starts(standby):
    stranger = InternalTrust.generate(with_tls=False)
    channel = ReplicaChannel(standby.address, stranger)
    deadline = time.monotonic() + 30
    while channel.broken is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "UNAUTHENTICATED" in str(channel.broken)
    try:
        with pytest.raises(Unavailable, match="UNAUTHENTICATED"):
            Pair(config_of(Mode.ASYNC), link=standby.link(channel, "mirrored"))
        assert standby.followers["mirrored"].held.held == 0
    finally:
        standby.followers["mirrored"].close()
        channel.close()


def test_a_damaged_frame_ends_the_stream_invalid_argument(trust, standby):
    with trust.channel(standby.address) as raw:
        follow = raw.stream_stream(f"/{SERVICE}/Follow", request_serializer=replica_pb2.ReplicaFrame.SerializeToString,
                                   response_deserializer=replica_pb2.ReplicaAnswer.FromString)
        part = replica_pb2.ReplicaFrame(part=replica_pb2.ReplicaPart(array=0, offset=0, data=b"x"))
        with pytest.raises(grpc.RpcError) as refused:
            list(follow(iter([part]), metadata=trust.metadata, timeout=30))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "outside a message" in refused.value.details()


def _assembled(frames) -> object:
    assembler = FrameAssembler()
    out = [assembler.add(frame) for frame in frames]
    assert all(m is None for m in out[:-1])
    return out[-1]


def test_frames_carry_every_element_type_and_empty_arrays_exactly():
    grads = [np.arange(6, dtype=np.float32).reshape(2, 3), np.zeros((0, 4), np.float32),
             np.array([1.5, -2.25], dtype=ml_dtypes.bfloat16)]
    record = StepRecord(7, ((6, "a", 3),), 0.5, 2.5, {"default": {"learning_rate": 0.1}}, ("e",))
    message = _assembled(step_frames("s", record, grads, chunk_bytes=5))
    assert isinstance(message, StepMessage) and message.record == record and message.record.absent == ("e",)
    assert [g.dtype for g in message.grads] == [g.dtype for g in grads]
    assert all(a.tobytes() == b.tobytes() and a.shape == b.shape for a, b in zip(message.grads, grads))
    leaves = (np.array(3, np.int32), np.ones((2, 2), np.float32), np.array([True, False]))
    start = ReplicaStart(ShardProgress(4, 9, {"a": 3}, {"default": {"learning_rate": 0.1}}, 0), {"w": grads[0]}, StateLeaves(leaves),
                         {"version": 4})
    got = _assembled(start_frames("s", start, chunk_bytes=3))
    assert isinstance(got, StartMessage) and got.start.progress == start.progress
    assert got.start.clock_state == {"version": 4} and got.start.params["w"].tobytes() == grads[0].tobytes()
    assert [(a.dtype, a.tobytes()) for a in got.start.opt_state.leaves] == [(a.dtype, a.tobytes()) for a in leaves]


def test_a_steps_frames_carry_the_roots_installed_before_it_and_its_digest_and_refuse_a_malformed_install():
    grads = [np.arange(6, dtype=np.float32).reshape(2, 3)]
    roots = (RootInstall(4, np.arange(18, dtype=np.float32).reshape(2, 3, 3), np.array([0.5, 1e-3], np.float32)),
             RootInstall(6, np.ones((1, 2, 2), np.float32), np.zeros(1, np.float32)))
    message = _assembled(step_frames("s", StepRecord(7, ((6, "a", 3),), 1.0, 0.0), grads, chunk_bytes=7, roots=roots))
    assert [g.tobytes() for g in message.grads] == [grads[0].tobytes()]
    assert [(r.step, r.roots.tobytes(), r.errors.tobytes()) for r in message.roots] == [
        (r.step, r.roots.tobytes(), r.errors.tobytes()) for r in roots]
    plain = _assembled(step_frames("s", StepRecord(7, (), 1.0, 0.0), grads))
    assert plain.roots == () and plain.digest is None
    assert _assembled(step_frames("s", StepRecord(50, (), 1.0, 0.0), grads, digest=0xFFFFFFFF)).digest == 0xFFFFFFFF
    skewed = (RootInstall(4, np.ones((2, 3, 3), np.float32), np.ones(3, np.float32)),)
    with pytest.raises(ValueError, match=r"root install 0 \(step 4\) is float32 \[2, 3, 3\] with errors float32 \[3\]"):
        _assembled(step_frames("s", StepRecord(7, (), 1.0, 0.0), grads, roots=skewed))


def test_frames_out_of_place_overlapping_or_short_are_refused_naming_the_fault():
    frames = list(step_frames("s", StepRecord(1, (), 1.0, 0.0), [np.ones(4, np.float32)], chunk_bytes=8))
    begin, first, second, end = frames
    cases = {
        "outside a message": [first],
        "began inside": [begin, begin],
        r"got bytes \[0, 8\) after 8": [begin, first, first],
        "ended short": [begin, first, end],
        "never began": [end],
    }
    for match, sequence in cases.items():
        assembler = FrameAssembler()
        with pytest.raises(ValueError, match=match):
            for frame in sequence:
                assembler.add(frame)
    strange = replica_pb2.ReplicaFrame()
    strange.CopyFrom(begin)
    strange.begin.arrays[0].dtype = "object"
    with pytest.raises(ValueError, match="array 0 is object"):
        FrameAssembler().add(strange)
    with pytest.raises(ValueError, match="cannot be replicated"):
        list(step_frames("s", StepRecord(1, (), 1.0, 0.0), [np.array(["x"])]))
    undecodable = replica_pb2.ReplicaFrame()
    undecodable.CopyFrom(begin)
    undecodable.begin.meta_json = '{"version": 1}'
    assembler = FrameAssembler()
    assembler.add(undecodable)
    assembler.add(first)
    assembler.add(second)
    with pytest.raises(ValueError, match="description does not decode"):
        assembler.add(end)


def test_a_start_whose_state_is_not_the_sessions_is_refused_and_nothing_is_held():
    config = config_of(Mode.ASYNC)
    primary = shard_session(config, HomeClock(config))
    standby = shard_session(config, HomeClock(config), initialized=False)
    params, opt_state = primary.updater.host_state()
    import jax

    leaves = jax.tree.leaves(opt_state)
    follower = StandbyFollower(standby.durability.start_from, standby.durability.follow, None, ["w", "b"], "test")
    try:
        wrong = ReplicaStart(ShardProgress(0, 0, {}, {}, 0), params, StateLeaves(tuple(leaves[:-1])), None)
        with pytest.raises(Unavailable, match="state has"):
            follower.start(wrong)
        bad_shape = dict(params, w=np.zeros((4, 3), np.float32))
        with pytest.raises(Unavailable, match="tensor 'w'"):
            follower.start(ReplicaStart(ShardProgress(0, 0, {}, {}, 0), bad_shape, StateLeaves(tuple(leaves)), None))
    finally:
        follower.close()
