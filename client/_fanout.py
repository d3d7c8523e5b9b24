"""A session's shards as the client reaches them: one connection per shard, calls on every
shard in parallel, and retries that ride out a shard's recovery.

A session's tensors are spread over its shards (the coordinator's shard map: shard index,
address, tensor names). Every data-plane call goes to each shard that holds a part of the
session; a call succeeds only if every shard's part did, and otherwise raises the failure that
explains most (a refusing shard's own error, not its peers' :class:`PeerRefusedError`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import random
import time
from typing import Callable, Sequence, TypeVar

import grpc

from optserve.client._deadlines import DEADLINES
from optserve.client._loop_call import LoopStreamStream
from optserve.client._step_stream import current_group, joined, step_group, StepStream
from optserve.client.errors import (DeadlineExceededError, NotFoundError, OptservError, PeerRefusedError,
                                   SessionLostError, UnavailableError, from_rpc_error)
from optserve.protos import chunk_codec
from optserve.protos.optserve.v1 import control_pb2, data_pb2

T = TypeVar("T")
# A session with hot standbys: a first attempt still running after this long asks the coordinator
# (and again as often) whether a shard moved to its standby (a lost host answers nothing until the
# connection's keepalive gives up, seconds later).
SLOW_FIRST_ATTEMPT_S = 0.2
_log = logging.getLogger(__name__)

_SHARD_DATA = data_pb2.DESCRIPTOR.services_by_name["ShardData"]  # the generated service descriptor


def _method_path(method: str) -> str:
    """The gRPC path of ShardData's ``method``, read from the generated descriptor (a method the
    proto does not declare is a KeyError at import)."""
    return f"/{_SHARD_DATA.full_name}/{_SHARD_DATA.methods_by_name[method].name}"


_INIT_TENSORS, _PUSH, _PULL, _PUSH_PULL = map(_method_path, ("InitTensors", "Push", "Pull", "PushPull"))


class ShardCalls:
    """The chunk-carrying ShardData methods on one shard's channels, with the copy-saving codecs of
    :mod:`optserve.protos.chunk_codec` in place of the generated stub's: requests may be
    pre-encoded chunk messages (bytes) and responses arrive as ``(kind, value)`` pairs whose
    chunks are views, not copies. The other methods are the generated stub's
    (``Client.shard_data``)."""

    def __init__(self, channel: grpc.Channel, loop_channel: Callable[[], "grpc.aio.Channel"]):
        send = chunk_codec.serialize
        self.init_tensors = channel.stream_unary(_INIT_TENSORS, request_serializer=send,
                                                 response_deserializer=data_pb2.InitTensorsResponse.FromString)
        self.push = channel.stream_unary(_PUSH, request_serializer=send,
                                         response_deserializer=data_pb2.PushResponse.FromString)
        self.pull = channel.unary_stream(_PULL, request_serializer=send,
                                         response_deserializer=chunk_codec.chunk_or_message(data_pb2.PullResponse))
        # PushPull stays open between steps: on the process's event loop, where an open call and a
        # waiting step cost no polling (client/_loop_call.py)
        answers = chunk_codec.chunk_or_message(data_pb2.PushPullResponse)
        self.push_pull = LoopStreamStream(loop_channel, _PUSH_PULL, request_serializer=send, response_deserializer=answers,
                                          fallback=channel.stream_stream(_PUSH_PULL, request_serializer=send,
                                                                         response_deserializer=answers))


@dataclasses.dataclass(frozen=True)
class Shard:
    """One entry of the session's shard map, connected."""

    index: int
    address: str
    names: tuple[str, ...]  # the session's tensors this shard holds, in the shard map's order
    calls: ShardCalls
    steps: StepStream  # the shard's open PushPull call, reused by consecutive push_pull steps


def connect(client, info: control_pb2.SessionInfo) -> list[Shard]:
    """One :class:`Shard` per entry of the session's shard map (channels from ``client``)."""
    shards = []
    for s in info.shards:
        calls = ShardCalls(client.channel(s.address), functools.partial(client.loop_channel, s.address))
        shards.append(Shard(s.shard_index, s.address, tuple(s.tensor_names), calls,
                            StepStream(calls.push_pull, client.timeout, idle_s=client.stream_idle_s)))
    return shards


_CORE_REFUSED_WRITE = "Internal error from Core"
"""grpc.aio's details for a stream write that failed because the server had already ended the
call: it replaces the server's status with INTERNAL (grpc/grpc#36066; a quarter of such calls
here), so the status the server sent (UNIMPLEMENTED, say) is lost. The message whose write failed
never reached the server, so the step it carried was not applied there (a step is applied only
after its last message): retrying it, or writing its shared-memory region again, is safe."""


