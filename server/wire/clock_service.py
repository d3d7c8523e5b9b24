"""The session clock over gRPC: the home shard serves it, the session's other shards call it.

Every shard actor runs a :class:`ClockServer` next to its data plane, serving the
:class:`~optserve.server.domain.clock.home_clock.HomeClock` of each multi-shard session it is home to
(``optserve.v1.SessionClock`` in ``clock.proto``). The other shards of such a session hold a
:class:`PeerClock`: the :class:`~optserve.server.domain.clock.home_clock.Clock` every shard calls (``is_home``
False), each method one unary call answered in the home shard's process, domain refusals carried
back in the reply and raised again.

The server runs on an event loop of its own (:class:`~optserve.server.wire.loop_server.LoopServer`):
a vote waits there for every shard of the push to vote, holding no thread; the other calls run in
its own thread pool, apart from the data plane's, so a cross-shard sum waiting for its peers never
starves the data plane of threads.
It listens on its own port, apart from the client-facing ones, and answers only the server's own
processes (:class:`~optserve.server.wire.security.InternalTrust`: a secret made at start, and TLS
with a certificate made at start when the server runs with TLS).

Every request is checked before any clock is touched: one that does not decode, or whose numbers
no server process sends (a negative shard index, ordinal or sum key; a wait that is negative, not
finite or longer than a thread can wait), is refused INVALID_ARGUMENT naming the field. Domain
refusals travel in the replies; any other exception is a server fault (INTERNAL, logged).
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import Executor
from typing import Any, Callable, Optional

import grpc

from optserve.protos import contract
from optserve.protos.optserve.v1 import clock_pb2, clock_pb2_grpc
from optserve.server.domain.clock import HomeClock, Ticket
from optserve.server.domain.errors import (FailedPrecondition, FutureBase, InvalidArgument, NotFound, OptservError,
                                           PeerRefused, Stale, Timeout, Unavailable)
from optserve.server.domain.waits import Steps, Wait, drive
from optserve.server.wire.errors import abort_call, add_unary_service, checked_message, grpc_errors
from optserve.server.wire.loop_calls import PoolRuns
from optserve.server.wire.loop_server import LoopServer
from optserve.server.wire.security import InternalSecretInterceptor, InternalTrust
from optserve.server.wire.thread_pool import ShrinkingThreadPool

_THREADS = 256  # the clock's calls between their waits (votes and cross-shard sums wait on the loop)
_IN_FLIGHT: set = set()  # refusing votes sent without waiting, held until they end
_IN_FLIGHT_LOCK = threading.Lock()
_RPC_SLACK_S = 30.0  # beyond the home-side wait, for the reply to arrive


def _forget_call(future) -> None:
    """A refusing vote's call ended: it need not be held any longer."""
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT.discard(future)

_KINDS: dict[type, int] = {  # a subclass before its base: the first match is sent
    NotFound: clock_pb2.CLOCK_ERROR_KIND_NOT_FOUND,
    FutureBase: clock_pb2.CLOCK_ERROR_KIND_FUTURE_BASE,
    Stale: clock_pb2.CLOCK_ERROR_KIND_STALE,
    PeerRefused: clock_pb2.CLOCK_ERROR_KIND_PEER_REFUSED,
    InvalidArgument: clock_pb2.CLOCK_ERROR_KIND_INVALID_ARGUMENT,
    FailedPrecondition: clock_pb2.CLOCK_ERROR_KIND_FAILED_PRECONDITION,
    Timeout: clock_pb2.CLOCK_ERROR_KIND_TIMEOUT,
    Unavailable: clock_pb2.CLOCK_ERROR_KIND_UNAVAILABLE,
}
_CLASSES = {kind: cls for cls, kind in _KINDS.items()}


# ------------------------------------------------------------------ conversions
def _ticket_to_proto(ticket: Ticket) -> clock_pb2.ClockTicket:
    return clock_pb2.ClockTicket(ordinal=ticket.ordinal, client_id=ticket.client_id, sequence=ticket.sequence,
                                 staleness=ticket.staleness, scale=ticket.scale, closes_step=ticket.closes_step,
                                 target_version=ticket.target_version, checkpoint=ticket.checkpoint,
                                 hyperparams=ticket.hyperparams)


