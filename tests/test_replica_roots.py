"""A standby of a session whose matrix roots come from preconditioner workers installs the roots
its primary installed, before the same updates, so it holds the primary's state bit for bit even
though the workers answer whenever they do (an age bound above 0); once promoted it asks the
workers for its own.

Real pieces: two shard sessions linked in this process (``tests/_replica_pair.py``), real
preconditioner workers on the local Ray, Shampoo's and SOAP's kernels. The client pauses at
random between pushes, so which roots have arrived at each update differs from run to run: a
standby that computed its own would install others, at other steps.
"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from optserve.server.compute.root_offload import OffloadedPreconditioners, RootInstall, build_shard_optimizer
from optserve.server.compute.updater import Updater
from optserve.server.domain.config import Mode
from optserve.server.domain.durability import StepRecord
from optserve.server.domain.shard.replica import ReplicaGap
from optserve.server.domain.shard.shard_session import PushHeader
from tests._replica_pair import PARAM_SPECS, SHAPES, Pair, chunks, config_of, values
from tests._service_helpers import root_pool

OPTIMIZERS = {
    "shampoo": {"learning_rate": 0.05, "block_size": 4, "start_preconditioning_step": 2,
                "preconditioning_compute_steps": 2},
    "soap": {"learning_rate": 0.01, "precondition_frequency": 2},
}


@pytest.fixture(scope="module")
def pool(ray_local):
    yield from root_pool(ray_local, batch_blocks=2)


def _offloading(pool, name: str, max_age: int):
    """A factory of updaters whose roots come from ``pool``'s workers."""
    def updater() -> Updater:
        optimizer, preconditioners = build_shard_optimizer(name, OPTIMIZERS[name], SHAPES, pool, max_age=max_age)
        assert isinstance(preconditioners, OffloadedPreconditioners)
        return Updater(optimizer, preconditioners, PARAM_SPECS)
    return updater


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_standby_installs_its_primarys_roots_and_holds_its_state_bit_for_bit_then_computes_its_own_once_promoted(
        pool, name):
    pair = Pair(config_of(Mode.ASYNC, optimizer=(name, OPTIMIZERS[name])), updater=_offloading(pool, name, max_age=4))
    primary, standby = pair.primary.updater.preconditioners, pair.standby.updater.preconditioners
    pauses = random.Random(name)
    try:
        version = 0
        for step in range(50):
            version, _ = pair.push("a", step, version, seed=step)
            time.sleep(pauses.choice([0.0, 0.0, 0.005, 0.03]))  # the workers answer at other steps each time
            if step in (9, 29):
                pair.assert_equal()
        pair.assert_equal()
        assert primary.roots_installed >= 10
        assert standby.roots_installed == primary.roots_installed
        assert standby.waits == 0 and not standby._jobs and standby._exported == -1  # it never asked the workers
        assert [b.age for b in standby.status().blocks] == [b.age for b in primary.status().blocks]

        assert pair.follower.promote(timeout_s=30) == 50
        pair.standby.durability.lead()
        installed = standby.roots_installed
        for step in range(50, 60):
            version = pair.standby.push(PushHeader("a", step, version), chunks(values(step))).version
        assert version == 60 and standby.roots_installed > installed  # its own, from the workers
        assert all(0 <= b.age <= 4 for b in standby.status().blocks)
    finally:
        pair.close()


def test_roots_shipped_to_a_standby_that_computes_its_own_in_its_update_stop_it_following():
    name = "shampoo"

    def in_update() -> Updater:
        optimizer, preconditioners = build_shard_optimizer(name, OPTIMIZERS[name], SHAPES, None)
        return Updater(optimizer, preconditioners, PARAM_SPECS)

    pair = Pair(config_of(Mode.ASYNC, optimizer=(name, OPTIMIZERS[name])), updater=in_update)
    try:
        pair.push("a", 0, 0, seed=1)
        roots = (RootInstall(0, np.eye(4, dtype=np.float32)[None], np.zeros(1, np.float32)),)
        pair.follower.receive(StepRecord(2, ((1, "a", 1),), 1.0, 0.0), [values(2)[n] for n in SHAPES], roots)
        assert not pair.follower.wait_applied(2, timeout_s=30)
        assert isinstance(pair.follower.error, ReplicaGap)
        assert "computes its roots inside its update" in str(pair.follower.error)
        with pytest.raises(ReplicaGap):  # it never serves in its primary's place
            pair.follower.promote(timeout_s=1)
    finally:
        pair.close()
