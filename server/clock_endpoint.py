"""How a session's non-home shards reach its clock: a small gRPC endpoint in the home shard.

Every shard actor runs a :class:`ClockEndpoint` next to its data plane, serving the
:class:`~optserve.server.clock.LocalClock` of each multi-shard session it is home to. The other
shards of such a session hold a :class:`PeerClock`: the same methods as ``LocalClock``, each one
a unary call (JSON messages; tiny, and never on a hot path of tensor bytes) answered in the home
shard's process, with domain errors carried back and raised again.

The endpoint has its own thread pool, apart from the data plane's: a vote holds a thread until
every shard of the push voted, and those waits must never starve the data plane of threads.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from concurrent import futures
from typing import Callable, Optional

from optserve.server.clock import LocalClock, Ticket
from optserve.server.errors import (FailedPrecondition, InvalidArgument, NotFound, OptservError, PeerRefused, Stale,
                                    Timeout)

_SERVICE = "optserve.internal.SessionClock"
_THREADS = 256  # one per vote or sum waiting for its peers
_ERRORS = {cls.__name__: cls for cls in (NotFound, PeerRefused, InvalidArgument, FailedPrecondition, Timeout)}
_RPC_SLACK_S = 30.0  # beyond the home-side wait, for the reply to arrive


def _json_bytes(message) -> bytes:
    return json.dumps(message).encode()


def _ticket_dict(ticket: Optional[Ticket]) -> Optional[dict]:
    return dataclasses.asdict(ticket) if ticket is not None else None


def _ticket(value: Optional[dict]) -> Optional[Ticket]:
    return Ticket(**value) if value is not None else None


def _reply(call: Callable[[], object], encode: Callable[[object], object]) -> dict:
    """``{"value": encode(call())}``, or ``{"error": ...}`` describing the domain error raised."""
    try:
        return {"value": encode(call())}
    except Stale as exc:
        return {"error": "Stale", "message": str(exc), "current_version": exc.current_version}
    except OptservError as exc:
        name = type(exc).__name__
        return {"error": name if name in _ERRORS else "OptservError", "message": str(exc)}


def _result(reply: dict):
    """The value of a reply, or its domain error raised."""
    error = reply.get("error")
    if error is None:
        return reply["value"]
    if error == "Stale":
        raise Stale(reply["message"], reply["current_version"])
    raise _ERRORS.get(error, OptservError)(reply["message"])


class ClockEndpoint:
    """Serves the clocks of the sessions a shard is home to (thread-safe registry).

    Args:
      host: interface to bind (the server's data-plane host).
      advertised_host: the host peers dial (``host`` unless it is a wildcard).
    """

    def __init__(self, host: str, advertised_host: str):
        import grpc

        self._clocks: dict[str, LocalClock] = {}
        self._lock = threading.Lock()

        def method(handle, encode):
            def handler(request: dict, context) -> dict:
                return _reply(lambda: handle(self._clock(request.pop("session")), **request), encode)

            return grpc.unary_unary_rpc_method_handler(handler, request_deserializer=json.loads,
                                                       response_serializer=_json_bytes)

        handlers = {
            "Vote": method(LocalClock.vote, _ticket_dict),
            "Commit": method(LocalClock.commit, _ticket_dict),
            "Ticket": method(LocalClock.ticket, _ticket_dict),
            "ReduceSum": method(LocalClock.reduce_sum, float),
        }
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="optserve-clock"))
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))
        port = self._server.add_insecure_port(f"{host}:0")
        self._server.start()
        self.address = f"{advertised_host}:{port}"

    def _clock(self, session: str) -> LocalClock:
        with self._lock:
            clock = self._clocks.get(session)
        if clock is None:
            raise NotFound(f"session {session!r} has no clock on this shard")
        return clock

    def add(self, session: str, clock: LocalClock) -> None:
        with self._lock:
            self._clocks[session] = clock

    def remove(self, session: str) -> None:
        with self._lock:
            self._clocks.pop(session, None)

    def stop(self) -> None:
        self._server.stop(grace=0.5).wait()


class _Calls:
    """The endpoint's methods on one channel (one per home address and process)."""

    _by_address: dict[str, "_Calls"] = {}
    _lock = threading.Lock()

    def __init__(self, address: str):
        import grpc

        channel = grpc.insecure_channel(address)
        for name in ("Vote", "Commit", "Ticket", "ReduceSum"):
            setattr(self, name, channel.unary_unary(f"/{_SERVICE}/{name}", request_serializer=_json_bytes,
                                                    response_deserializer=json.loads))

    @classmethod
    def at(cls, address: str) -> "_Calls":
        with cls._lock:
            if address not in cls._by_address:
                cls._by_address[address] = cls(address)
            return cls._by_address[address]


class PeerClock:
    """A non-home shard's handle on its session's clock (the :class:`LocalClock` interface).

    Args:
      address: the home shard's :class:`ClockEndpoint` address.
      session: the session's name.
      reduce_timeout_s: longest wait for a cross-shard sum (the home shard enforces it too).
    """

    def __init__(self, address: str, session: str, reduce_timeout_s: float = 300.0):
        self._calls = _Calls.at(address)
        self._session = session
        self._reduce_timeout = reduce_timeout_s

    def _call(self, method: str, rpc_deadline_s: float, **request):
        import grpc

        request["session"] = self._session
        try:
            return _result(getattr(self._calls, method)(request, timeout=rpc_deadline_s))
        except grpc.RpcError as exc:
            raise Timeout(f"session {self._session!r}: the clock on its home shard did not answer {method} "
                          f"({exc.code().name}: {exc.details()})") from None

    def commit(self, client_id: str, sequence: int, base_version: int) -> Ticket:
        return _ticket(self._call("Commit", _RPC_SLACK_S, client_id=client_id, sequence=sequence,
                                  base_version=base_version))

    def ticket(self, ordinal: int) -> Optional[Ticket]:
        return _ticket(self._call("Ticket", _RPC_SLACK_S, ordinal=ordinal))

    def vote(self, client_id: str, sequence: int, base_version: int, shard_index: int, staged: bool,
             timeout_s: float) -> Optional[Ticket]:
        request = {"session": self._session, "client_id": client_id, "sequence": sequence,
                   "base_version": base_version, "shard_index": shard_index, "staged": staged,
                   "timeout_s": timeout_s}
        if not staged:  # tell the peers, do not wait for them
            self._calls.Vote.future(request, timeout=_RPC_SLACK_S)
            return None
        request.pop("session")
        return _ticket(self._call("Vote", timeout_s + _RPC_SLACK_S, **request))

    def reduce_sum(self, key: int, shard_index: int, value: float) -> float:
        return self._call("ReduceSum", self._reduce_timeout + _RPC_SLACK_S, key=key, shard_index=shard_index,
                          value=value)

    def status(self) -> None:
        return None  # the coordinator asks the home shard