def _ticket_from_proto(t: clock_pb2.ClockTicket) -> Ticket:
    return Ticket(t.ordinal, t.client_id, t.sequence, t.staleness, t.scale, t.closes_step, t.target_version,
                  t.checkpoint, t.hyperparams)


def _error_to_proto(exc: OptservError) -> clock_pb2.ClockError:
    kind = next((k for cls, k in _KINDS.items() if isinstance(exc, cls)), clock_pb2.CLOCK_ERROR_KIND_UNSPECIFIED)
    return clock_pb2.ClockError(kind=kind, message=str(exc), current_version=getattr(exc, "current_version", 0))


def _error_from_proto(error: clock_pb2.ClockError) -> OptservError:
    if error.kind == clock_pb2.CLOCK_ERROR_KIND_STALE:
        return Stale(error.message, error.current_version)
    if error.kind == clock_pb2.CLOCK_ERROR_KIND_FUTURE_BASE:
        return FutureBase(error.message, error.current_version)
    return _CLASSES.get(error.kind, OptservError)(error.message)


def _ticket_reply(call: Callable[[], Optional[Ticket]]) -> clock_pb2.ClockTicketReply:
    try:
        ticket = call()
    except OptservError as exc:
        return clock_pb2.ClockTicketReply(error=_error_to_proto(exc))
    return clock_pb2.ClockTicketReply(ticket=_ticket_to_proto(ticket)) if ticket is not None else clock_pb2.ClockTicketReply()


def _ticket_outcome(reply: clock_pb2.ClockTicketReply) -> Optional[Ticket]:
    kind = reply.WhichOneof("outcome")
    if kind == "error":
        raise _error_from_proto(reply.error)
    return _ticket_from_proto(reply.ticket) if kind == "ticket" else None


# ------------------------------------------------------------------ home side
def _check_not_negative(method: str, field: str, value: int) -> None:
    """Shard indices, ordinals and sum keys (session versions) start at 0."""
    if value < 0:
        raise InvalidArgument(f"{method}: {field} must be >= 0, not {value}")


def _check_wait(method: str, field: str, seconds: float) -> None:
    """A wait in seconds: finite, >= 0, and no longer than a thread can wait (``threading.TIMEOUT_MAX``)."""
    if not (math.isfinite(seconds) and 0.0 <= seconds <= threading.TIMEOUT_MAX):
        raise InvalidArgument(f"{method}: {field} must be a number of seconds in [0, {threading.TIMEOUT_MAX:.0f}], "
                              f"not {seconds!r}")


class _ClockServicer(clock_pb2_grpc.SessionClockServicer):
    """Each method checks its request (INVALID_ARGUMENT) before it asks the session's clock."""

    def __init__(self, clock_for: Callable[[str], HomeClock], pool: Executor):
        self._clock_for = clock_for
        self._pool = pool

    async def Vote(self, request, context):
        """Served on the event loop: the vote's wait for the other shards holds no thread."""
        def checks(request) -> None:
            _check_not_negative("Vote", "shard_index", request.shard_index)
            _check_wait("Vote", "timeout_s", request.timeout_s)

        def reply(ticket: Optional[Ticket]) -> clock_pb2.ClockTicketReply:
            return clock_pb2.ClockTicketReply(ticket=_ticket_to_proto(ticket)) if ticket is not None \
                else clock_pb2.ClockTicketReply()

        return await self._on_loop(context, "Vote", request, checks, lambda r: self._clock_for(r.session).vote_steps(
            r.client_id, r.sequence, r.base_version, r.shard_index, r.staged, r.timeout_s, r.attempt), reply,
            lambda exc: clock_pb2.ClockTicketReply(error=_error_to_proto(exc)))

    @grpc_errors
    def Commit(self, request, context):
        return _ticket_reply(lambda: self._clock_for(request.session).commit(
            request.client_id, request.sequence, request.base_version))

    @grpc_errors
    def GetTicket(self, request, context):
        _check_not_negative("GetTicket", "ordinal", request.ordinal)
        return _ticket_reply(lambda: self._clock_for(request.session).ticket(request.ordinal))

    async def ReduceSum(self, request, context):
        """Served on the event loop: the sum's wait for the other shards' parts holds no thread."""
        def checks(request) -> None:
            _check_not_negative("ReduceSum", "key", request.key)
            _check_not_negative("ReduceSum", "shard_index", request.shard_index)

        return await self._on_loop(context, "ReduceSum", request, checks, lambda r: self._clock_for(
            r.session).reduce_sum_steps(r.key, r.shard_index, r.value), lambda total: clock_pb2.ClockSumReply(
            total=total), lambda exc: clock_pb2.ClockSumReply(error=_error_to_proto(exc)))

    async def _on_loop(self, context, method: str, request, checks: Callable[[Any], None],
                       steps: Callable[[Any], Steps], reply: Callable[[Any], Any],
                       refused: Callable[[OptservError], Any]):
        """A call served on the event loop: ``checks(request)`` (INVALID_ARGUMENT), then
        ``steps(request)`` run in the pool between its waits; its value answered as ``reply(value)``,
        a refusal of the clock as ``refused(error)``, anything else INTERNAL (logged)."""
        try:
            request = checked_message(request, method)
            checks(request)
        except InvalidArgument as exc:
            await abort_call(context, exc, f"SessionClock/{method}")
            return None
        try:
            value = await PoolRuns(self._pool).result(steps(request))
        except OptservError as exc:
            return refused(exc)
        except Exception as exc:  # noqa: BLE001 - a server fault: INTERNAL, logged
            await abort_call(context, exc, f"SessionClock/{method}")
            return None
        return reply(value)


