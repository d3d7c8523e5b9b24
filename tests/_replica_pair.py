"""A primary shard session and its standby, in this process: the pieces the replica tests share
(tests/test_replica_follow.py links them directly, tests/test_replica_stream.py over gRPC)."""

from __future__ import annotations

import json
from typing import Callable, Optional

import numpy as np

from optserve.optim_kernels import build_optimizer
from optserve.protos.optserve.v1 import tensor_pb2
from optserve.server.compute.updater import Updater
from optserve.server.domain.clock.home_clock import HomeClock
from optserve.server.domain.config import DType, Mode, SessionConfig, StalenessPolicy, TensorSpec
from optserve.server.domain.shard.replica import LocalLink, ReplicaPort, StandbyFollower
from optserve.server.domain.shard.shard_session import PushHeader, ShardSession


SHAPES = {"w": (3, 4), "b": (4,)}
ADAM = ("adam", {"learning_rate": 0.01})
PARAM_SPECS = {n: (s, np.float32) for n, s in SHAPES.items()}


def chunks(values: dict[str, np.ndarray]) -> list:
    return [tensor_pb2.TensorChunk(name=n, dtype=tensor_pb2.DTYPE_FLOAT32, shape=list(v.shape), data=v.tobytes())
            for n, v in values.items()]


def values(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def config_of(mode: Mode, workers: int = 1, optimizer: tuple = ADAM) -> SessionConfig:
    specs = tuple(TensorSpec(n, DType.FLOAT32, s) for n, s in SHAPES.items())
    return SessionConfig("mirrored", specs, optimizer[0], optimizer[1], mode=mode, num_workers=workers,
                         staleness_policy=StalenessPolicy.SCALE)


def adam_updater() -> Updater:
    return Updater(build_optimizer(*ADAM), param_specs=PARAM_SPECS)


def shard_session(config: SessionConfig, clock: HomeClock, initialized: bool = True,
                  updater: Callable[[], Updater] = adam_updater) -> ShardSession:
    session = ShardSession(config, list(SHAPES), 0, clock, updater(), step_timeout_s=20.0, vote_timeout_s=20.0)
    if initialized:
        session.initialize(chunks(values(0)))
    return session


class Pair:
    """A primary and a standby started from its state in memory (now), linked in this process
    (or by ``link(follower)``, the primary's port to it)."""

    def __init__(self, config: SessionConfig, primary: Optional[ShardSession] = None,
                 link: Callable[[StandbyFollower], ReplicaPort] = LocalLink, updater: Callable[[], Updater] = adam_updater):
        self.primary = primary or shard_session(config, HomeClock(config), updater=updater)
        standby_clock = HomeClock(config)
        self.standby = shard_session(config, standby_clock, initialized=False, updater=updater)
        self.follower = StandbyFollower(self.standby.durability.start_from, self.standby.durability.follow,
                                        standby_clock, list(SHAPES), self.standby.where)
        self.primary.durability.start_replica(link(self.follower))

    def push(self, client: str, sequence: int, base: int, seed: int) -> tuple[int, float]:
        """(the push's version, its scale), once acknowledged."""
        receipt = self.primary.push(PushHeader(client, sequence, base), chunks(values(seed)))
        receipt.durable()  # the acknowledgement: the standby holds the step
        assert self.follower.held.held >= receipt.version
        return receipt.version, receipt.scale

    def assert_equal(self) -> None:
        version = self.primary.version
        assert self.follower.wait_applied(version, timeout_s=30), self.follower.error
        assert self.standby.version == version
        ours, theirs = self.primary.updater.host_state(), self.standby.updater.host_state()
        for name in SHAPES:
            assert ours[0][name].tobytes() == theirs[0][name].tobytes(), name
        import jax

        leaves = jax.tree_util.tree_leaves(ours[1]), jax.tree_util.tree_leaves(theirs[1])
        assert len(leaves[0]) == len(leaves[1]) > 0
        assert all(np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in zip(*leaves))
        mine, its = (clock_json(s.clock) for s in (self.primary, self.standby))
        assert mine == its

    def close(self) -> None:
        self.follower.close()


def clock_json(clock: HomeClock) -> dict:
    """The clock's durable state without what depends on when this process booked it."""
    state = clock.durable_state(lambda: None)
    state.pop("checkpoint_time", None)
    for record in state.get("rounds", []):
        if isinstance(record, dict):
            record.pop("duration_s", None)
    return json.loads(json.dumps(state, sort_keys=True, default=str))
