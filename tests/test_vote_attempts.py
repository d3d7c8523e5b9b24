"""The shards' vote on a push, try by try: a shard's message of a try its client gave up on (it
heard another shard refuse, then tried again), arriving late, takes that try's refusal and never
joins the next try's vote. Before tries were told apart, the late message decided the next try's
vote in its place, and the next try's own part then waited out the whole vote timeout (a full
disk or a restarting shard stalled a session for 30 s at a time)."""

from __future__ import annotations

import threading
import time

import pytest

from optserve.server.domain.clock.clock_records import Ticket
from optserve.server.domain.clock.votes import ShardVotes
from optserve.server.domain.errors import PeerRefused
from optserve.server.domain.waits import SignalCondition

TIMEOUT_S = 5.0


def _votes() -> tuple[ShardVotes, list]:
    decided = []

    def decide(client_id, sequence, base_version):
        decided.append((client_id, sequence))
        return Ticket(len(decided) - 1, client_id, sequence, 0, 1.0, True, len(decided))

    return ShardVotes(2, SignalCondition(), decide), decided


def test_a_late_vote_of_an_abandoned_try_takes_its_refusal_and_the_next_try_is_decided_at_once():
    votes, decided = _votes()
    assert votes.vote("c", 7, 0, 1, False, TIMEOUT_S, attempt=1) is None  # shard 1 refuses try 1 (disk full)
    answers = {}
    retry = threading.Thread(target=lambda: answers.setdefault(1, votes.vote("c", 7, 0, 1, True, TIMEOUT_S, attempt=2)))
    retry.start()  # the client's try 2 on shard 1, the disk back: staged, waiting for shard 0
    time.sleep(0.2)
    with pytest.raises(PeerRefused):  # shard 0's part of try 1, arriving only now
        votes.vote("c", 7, 0, 0, True, TIMEOUT_S, attempt=1)
    started = time.monotonic()
    ticket = votes.vote("c", 7, 0, 0, True, TIMEOUT_S, attempt=2)  # shard 0's part of try 2
    retry.join(TIMEOUT_S + 1)
    assert time.monotonic() - started < 1.0, "the try waited for its vote timeout"
    assert isinstance(ticket, Ticket) and answers[1] == ticket and decided == [("c", 7)]


def test_unnumbered_tries_are_still_decided_afresh_when_a_shard_votes_again():
    votes, decided = _votes()
    assert votes.vote("c", 1, 0, 1, False, TIMEOUT_S) is None
    with pytest.raises(PeerRefused):
        votes.vote("c", 1, 0, 0, True, TIMEOUT_S)
    answers = {}
    other = threading.Thread(target=lambda: answers.setdefault(1, votes.vote("c", 1, 0, 1, True, TIMEOUT_S)))
    other.start()
    ticket = votes.vote("c", 1, 0, 0, True, TIMEOUT_S)
    other.join(TIMEOUT_S + 1)
    assert answers[1] == ticket and decided == [("c", 1)]