def _add_to_server(servicer: _ClockServicer, server: LoopServer) -> None:
    """Serves SessionClock (undecodable requests refused INVALID_ARGUMENT, see
    :func:`~optserve.server.wire.errors.add_unary_service`)."""
    add_unary_service(server, clock_pb2, "SessionClock", servicer)


class ClockServer:
    """Serves the clocks of the sessions a shard is home to (thread-safe registry).

    Args:
      host: interface to bind (the server's data-plane host).
      advertised_host: the host peers dial (``host`` unless it is a wildcard).
      trust: the server's internal secret (and TLS identity).
      port: the port to bind if free (a restarted shard takes its predecessor's); else any.
      also: ``add(server, pool)`` for each other internal service served on the same port (a
        standby's ``ShardReplica``), called before it starts.
    """

    def __init__(self, host: str, advertised_host: str, trust: InternalTrust, port: int = 0,
                 also: tuple[Callable[[LoopServer, Executor], None], ...] = ()):
        self._clocks: dict[str, HomeClock] = {}
        self._lock = threading.Lock()
        pool = ShrinkingThreadPool(_THREADS, thread_name_prefix="optserve-clock")
        self._server = LoopServer(pool, interceptors=[InternalSecretInterceptor(trust.secret)],
                                  options=contract.SERVER_OPTIONS,  # peers on other hosts ping (keepalive)
                                  name="optserve-clock-loop")
        _add_to_server(_ClockServicer(self._clock, pool), self._server)
        for add in also:
            add(self._server, pool)
        credentials = trust.server_credentials()

        def add_port(number: int) -> int:
            return (self._server.add_secure_port(f"{host}:{number}", credentials) if credentials is not None
                    else self._server.add_insecure_port(f"{host}:{number}"))

        if port:
            try:
                port = add_port(port)
            except RuntimeError:
                port = add_port(0)
        else:
            port = add_port(0)
        self._server.start()
        self.address = f"{advertised_host}:{port}"

    def _clock(self, session: str) -> HomeClock:
        with self._lock:
            clock = self._clocks.get(session)
        if clock is None:
            raise NotFound(f"session {session!r} has no clock on this shard")
        return clock

    def add(self, session: str, clock: HomeClock) -> None:
        with self._lock:
            self._clocks[session] = clock

    def remove(self, session: str) -> None:
        with self._lock:
            self._clocks.pop(session, None)

    def stop(self) -> None:
        self._server.stop(grace=0.5)


# ------------------------------------------------------------------ peer side
class _Stubs:
    """One stub per home address and process (its channel is shared by every session there)."""

    _by_address: dict[str, clock_pb2_grpc.SessionClockStub] = {}
    _lock = threading.Lock()

    @classmethod
    def at(cls, address: str, trust: InternalTrust) -> clock_pb2_grpc.SessionClockStub:
        with cls._lock:
            if address not in cls._by_address:
                cls._by_address[address] = clock_pb2_grpc.SessionClockStub(trust.channel(address))
            return cls._by_address[address]


