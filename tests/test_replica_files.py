"""A promoted standby of a durable session takes its files (``SessionDurability.take_files``):
what its lost primary logged and checkpointed past the standby's version (never acknowledged:
the standby held none of it) is cut off, the primary is fenced off the files, and a restore from
disk finds the promoted standby's state, with the steps it applied after its promotion.

Real pieces, no Ray: a durable primary shard session on a real ``ShardStore`` in a temporary
folder and a standby linked in this process (tests/_replica_pair.py), whose link stops passing
steps on when the test says (the primary's last steps never reach it)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from optserve.server.domain.clock.home_clock import HomeClock
from optserve.server.domain.config import Mode
from optserve.server.domain.durability import DurabilityConfig
from optserve.server.domain.errors import OptservError
from optserve.server.domain.shard.replica import LocalLink
from optserve.server.domain.shard.shard_session import PushHeader
from optserve.server.storage import ShardStore, StepLogReader
from optserve.server.storage.ownership import ShardFence, claim_shard
from tests._replica_pair import SHAPES, Pair, chunks, config_of, shard_session, values



def _arrays() -> dict:
    return {n: np.empty(s, np.float32) for n, s in SHAPES.items()}


class GatedLink(LocalLink):
    """:class:`LocalLink` that passes nothing on once ``cut`` (a primary whose steps stopped
    reaching its standby: they are applied and logged there, never acknowledged)."""

    cut = False

    def ship(self, record, grads, roots=(), digest=None) -> None:
        if not self.cut:
            super().ship(record, grads, roots, digest)

    def clock_entry(self, entry) -> None:
        if not self.cut:
            super().clock_entry(entry)


def _durable(config, root: str, durability: DurabilityConfig, fence=None):
    """A home shard session of ``config`` whose steps are logged in ``root`` (not initialized)."""
    store = ShardStore(root, config.name, 0, durability, home=True, fence=fence)
    clock = HomeClock(config, checkpoints=durability.policy(config.gradient_bytes), journal=store.log.journal_entry)
    session = shard_session(config, clock, initialized=False)
    return session, store


def _params(session) -> dict[str, bytes]:
    params, _state = session.updater.host_state()
    return {name: np.asarray(params[name]).tobytes() for name in SHAPES}


def _primary_and_standby(root: str, durability: DurabilityConfig, config):
    primary, primary_store = _durable(config, root, durability, ShardFence(root, 0, claim_shard(root, 0)))
    primary_store.start_logs(None)
    primary.durability.attach_store(primary_store)
    primary.initialize(chunks(values(0)))
    links = []
    pair = Pair(config, primary=primary, link=lambda follower: links.append(GatedLink(follower)) or links[-1])
    return pair, primary_store, links[0]


def _promote_serve_and_restore(pair, root: str, durability: DurabilityConfig, config, version: int):
    """Promotes the standby (at ``version``) onto the files, pushes one step there and restores
    a fresh part from disk: it must reach the standby's version and parameters. Returns the
    version of the latest checkpoint once the standby took the files."""
    assert pair.follower.promote(timeout_s=30) == version
    standby_store = ShardStore(root, config.name, 0, durability, home=True,
                               fence=ShardFence(root, 0, claim_shard(root, 0)))
    pair.standby.durability.take_files(standby_store, _arrays, standby_store.log.journal_entry)
    durable_version = standby_store.durable_version
    with pytest.raises((OSError, OptservError)):  # the old primary is fenced off the files
        pair.primary.push(PushHeader("a", 9, version), chunks(values(9))).durable()
    receipt = pair.standby.push(PushHeader("b", 0, version), chunks(values(42)))  # the promoted standby serves
    receipt.durable()
    assert receipt.version == version + 1
    expected = _params(pair.standby)
    pair.standby.durability.close_store()
    restored, store = _durable(config, root, durability)
    assert restored.durability.restore(store, StepLogReader, store.log.journal) == version + 1
    assert _params(restored) == expected  # its step, not the primary's
    store.close()
    return durable_version


def test_a_promoted_standby_cuts_off_what_its_primary_logged_past_it_and_a_restore_finds_its_state(tmp_path):
    root = str(tmp_path)
    durability = DurabilityConfig(root, every_steps=2)
    config = config_of(Mode.ASYNC)
    pair, primary_store, link = _primary_and_standby(root, durability, config)
    try:
        for step in range(3):  # acknowledged: held by the standby too
            assert pair.push("a", step, step, seed=step + 1)[0] == step + 1
        link.cut = True
        for step in range(3, 5):  # applied, logged and checkpointed (at 4) on the primary alone
            pair.primary.push(PushHeader("a", step, step), chunks(values(step + 1)))
        primary_store.wait()
        assert primary_store.durable_version == 4
        # the checkpoint at 4 is rolled back; the old log reaches 3: no checkpoint is written
        assert _promote_serve_and_restore(pair, root, durability, config, 3) < 3
    finally:
        pair.close()
        pair.primary.durability.close_store()


def _three_steps_then_primary_lost(root: str, durability: DurabilityConfig, config):
    """A primary and its standby, three steps acknowledged by both, then the primary's files
    closed (its process lost)."""
    pair, primary_store, _link = _primary_and_standby(root, durability, config)
    for step in range(3):
        assert pair.push("a", step, step, seed=step + 1)[0] == step + 1
    primary_store.close()
    return pair, primary_store


def test_a_promoted_standby_ahead_of_its_primarys_log_commits_a_checkpoint_before_it_serves(tmp_path):
    root, config = str(tmp_path), config_of(Mode.ASYNC)
    durability = DurabilityConfig(root, every_steps=100)
    pair, primary_store = _three_steps_then_primary_lost(root, durability, config)
    try:  # the primary died after shipping step 3, before its record reached the disk:
        segment = primary_store.log.segments(primary_store.latest())[-1]
        reader = StepLogReader(segment, lambda: {n: np.empty(s, np.float32) for n, s in SHAPES.items()})
        assert [int(header["version"]) for header, _ in reader] == [1, 2, 3]
        os.truncate(segment, reader.last_at)  # its log ends at 2
        assert _promote_serve_and_restore(pair, root, durability, config, 3) == 3
    finally:
        pair.close()


def test_a_promoted_home_part_whose_ticket_journal_lacks_a_decided_ticket_commits_a_checkpoint(tmp_path):
    """The primary's last journal line never reached the disk (a machine lost before the page
    cache was written back) while its step record did: a restore from those files would skip a
    decided ticket, so the promoted part checkpoints its clock's state first."""
    root, config = str(tmp_path), config_of(Mode.ASYNC)
    durability = DurabilityConfig(root, every_steps=100)
    pair, primary_store = _three_steps_then_primary_lost(root, durability, config)
    try:
        journal = sorted(p for p in os.listdir(primary_store.folder) if p.startswith("tickets-"))[-1]
        path = os.path.join(primary_store.folder, journal)
        lines = open(path, "rb").read().splitlines(keepends=True)
        assert lines[-1].startswith(b"[2,")  # the third ticket's line ...
        os.truncate(path, os.path.getsize(path) - len(lines[-1]))  # ... is lost
        assert _promote_serve_and_restore(pair, root, durability, config, 3) == 3
    finally:
        pair.close()
