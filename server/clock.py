"""The session clock: where each session's version lives, and where pushes are ordered.

A shard that receives a commit asks the session's clock for the push's *ticket*. The first
ask decides (via :func:`optserve.server.staleness.decide`); every later ask for the same
(client_id, sequence) gets the same ticket, so all shards agree on acceptance, staleness and
order. Accepted pushes get consecutive ordinals; shards apply tickets strictly in ordinal order,
which keeps their states consistent under concurrent clients. The clock also sums
cross-shard statistics.

Where the clock lives: a session on ONE shard keeps a :class:`LocalClock` inside that shard
(no extra hop); a session spread over several shards uses the server's :class:`StepClock` Ray
actor through a :class:`RemoteClock` handle. The per-step calls (a staged push's vote, a
reduction) skip Ray's task path: the actor serves them on a small gRPC endpoint of its own event
loop (JSON messages), a few times faster than a Ray actor call; the rest goes through Ray.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from typing import Optional

from optserve.server.config import Mode, StalenessPolicy
from optserve.server.errors import (FailedPrecondition, InvalidArgument, NotFound, OptservError, PeerRefused, Stale,
                                    Timeout, unwrap)
from optserve.server.staleness import decide

_KEEP_TICKETS = 4096
_DIRECT_SERVICE = "optserve.internal.StepClock"
_DIRECT_THREADS = 256  # a vote holds a thread until every shard voted: one per push in flight
_DIRECT_ERRORS = {cls.__name__: cls for cls in (NotFound, PeerRefused, InvalidArgument, FailedPrecondition, Timeout)}


@dataclasses.dataclass(frozen=True)
class Ticket:
    """An accepted push, in the order every shard applies it.

    Attributes:
      ordinal: 0, 1, 2, ... per session.
      client_id / sequence: the push.
      staleness / scale / closes_step: see :class:`optserve.server.staleness.Decision`.
      target_version: the version of the step this push belongs to (after it is applied).
    """

    ordinal: int
    client_id: str
    sequence: int
    staleness: int
    scale: float
    closes_step: bool
    target_version: int


@dataclasses.dataclass
class SessionClock:
    """One session's version and ticket book (not thread-safe; callers serialise)."""

    mode: Mode
    num_workers: int
    max_staleness: Optional[int]
    policy: StalenessPolicy
    version: int = 0
    next_ordinal: int = 0
    step_clients: set = dataclasses.field(default_factory=set)
    last: dict = dataclasses.field(default_factory=dict)  # client_id -> (sequence, Ticket | OptservError)
    tickets: dict = dataclasses.field(default_factory=dict)  # ordinal -> Ticket
    accepted: int = 0
    stale: int = 0

    def commit(self, client_id: str, sequence: int, base_version: int) -> Ticket:
        """Returns the push's ticket, deciding it on the first call; raises the refusal otherwise."""
        previous = self.last.get(client_id)
        if previous is not None and previous[0] == sequence:
            if isinstance(previous[1], OptservError):
                raise previous[1]
            return previous[1]
        if previous is not None and previous[0] > sequence:
            raise Stale(f"push {sequence} of client {client_id!r} is older than its push {previous[0]}; "
                        f"current version is {self.version}", self.version)
        try:
            decision = decide(
                mode=self.mode, version=self.version, base_version=base_version, num_workers=self.num_workers,
                pushes_in_step=len(self.step_clients), client_in_step=client_id in self.step_clients,
                max_staleness=self.max_staleness, policy=self.policy, client_id=client_id,
            )
        except OptservError as exc:
            self.stale += isinstance(exc, Stale)
            self.last[client_id] = (sequence, exc)
            raise
        ticket = Ticket(self.next_ordinal, client_id, sequence, decision.staleness, decision.scale,
                        decision.closes_step, self.version + 1)
        self.next_ordinal += 1
        self.accepted += 1
        if decision.closes_step:
            self.version += 1
            self.step_clients.clear()
        else:
            self.step_clients.add(client_id)
        self.last[client_id] = (sequence, ticket)
        self.tickets[ticket.ordinal] = ticket
        self.tickets.pop(ticket.ordinal - _KEEP_TICKETS, None)
        return ticket

    def status(self) -> dict:
        return {"version": self.version, "accepted": self.accepted, "stale": self.stale}


def new_session_clock(config) -> SessionClock:
    return SessionClock(config.mode, config.num_workers, config.max_staleness, config.staleness_policy)


