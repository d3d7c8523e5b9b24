"""The vote among a session's shards on each push: it applies on every shard or on none.

In an auto-commit session every shard that holds tensors of the push stages its part, then
votes at the home clock (``staged`` True, or False with its own refusal). :class:`ShardVotes`
decides the push (the home clock hands out its ticket) only once every shard voted True; one
refusal, a shard that does not vote within the voter's ``timeout_s``, or a shard known to be down
refuses it everywhere. Every voter of the push gets the same outcome.
"""

from __future__ import annotations

import copy
import time
from typing import Callable, Optional, Union

from optserve.server.domain.clock.clock_records import Ticket
from optserve.server.domain.errors import OptservError, PeerRefused
from optserve.server.domain.waits import SignalCondition, Steps, drive

_STALE_VOTE_S = 300.0  # a decided vote some shard never took part in is forgotten after this long
_FORGET_FROM = 32  # open votes kept before the stale ones are looked for


class _PushVote:
    """The votes on one push: shard index -> staged?, and the outcome once decided."""

    __slots__ = ("votes", "outcome", "taken", "started", "retried")

    def __init__(self):
        self.votes: dict[int, bool] = {}
        self.outcome: Union[Ticket, OptservError, None] = None
        self.taken = 0  # voters that took the outcome
        self.started = time.monotonic()
        # Decided without a vote the client cannot have: a shard that never staged in time or is
        # down. The client retries the push, and its new votes must meet in a fresh vote (a
        # missing shard's next vote would otherwise take this vote's outcome, and the others'
        # votes open yet another vote that waits in vain: every retry failing the same way).
        self.retried = False


