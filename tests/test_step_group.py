"""The steps of one attempt end together (client/_step_stream.py): a shard whose call fails ends
its peers' parts at once, also when its call failed before the step had joined the attempt's
group (a shard that refuses at once, e.g. while it restores its sessions). Otherwise the peer
part read first waits on a vote the failed shard never casts: the vote timeout, then the step's
own deadline. A shard that answers DEADLINE_EXCEEDED ends its peers' parts half a second later:
they wait on the same step with the same deadline, and the home shard's own answer says more.

The gRPC calls here are stand-ins with grpc's call interface (iteration, ``cancel``, ``done``,
``add_done_callback``, ``code``); the stream, handle and group are the SDK's own.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from optserve.client._step_stream import PEER_DEADLINE_GRACE_S, StepStream, step_group
from optserve.client.errors import DeadlineExceededError, UnavailableError
from optserve.protos import contract
from tests._grpc_fakes import FailedCall


class _RefusedCall(FailedCall):
    """A call the shard ended with UNAVAILABLE before anything read it; gRPC runs a done
    callback added to an ended call at once."""

    def __init__(self):
        super().__init__(grpc.StatusCode.UNAVAILABLE, "session 'x': this shard is restoring its sessions; retry")

    def __iter__(self):
        raise self

    def done(self):
        return True

    def cancel(self):
        return False

    def add_done_callback(self, fn):
        fn(self)


class _WaitingCall:
    """A call whose shard waits (on a vote) until the client cancels it."""

    def __init__(self):
        self._cancelled = threading.Event()

    def __iter__(self):
        return self

    def __next__(self):
        self._cancelled.wait()
        raise FailedCall(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")

    def cancel(self):
        self._cancelled.set()
        return True

    def done(self):
        return self._cancelled.is_set()

    def add_done_callback(self, fn):
        pass


def test_a_part_refused_before_it_joined_the_attempt_ends_the_waiting_part_at_once():
    waiting = _WaitingCall()
    home = StepStream(lambda requests, timeout: waiting, timeout=3.0)
    peer = StepStream(lambda requests, timeout: _RefusedCall(), timeout=3.0)
    with step_group():
        handles = [home.start([]), peer.start([])]  # the peer's call has failed by the time start returns
    started = time.monotonic()
    with pytest.raises(UnavailableError, match="restoring its sessions"):
        handles[0].finish(lambda kind, value: False)
    assert time.monotonic() - started < 1.0  # not the step's deadline (3 s here, the client's timeout in use)
    with pytest.raises(grpc.RpcError):
        handles[1].finish(lambda kind, value: False)


class _TimingOutCall:
    """A call whose shard's wait for the step runs out ``after_s`` after it starts: it then ends
    with DEADLINE_EXCEEDED (the shard's own status, marked answered unless ``answered`` is False:
    gRPC's own deadline), unless the client cancelled it before (CANCELLED)."""

    def __init__(self, after_s: float, details: str, answered: bool = True):
        self._answer_at = time.monotonic() + after_s
        self._details, self._answered = details, answered
        self._cancelled = threading.Event()

    def __iter__(self):
        return self

    def __next__(self):
        if self._cancelled.wait(max(0.0, self._answer_at - time.monotonic())):
            raise FailedCall(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")
        trailing = ((contract.ANSWERED_KEY, "1"),) if self._answered else ()
        raise FailedCall(grpc.StatusCode.DEADLINE_EXCEEDED, self._details, trailing)

    def done(self):
        return self._cancelled.is_set() or time.monotonic() >= self._answer_at

    def cancel(self):
        if self.done():
            return False
        self._cancelled.set()
        return True

    def add_done_callback(self, fn):
        pass


MEMBERS = "step 1 did not complete within 2.0 s; min_workers=2, members now: a, b; not pushed: b"


def _home_and_peer(home_call, peer_call):
    home = StepStream(lambda requests, timeout: home_call, timeout=3.0)
    peer = StepStream(lambda requests, timeout: peer_call, timeout=3.0)
    with step_group():
        return home.start([]), peer.start([])


def test_the_home_shards_own_deadline_answer_is_kept_when_a_peers_comes_first():
    """Both shards wait on the same step with the same deadline: the home shard's answer (which
    names an elastic session's members that did not push) is not cut off by a peer's that came
    a moment earlier."""
    home, peer = _home_and_peer(_TimingOutCall(0.05, MEMBERS), _TimingOutCall(0.0, "step 1 did not complete"))
    with pytest.raises(grpc.RpcError) as peer_error:
        peer.finish(lambda kind, value: False)
    with pytest.raises(grpc.RpcError) as home_error:
        home.finish(lambda kind, value: False)
    assert peer_error.value.code() == home_error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "not pushed: b" in home_error.value.details()


def test_a_part_whose_call_ended_on_its_own_answers_its_own_status_whenever_it_is_read():
    home, peer = _home_and_peer(_TimingOutCall(0.05, MEMBERS), _TimingOutCall(0.0, "step 1 did not complete"))
    with pytest.raises(grpc.RpcError):
        peer.finish(lambda kind, value: False)
    time.sleep(PEER_DEADLINE_GRACE_S + 0.3)  # the peer's failure has ended the group by now
    with pytest.raises(grpc.RpcError) as home_error:
        home.finish(lambda kind, value: False)
    assert "not pushed: b" in home_error.value.details()


def test_a_peer_that_does_not_answer_is_ended_soon_after_a_shards_deadline_answer():
    home, peer = _home_and_peer(_TimingOutCall(0.0, "step 1 did not complete"), _WaitingCall())  # its host is gone
    with pytest.raises(grpc.RpcError):
        home.finish(lambda kind, value: False)
    started = time.monotonic()
    with pytest.raises(DeadlineExceededError, match="a peer shard's part of this step failed"):
        peer.finish(lambda kind, value: False)
    assert time.monotonic() - started < PEER_DEADLINE_GRACE_S + 1.0  # not the step's deadline (3 s)


def test_a_deadline_the_shard_did_not_answer_ends_the_peers_at_once():
    """gRPC's own deadline on a call (no answer from its shard) says nothing a peer's answer
    would add: the peers end at once, as for UNAVAILABLE."""
    home, peer = _home_and_peer(_WaitingCall(), _TimingOutCall(0.0, "Deadline Exceeded", answered=False))
    with pytest.raises(grpc.RpcError):
        peer.finish(lambda kind, value: False)
    started = time.monotonic()
    with pytest.raises(DeadlineExceededError, match="a peer shard's part of this step failed"):
        home.finish(lambda kind, value: False)
    assert time.monotonic() - started < PEER_DEADLINE_GRACE_S


class _AnsweringCall(_WaitingCall):
    """A call that answers each step with ``done``, until the shard ends it."""

    def __next__(self):
        if self._cancelled.is_set():
            raise FailedCall(grpc.StatusCode.CANCELLED, "ended by the shard while idle")
        return "done", None


def test_a_step_is_never_sent_into_a_call_that_ended_while_idle():
    """A shard may end an idle call (crowded, or on its way down): the next step opens a fresh
    call instead of being sent into the ended one (where no shard reads it)."""
    calls = []

    def open_call(requests, timeout):
        calls.append(_AnsweringCall())
        return calls[-1]

    stream = StepStream(open_call, timeout=3.0)
    assert stream.start([]).finish(lambda kind, value: kind == "done")
    calls[0].cancel()  # the shard ends the idle call
    second = stream.start([])
    assert len(calls) == 2 and second._responses is calls[1] and not second._reused
    assert second.finish(lambda kind, value: kind == "done")