class PeerClock:
    """A non-home shard's handle on its session's clock: a :class:`~optserve.server.domain.clock.home_clock.Clock`
    whose ``is_home`` is False (the home-only calls are made on the home shard itself).

    Args:
      address: the home shard's :class:`ClockServer` address.
      session: the session's name.
      trust: the server's internal secret (and TLS identity).
      reduce_timeout_s: longest wait for a cross-shard sum (the home shard enforces it too).
    """

    def __init__(self, address: str, session: str, trust: InternalTrust, reduce_timeout_s: float = 300.0):
        self._trust = trust
        self._stub = _Stubs.at(address, trust)
        self._metadata = trust.metadata
        self._session = session
        self._reduce_timeout = reduce_timeout_s

    @property
    def is_home(self) -> bool:
        return False

    def repoint(self, address: str) -> None:
        """The home shard restarted at ``address``."""
        self._stub = _Stubs.at(address, self._trust)

    def _call(self, method: str, request, rpc_deadline_s: float):
        try:
            return getattr(self._stub, method)(request, timeout=rpc_deadline_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise self._failed(method, exc) from None

    def _failed(self, method: str, exc: grpc.RpcError) -> OptservError:
        """The domain error for a call to the home clock that failed with ``exc``."""
        if exc.code() is grpc.StatusCode.UNAVAILABLE:  # its process died (a durable one restarts)
            return Unavailable(f"session {self._session!r}: the clock on its home shard is unreachable "
                               f"({exc.details()}); nothing was applied, retry")
        return Timeout(f"session {self._session!r}: the clock on its home shard did not answer {method} "
                       f"({exc.code().name}: {exc.details()})")

    def commit(self, client_id: str, sequence: int, base_version: int) -> Ticket:
        request = clock_pb2.ClockCommitRequest(session=self._session, client_id=client_id, sequence=sequence,
                                               base_version=base_version)
        return _ticket_outcome(self._call("Commit", request, _RPC_SLACK_S))

    def ticket(self, ordinal: int) -> Optional[Ticket]:
        request = clock_pb2.ClockTicketRequest(session=self._session, ordinal=ordinal)
        return _ticket_outcome(self._call("GetTicket", request, _RPC_SLACK_S))

    def vote(self, client_id: str, sequence: int, base_version: int, shard_index: int, staged: bool,
             timeout_s: float, attempt: int = 0) -> Optional[Ticket]:
        return drive(self.vote_steps(client_id, sequence, base_version, shard_index, staged, timeout_s, attempt))

    def vote_steps(self, client_id: str, sequence: int, base_version: int, shard_index: int, staged: bool,
                   timeout_s: float, attempt: int = 0) -> Steps[Optional[Ticket]]:
        """:meth:`vote`, the call to the home clock yielded as a wait (no thread waits for it)."""
        request = clock_pb2.ClockVoteRequest(session=self._session, client_id=client_id, sequence=sequence,
                                             base_version=base_version, shard_index=shard_index, staged=staged,
                                             timeout_s=timeout_s, attempt=attempt)
        if not staged:  # tell the peers, do not wait for them (but keep the call alive until it ends:
            # a future nobody holds is cancelled when it is garbage-collected)
            future = self._stub.Vote.future(request, timeout=_RPC_SLACK_S, metadata=self._metadata)
            with _IN_FLIGHT_LOCK:
                _IN_FLIGHT.add(future)
            future.add_done_callback(_forget_call)
            return None
        call = self._stub.Vote.future(request, timeout=timeout_s + _RPC_SLACK_S, metadata=self._metadata)
        yield Wait(call, None)  # the call has its deadline
        try:
            reply = call.result()
        except grpc.RpcError as exc:
            raise self._failed("Vote", exc) from None
        return _ticket_outcome(reply)

    def reduce_sum(self, key: int, shard_index: int, value: float) -> float:
        """The sum over the session's shards; waits through a restart of the home shard (a
        durable one answers a sum decided before it died from its journal)."""
        request = clock_pb2.ClockSumRequest(session=self._session, key=key, shard_index=shard_index, value=value)
        deadline = time.monotonic() + self._reduce_timeout
        while True:
            try:
                reply = self._call("ReduceSum", request, self._reduce_timeout + _RPC_SLACK_S)
                break
            except Unavailable:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)
        if reply.WhichOneof("outcome") == "error":
            raise _error_from_proto(reply.error)
        return reply.total

    def status(self) -> None:
        """None: the coordinator asks the home shard for the clock's status."""
        return None