class ShardVotes:
    """The votes of ``participants`` shards on the pushes of one session (thread-safe).

    Args:
      participants: shards holding tensors of the session (more than one: a single shard
        decides alone, without voting).
      cond: the home clock's condition; its lock guards the votes and the clock's state alike.
      decide: ``(client_id, sequence, base_version) -> Ticket``, called with the lock held once
        every shard staged the push; raises the push's refusal (an :class:`OptservError`).
    """

    def __init__(self, participants: int, cond: SignalCondition,
                 decide: Callable[[str, int, int], Ticket]):
        self._participants = participants
        self._cond = cond
        self._decide = decide
        self._open: dict[tuple[str, int, int], _PushVote] = {}  # (client_id, sequence, attempt) -> its vote
        self._down: dict[int, OptservError] = {}  # shard index -> why (restarting), see peer_down
        self._abandoned: Optional[OptservError] = None

    def vote(self, client_id: str, sequence: int, base_version: int, shard_index: int, staged: bool,
             timeout_s: float, attempt: int = 0) -> Optional[Ticket]:
        """:meth:`vote_steps`, waiting in this thread."""
        return drive(self.vote_steps(client_id, sequence, base_version, shard_index, staged, timeout_s, attempt))

    def vote_steps(self, client_id: str, sequence: int, base_version: int, shard_index: int, staged: bool,
                   timeout_s: float, attempt: int = 0) -> Steps[Optional[Ticket]]:
        """One shard's stage outcome on the client's try ``attempt`` of the push; returns the
        ticket once every shard staged.

        Each try is voted on apart: a shard's message of a try the client gave up on (it heard
        another shard's refusal and tried again), arriving late, takes that try's outcome and
        never joins the next try's vote, which would then be decided on a vote its client no longer
        sends, leaving the next try's other part to wait out ``timeout_s`` (0: an unnumbered try,
        voted on under the push's identity alone).

        The push is decided only when all participants voted ``staged=True``; one refusal, or a
        shard that does not vote within ``timeout_s``, refuses it everywhere (:class:`PeerRefused`).
        Every voter gets the same outcome, also one that votes after the refusal; a refusing voter
        gets None at once (it reports its own error). A shard voting again on a decided push is a
        retry: the push is decided afresh.

        Raises:
          the push's refusal, or the session's error once :meth:`abandon` ended it.
        """
        key = (client_id, sequence, attempt)
        with self._cond:
            if self._abandoned is not None:
                raise self._abandoned
            push_vote = self._vote_on(key, shard_index)
            push_vote.votes[shard_index] = staged
            if push_vote.outcome is None:
                self._decide_if_known(push_vote, client_id, sequence, base_version, shard_index, staged)
        deadline = time.monotonic() + timeout_s
        while True:
            with self._cond:
                if push_vote.outcome is None and not self._refuse_if_late(push_vote, client_id, sequence, timeout_s,
                                                                          deadline):
                    wait = self._cond.wait_step(max(0.0, deadline - time.monotonic()))
                else:
                    push_vote.taken += 1
                    # Kept until every shard voted: a refusal that arrives before a peer's vote must still
                    # answer that vote (the peer would otherwise wait for the vote timeout). Not a vote
                    # its client retries: a late vote of it starts a vote of its own, and is refused there.
                    if ((push_vote.taken >= self._participants or push_vote.retried)
                            and self._open.get(key) is push_vote):
                        del self._open[key]
                    outcome = push_vote.outcome
                    break
            yield wait  # the lock released: the other shards' votes come in
        if not staged:
            return None
        if isinstance(outcome, BaseException):  # each voter its own copy: the kept outcome holds no voter's frames
            raise copy.copy(outcome)
        return outcome

    def _vote_on(self, key: tuple[str, int, int], shard_index: int) -> _PushVote:
        """The push's open vote; a fresh one for its first vote, or for a shard voting again on a
        decided push (a retry, decided afresh). Lock held."""
        push_vote = self._open.get(key)
        if push_vote is None or (push_vote.outcome is not None and shard_index in push_vote.votes):
            push_vote = self._open[key] = _PushVote()
            self._forget_stale_votes()
        return push_vote

    def _decide_if_known(self, push_vote: _PushVote, client_id: str, sequence: int, base_version: int,
                         shard_index: int, staged: bool) -> None:
        """Decides an undecided push when this vote settles it: a shard that has not voted is
        down, this shard refused, or every shard staged (lock held; voters waiting are woken)."""
        down = next((error for index, error in self._down.items() if index not in push_vote.votes), None)
        if down is not None:
            push_vote.outcome, push_vote.retried = down, True
        elif not staged:
            push_vote.outcome = PeerRefused(
                f"push {sequence} of client {client_id!r} was refused by shard {shard_index}; applied on no shard")
        elif len(push_vote.votes) >= self._participants:
            try:
                push_vote.outcome = self._decide(client_id, sequence, base_version)
            except OptservError as exc:  # kept without the frames it was raised through
                push_vote.outcome = exc.with_traceback(None)
        if push_vote.outcome is not None:
            self._cond.notify_all()

    def _refuse_if_late(self, push_vote: _PushVote, client_id: str, sequence: int, timeout_s: float,
                        deadline: float) -> bool:
        """Refuses the undecided push once ``deadline`` passed (lock held); returns whether it did."""
        if time.monotonic() < deadline:
            return False
        missing = sorted(set(range(self._participants)) - set(push_vote.votes))
        push_vote.outcome = PeerRefused(
            f"push {sequence} of client {client_id!r} was not staged on every shard within "
            f"{timeout_s:.0f} s (shards {missing} did not vote); applied on no shard")
        push_vote.retried = True
        self._cond.notify_all()
        return True

    def _forget_stale_votes(self) -> None:
        """Drops decided votes that some shard never took part in (its client vanished), once old."""
        if len(self._open) < _FORGET_FROM:
            return
        now = time.monotonic()
        for key in [k for k, v in self._open.items() if v.outcome is not None and now - v.started > _STALE_VOTE_S]:
            del self._open[key]

    def abandon(self, error: OptservError) -> None:
        """The session ended: undecided votes, and every later one, fail with ``error``."""
        with self._cond:
            self._abandoned = error
            for push_vote in self._open.values():
                if push_vote.outcome is None:
                    push_vote.outcome = error
            self._cond.notify_all()

    def peer_down(self, shard_index: int, error: OptservError) -> None:
        """Shard ``shard_index`` died (and is being restarted): votes waiting for it end now with
        ``error``, and so do later ones until :meth:`peer_up`, instead of at their timeout."""
        with self._cond:
            self._down[shard_index] = error
            for push_vote in self._open.values():
                if push_vote.outcome is None and shard_index not in push_vote.votes:
                    push_vote.outcome, push_vote.retried = error, True
            self._cond.notify_all()

    def peer_up(self, shard_index: int) -> None:
        """Shard ``shard_index`` serves the session again."""
        with self._cond:
            self._down.pop(shard_index, None)