def call_shard(fn: Callable[[Shard], T], shard: Shard) -> T:
    """``fn(shard)``, its gRPC errors converted to client errors (retries happen above).

    UNIMPLEMENTED is UnavailableError: the shard map said a shard serves at this address, so
    another service answering there means the shard moved (a restarted server's shards took new
    ports and something else took this one); the map is read again and the call retried (and
    the UNIMPLEMENTED error raised if the map has not changed). A stream that the server ended
    while this client still wrote to it, whose status grpc.aio lost (:data:`_CORE_REFUSED_WRITE`),
    is UnavailableError too, retried even where the map has not changed: that other service's
    UNIMPLEMENTED ends a step's stream so, and so does a shard process that died and was started
    again at the same address (the message whose write failed never reached it)."""
    try:
        return fn(shard)
    except grpc.RpcError as exc:
        lost_status = exc.code() == grpc.StatusCode.INTERNAL and exc.details() == _CORE_REFUSED_WRITE
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED or lost_status:
            why = ("ended the step's stream while the client wrote to it, its status lost by grpc.aio"
                   if lost_status else f"is served by another service now ({exc.details()})")
            moved = UnavailableError(f"shard {shard.index}'s address {shard.address} {why}: the shard may have "
                                     "moved", "UNAVAILABLE")
            if not lost_status:
                moved.unmoved = from_rpc_error(exc)  # raised instead when the shard map has not changed
            raise moved from None
        raise from_rpc_error(exc) from None


def all_or_first_error(calls: Sequence[Callable[[], T]]) -> list[T]:
    """Every call's result, in order; runs all of them even when one fails, then raises the most
    telling failure: the first that is not a :class:`PeerRefusedError`; when all are, an
    :class:`UnavailableError` (the refusing shard's own answer came to no call of this attempt,
    e.g. it was restarting: the push applied nowhere and is retried with the same sequence)."""
    results, errors = [], []
    for call in calls:
        try:
            results.append(call())
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
    if errors:  # the refusing shard's own error explains more than its peers' PeerRefused
        own = next((e for e in errors if not isinstance(e, PeerRefusedError)), None)
        if own is None:  # the refusing shard's own answer is not among these (it was restarting): applied
            # nowhere, so the same push (same sequence) may be sent again
            raise UnavailableError(f"{errors[0].details}; retrying", "UNAVAILABLE")
        raise own
    return results