class StepClock:
    """Ray actor (async): clocks and cross-shard sums for the multi-shard sessions of a server."""

    def __init__(self, host: str = "127.0.0.1"):
        self._host = host  # interface of the direct endpoint: the server's data-plane host
        self._sessions: dict[str, SessionClock] = {}
        self._reductions: dict[tuple[str, int], dict] = {}
        self._votes: dict[tuple[str, str, int], dict] = {}
        self._direct = None  # (grpc.aio server, "host:port") once started

    async def direct_address(self) -> str:
        """Starts (once) the direct endpoint for :meth:`vote` and :meth:`reduce_sum` and returns
        its "host:port" (see :class:`RemoteClock`). Its threads hand each call to this actor's
        event loop, so the clock's state is only ever touched there."""
        if self._direct is None:
            from concurrent import futures

            import grpc
            import ray

            loop = asyncio.get_running_loop()

            def on_loop(coroutine_fn, encode):
                def handle(request: dict, context) -> dict:
                    reply = _direct_reply(coroutine_fn(**request), encode)
                    return asyncio.run_coroutine_threadsafe(reply, loop).result()

                return grpc.unary_unary_rpc_method_handler(handle, request_deserializer=json.loads,
                                                           response_serializer=_json_bytes)

            handlers = {"Vote": on_loop(self.vote, lambda t: dataclasses.asdict(t) if t else None),
                        "ReduceSum": on_loop(self.reduce_sum, float)}
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=_DIRECT_THREADS))
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_DIRECT_SERVICE, handlers),))
            port = server.add_insecure_port(f"{self._host}:0")
            server.start()
            wildcard = self._host in ("0.0.0.0", "::", "[::]", "")
            advertised = ray.util.get_node_ip_address() if wildcard else self._host
            self._direct = (server, f"{advertised}:{port}")
        return self._direct[1]

    async def open(self, session: str, config) -> None:
        self._sessions[session] = new_session_clock(config)

    async def close(self, session: str) -> None:
        self._sessions.pop(session, None)

    def _get(self, session: str) -> SessionClock:
        try:
            return self._sessions[session]
        except KeyError:
            raise NotFound(f"session {session!r} not found") from None

    async def commit(self, session: str, client_id: str, sequence: int, base_version: int) -> Ticket:
        return self._get(session).commit(client_id, sequence, base_version)

    async def ticket(self, session: str, ordinal: int) -> Optional[Ticket]:
        return self._get(session).tickets.get(ordinal)

    async def vote(self, session: str, client_id: str, sequence: int, base_version: int, shard_index: int,
                   staged: bool, participants: int, timeout_s: float) -> Optional[Ticket]:
        """Auto-commit: one shard's stage outcome; returns the ticket once every shard staged.

        The push is decided (``SessionClock.commit``) only when all ``participants`` voted
        ``staged=True``; one refusal, or a shard that does not vote within ``timeout_s``, refuses
        it everywhere (:class:`PeerRefused`). Every voter gets the same outcome. A refused round is
        forgotten, so a retry of the same push starts afresh.
        """
        clock = self._get(session)
        key = (session, client_id, sequence)
        round_ = self._votes.setdefault(key, {"votes": {}, "event": asyncio.Event(), "outcome": None, "taken": 0})
        round_["votes"][shard_index] = staged
        if round_["outcome"] is None:
            if not staged:
                round_["outcome"] = PeerRefused(
                    f"push {sequence} of client {client_id!r} was refused by shard {shard_index}; applied on no shard")
            elif len(round_["votes"]) >= participants:
                try:
                    round_["outcome"] = clock.commit(client_id, sequence, base_version)
                except OptservError as exc:
                    round_["outcome"] = exc
            if round_["outcome"] is not None:
                round_["event"].set()
        try:
            await asyncio.wait_for(round_["event"].wait(), timeout_s)
        except asyncio.TimeoutError:
            if round_["outcome"] is None:
                missing = sorted(set(range(participants)) - set(round_["votes"]))
                round_["outcome"] = PeerRefused(
                    f"push {sequence} of client {client_id!r} was not staged on every shard within "
                    f"{timeout_s:.0f} s ({len(round_['votes'])} of {participants} voted); applied on no shard")
                round_["event"].set()
        round_["taken"] += 1
        if round_["taken"] >= len(round_["votes"]):
            self._votes.pop(key, None)
        if not staged:  # the refusing shard reports its own error; nobody waits for this answer
            return None
        outcome = round_["outcome"]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def reduce_sum(self, session: str, key: int, shard_index: int, value: float, participants: int) -> float:
        """Sums ``value`` over ``participants`` shards for step ``key``; returns once all arrived.

        The sum is taken in shard-index order, so every shard gets the same float.
        """
        entry = self._reductions.setdefault((session, key), {"values": {}, "event": asyncio.Event(), "taken": 0})
        entry["values"][shard_index] = value
        if len(entry["values"]) >= participants:
            entry["event"].set()
        await entry["event"].wait()
        total = 0.0
        for index in sorted(entry["values"]):
            total += entry["values"][index]
        entry["taken"] += 1
        if entry["taken"] >= participants:
            self._reductions.pop((session, key), None)
        return total

    async def status(self, session: str) -> dict:
        return self._get(session).status()


