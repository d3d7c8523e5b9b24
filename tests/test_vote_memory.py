"""What a session's votes keep over a long run (issue 60's soak): a decided vote some shard never
took part in stays open for that shard, holding its outcome, not the frames its voters raised it
through, and it is forgotten once stale, so a clock's open votes stay few whatever the run's length.

Real pieces: the home clock's ShardVotes, voters in threads."""

from __future__ import annotations

import concurrent.futures
import gc
import weakref

import pytest

from optserve.server.domain.clock import votes as votes_module
from optserve.server.domain.clock.votes import ShardVotes
from optserve.server.domain.errors import PeerRefused
from optserve.server.domain.waits import SignalCondition


class _Payload:
    """Stands for what a voter's frames hold (a step's buffers, its call's futures)."""


def _refused_with_a_shard_missing(votes: ShardVotes, sequence: int, pool) -> None:
    """Shard 0 stages the push and waits; shard 1 refuses it; shard 2 never votes (its client
    vanished): the vote stays open for shard 2, decided."""
    def staged_voter():
        payload = _Payload()  # a local of the frame the refusal is raised through
        held.append(weakref.ref(payload))
        votes.vote("c", sequence, 0, 0, True, timeout_s=30.0)

    held: list = []
    waiting = pool.submit(staged_voter)
    assert votes.vote("c", sequence, 0, 1, False, timeout_s=30.0) is None
    with pytest.raises(PeerRefused, match="refused by shard 1"):
        waiting.result(timeout=30)
    return held[0]


def test_a_kept_refusal_holds_none_of_the_frames_it_was_raised_through():
    votes = ShardVotes(3, SignalCondition(), decide=lambda *args: pytest.fail("decided"))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        payload = _refused_with_a_shard_missing(votes, 0, pool)
    gc.collect()
    assert payload() is None  # the raising voter's locals went with its frames
    kept = votes._open[("c", 0, 0)].outcome
    assert isinstance(kept, PeerRefused) and kept.__traceback__ is None


def test_stale_decided_votes_are_forgotten_so_open_votes_stay_few(monkeypatch):
    votes = ShardVotes(3, SignalCondition(), decide=lambda *args: pytest.fail("decided"))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        for sequence in range(votes_module._FORGET_FROM):
            _refused_with_a_shard_missing(votes, sequence, pool)
        assert len(votes._open) == votes_module._FORGET_FROM  # kept for the shard that never voted
        monkeypatch.setattr(votes_module, "_STALE_VOTE_S", 0.0)  # as if they had waited that long
        _refused_with_a_shard_missing(votes, 10_000, pool)
    assert len(votes._open) == 1  # only the newest (decided, but not stale when it opened)