class ShardFanout:
    """The shards of one session object, and threads to call them in parallel.

    ``shards`` is the current shard map, connected; :meth:`refresh` replaces it when the
    coordinator moved a shard (a restart serves at a new address).
    """

    def __init__(self, client, info: control_pb2.SessionInfo):
        self._client = client
        self._session = info.config.name
        self.hot_standby = info.hot_standby  # a shard may move within a second of its host's loss
        self.shards: list[Shard] = connect(client, info)
        self._threads = concurrent.futures.ThreadPoolExecutor(max_workers=max(2, len(self.shards)),
                                                              thread_name_prefix="optserve-shard")

    def each(self, fn: Callable[[Shard], T]) -> list[T]:
        """``fn`` on every shard concurrently, results in shard-map order (see :func:`all_or_first_error`)."""
        shards = self.shards
        if len(shards) == 1:
            return [fn(shards[0])]
        group = current_group()  # the attempt's steps, whichever thread starts them
        futures = [self._threads.submit(joined, group, fn, shard) for shard in shards[1:]]
        # the first shard in the calling thread: one thread hand-off less per call
        return all_or_first_error([functools.partial(fn, shards[0])] + [future.result for future in futures])

    def served(self, attempt: Callable[[], T]) -> T:
        """Runs a data-plane ``attempt``, riding out a shard's recovery.

        A failure that may mean a shard died or restarted (UNAVAILABLE, or a shard that does not
        know the session) sends the client to the coordinator: a lost session raises
        :class:`SessionLostError` at once; otherwise the shard map is read again (a restarted
        shard or server serves at new addresses) and the attempt is retried with the same push
        identity (applied at most once), with backoff, for up to the client's ``timeout``.
        A step of the attempt that failed ends its peers' at once, or half a second after a shard's
        own DEADLINE_EXCEEDED (:class:`StepGroup`).

        A step not done within the client's ``timeout`` (DEADLINE_EXCEEDED) may have waited on a
        shard that moved (its host lost): if the shard map changed, it is sent again there (same
        push identity), once per move; otherwise the error is raised. A retried attempt, and with
        hot standbys (``SessionInfo.hot_standby``) a first one slower than
        :data:`SLOW_FIRST_ATTEMPT_S`, is ended as soon as the coordinator's map moved
        (:class:`MoveWatch`) and sent where the shards are now.
        """
        policy = self._client.retry
        started = time.monotonic()
        deadline = started + self._client.timeout
        waits = 0  # backoffs since the shard map last moved (a moved shard is tried again at once, then soon)
        renegotiated = False  # the previous attempt ended on a shared-memory region its shard did not know
        for attempt_number in itertools.count():
            try:
                with step_group() as group:
                    # a retry: the shard may have moved; with hot standbys, a slow first attempt too
                    watch = (MoveWatch(self, group) if attempt_number else
                             MoveWatch(self, group, every_s=SLOW_FIRST_ATTEMPT_S) if self.hot_standby else None)
                    try:
                        return attempt()
                    finally:
                        if watch is not None:
                            watch.stop()
            except grpc.RpcError as rpc_error:
                error: OptservError = from_rpc_error(rpc_error)
            except (UnavailableError, NotFoundError, DeadlineExceededError) as exc:
                error = exc
            if isinstance(error, DeadlineExceededError):
                _log.debug("optserve: session %r attempt %d ran out of time (%s)", self._session, attempt_number,
                           error.details)
                if not self.refresh():  # raises SessionLostError, or NotFoundError if the session is gone
                    raise error
                continue  # the shard moved: the step goes where it is now
            if not isinstance(error, (UnavailableError, NotFoundError)):
                raise error
            moved = self.refresh()  # raises SessionLostError, or NotFoundError if the session is gone
            _log.debug("optserve: session %r attempt %d failed (%s: %s); shard map moved: %s", self._session,
                       attempt_number, error.code, error.details, moved)
            if not moved and getattr(error, "unmoved", None) is not None:  # really not a shard (version skew)
                raise error.unmoved
            retryable = isinstance(error, UnavailableError) or attempt_number == 0
            if not retryable or time.monotonic() >= deadline:
                if attempt_number and isinstance(error, UnavailableError):  # name what the user gave, not a shard's port
                    raise UnavailableError(f"server {self._client.address}: session {self._session!r} was not served "
                                           f"within {time.monotonic() - started:.0f} s of retries (the client's "
                                           f"timeout); last error: {error.details}", "UNAVAILABLE") from None
                raise error
            if attempt_number == 2:  # a blip is retried silently; a longer outage is said once
                _log.warning("optserve: server %s does not serve session %r now (%s); retrying for up to %.0f s more",
                             self._client.address, self._session, error.details, max(0.0, deadline - time.monotonic()))
            if moved:  # a restarted shard or server serves at its new address now: no reason to wait
                waits = 0
                renegotiated = False
                continue
            if getattr(error, "renegotiate", False) and not renegotiated:
                # a shard restarted at its predecessor's address answered: it is up, and the regions
                # it did not know are dropped (the next attempt negotiates fresh ones). Tried again
                # at once, as a moved shard is (once: a second such answer in a row waits as usual)
                renegotiated = True
                continue
            renegotiated = getattr(error, "renegotiate", False)
            backoff = min(policy.max_backoff_s, policy.initial_backoff_s * 2 ** waits)
            waits += 1
            time.sleep(min(backoff * random.uniform(0.8, 1.2), max(0.0, deadline - time.monotonic())))
        raise AssertionError("unreachable")

    def same_map(self, info: control_pb2.SessionInfo) -> bool:
        """Whether ``info``'s shard map is the one this object is connected to."""
        return [(s.shard_index, s.address) for s in info.shards] == [(s.index, s.address) for s in self.shards]

    def refresh(self) -> bool:
        """Asks the coordinator for the session: raises SessionLostError (or NotFoundError) if it
        is lost (or gone); reconnects to shards whose address changed, and returns whether any did.
        A coordinator that does not answer (restarting) changes nothing."""
        request = control_pb2.GetSessionRequest(name=self._session)
        try:
            info = self._client.control.GetSession(request, timeout=min(5.0, self._client.timeout)).session
        except grpc.RpcError as exc:
            error: OptservError = from_rpc_error(exc)
            if isinstance(error, (SessionLostError, NotFoundError)):
                raise error from None
            return False
        if self.same_map(info):
            return False
        old, self.shards = self.shards, connect(self._client, info)
        for shard in old:
            shard.steps.close()
        return True

    def close(self) -> None:
        """Ends the shards' open PushPull calls and lets the threads go (the session stays open)."""
        for shard in self.shards:
            shard.steps.close()
        self._threads.shutdown(wait=False)


class MoveWatch:
    """While a retried attempt runs, asks the coordinator every ``every_s`` whether the session's
    shard map changed; once it has, ends the attempt's steps (:meth:`StepGroup.fail`), so the
    attempt is sent where the shards are now instead of waiting on a dial to where one was (a host
    that vanished answers no dial: each waits out its connect timeout). Asks without blocking a
    thread (a future; the next ask is scheduled when the answer came)."""

    def __init__(self, fanout: ShardFanout, group, every_s: float = 0.5):
        self._fanout, self._group, self._every_s = fanout, group, every_s
        self._request = control_pb2.GetSessionRequest(name=fanout._session)
        self._stopped = False
        self._timer = DEADLINES.call_later(every_s, self._ask)

    def stop(self) -> None:
        self._stopped = True
        DEADLINES.cancel(self._timer)

    def _ask(self) -> None:
        if self._stopped:
            return
        future = self._fanout._client.control.GetSession.future(self._request, timeout=max(1.0, 4 * self._every_s))
        future.add_done_callback(self._answered)

    def _answered(self, future) -> None:
        if self._stopped:
            return
        try:
            moved = not self._fanout.same_map(future.result().session)
        except grpc.RpcError:  # the coordinator did not answer: the attempt's own errors decide
            moved = False
        if moved:
            self._group.fail("the session's shard map changed", None)
        else:
            self._timer = DEADLINES.call_later(self._every_s, self._ask)