class LocalClock:
    """The clock of a session held by a single shard: in-process, thread-safe."""

    def __init__(self, config):
        self._clock = new_session_clock(config)
        self._lock = threading.Lock()

    def commit(self, client_id: str, sequence: int, base_version: int) -> Ticket:
        with self._lock:
            return self._clock.commit(client_id, sequence, base_version)

    def ticket(self, ordinal: int) -> Optional[Ticket]:
        with self._lock:
            return self._clock.tickets.get(ordinal)

    def vote(self, client_id: str, sequence: int, base_version: int, shard_index: int, staged: bool,
             timeout_s: float) -> Optional[Ticket]:
        """The only shard decides alone: a staged push is committed, a refused one needs nothing."""
        return self.commit(client_id, sequence, base_version) if staged else None

    def reduce_sum(self, key: int, shard_index: int, value: float) -> float:
        return value

    def status(self) -> dict:
        with self._lock:
            return self._clock.status()


def _json_bytes(message) -> bytes:
    return json.dumps(message).encode()


async def _direct_reply(outcome, encode) -> dict:
    """``{"value": encode(result)}``, or ``{"error": ...}`` describing the domain error raised."""
    try:
        return {"value": encode(await outcome)}
    except Stale as exc:
        return {"error": "Stale", "message": str(exc), "current_version": exc.current_version}
    except OptservError as exc:
        name = type(exc).__name__
        return {"error": name if name in _DIRECT_ERRORS else "OptservError", "message": str(exc)}


def _direct_result(reply: dict):
    """The value of a direct reply, or its domain error raised."""
    error = reply.get("error")
    if error is None:
        return reply["value"]
    if error == "Stale":
        raise Stale(reply["message"], reply["current_version"])
    raise _DIRECT_ERRORS.get(error, OptservError)(reply["message"])


class _DirectCalls:
    """Blocking calls to a :class:`StepClock`'s direct endpoint (one channel per process)."""

    _by_address: dict[str, "_DirectCalls"] = {}
    _lock = threading.Lock()

    def __init__(self, address: str):
        import grpc

        channel = grpc.insecure_channel(address)
        self.vote = channel.unary_unary(f"/{_DIRECT_SERVICE}/Vote", request_serializer=_json_bytes,
                                        response_deserializer=json.loads)
        self.reduce_sum = channel.unary_unary(f"/{_DIRECT_SERVICE}/ReduceSum", request_serializer=_json_bytes,
                                              response_deserializer=json.loads)

    @classmethod
    def at(cls, address: str) -> "_DirectCalls":
        with cls._lock:
            if address not in cls._by_address:
                cls._by_address[address] = cls(address)
            return cls._by_address[address]


class RemoteClock:
    """A session's view of the :class:`StepClock` actor (blocking calls, domain errors unwrapped).

    A staged push's vote and the reductions go to the actor's direct endpoint (its address is
    asked once); a refusal's vote (fire and forget), tickets and status go through Ray.
    """

    _RPC_SLACK_S = 30.0  # beyond the actor-side wait, for the reply to arrive

    def __init__(self, actor, session: str, participants: int):
        self._actor = actor
        self._session = session
        self._participants = participants
        self._calls: Optional[_DirectCalls] = None

    def _direct(self) -> _DirectCalls:
        if self._calls is None:
            self._calls = _DirectCalls.at(self._get(self._actor.direct_address.remote()))
        return self._calls

    @staticmethod
    def _get(ref):
        import ray

        try:
            return ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - the domain error inside the Ray error
            raise unwrap(exc) from None

    def commit(self, client_id: str, sequence: int, base_version: int) -> Ticket:
        return self._get(self._actor.commit.remote(self._session, client_id, sequence, base_version))

    def ticket(self, ordinal: int) -> Optional[Ticket]:
        return self._get(self._actor.ticket.remote(self._session, ordinal))

    def vote(self, client_id: str, sequence: int, base_version: int, shard_index: int, staged: bool,
             timeout_s: float) -> Optional[Ticket]:
        if not staged:  # tell the peers, do not wait for them
            self._actor.vote.remote(self._session, client_id, sequence, base_version, shard_index, False,
                                    self._participants, timeout_s)
            return None
        request = {"session": self._session, "client_id": client_id, "sequence": sequence,
                   "base_version": base_version, "shard_index": shard_index, "staged": True,
                   "participants": self._participants, "timeout_s": timeout_s}
        ticket = _direct_result(self._direct().vote(request, timeout=timeout_s + self._RPC_SLACK_S))
        return Ticket(**ticket) if ticket else None

    def reduce_sum(self, key: int, shard_index: int, value: float) -> float:
        request = {"session": self._session, "key": key, "shard_index": shard_index, "value": value,
                   "participants": self._participants}
        return _direct_result(self._direct().reduce_sum(request, timeout=None))

    def status(self) -> None:
        return None  # the coordinator asks the actor itself
