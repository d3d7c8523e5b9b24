"""ShardData requests decoded and checked for the domain: ids, push headers, waits, reply options.

Each function reads one part of a request and either returns what the domain takes (a
:class:`~optserve.server.domain.shard.shard_records.PushHeader`, a worker id, a wire dtype) or raises
:class:`~optserve.server.domain.errors.InvalidArgument` naming the field, which the error table
(:mod:`optserve.server.wire.errors`) answers INVALID_ARGUMENT.
"""

from __future__ import annotations

import json
from typing import Iterator, Optional

from optserve.protos import contract
from optserve.protos.optserve.v1 import data_pb2, tensor_pb2
from optserve.server.domain.config import MAX_WORKER_ID, WORKER_SEPARATOR, DType
from optserve.server.domain.errors import InvalidArgument
from optserve.server.domain.shard import PushHeader, StartState, wire_dtype
from optserve.server.domain.telemetry import Telemetry

_MEMBERSHIP_ACTIONS = {data_pb2.MEMBERSHIP_JOIN: "join", data_pb2.MEMBERSHIP_RENEW: "renew",
                       data_pb2.MEMBERSHIP_LEAVE: "leave"}


def first_message(requests: Iterator, field: str, what: str):
    """The stream's first message, which must carry ``field``."""
    request = next(requests, None)
    if request is None or request.WhichOneof("item") != field:
        raise InvalidArgument(f"{what}: the first message must be `{field}`")
    return request


def membership_action(action: int) -> str:
    """A Membership request's action: "join", "renew" or "leave"."""
    name = _MEMBERSHIP_ACTIONS.get(action)
    if name is None:
        raise InvalidArgument(f"Membership: action must be JOIN, RENEW or LEAVE, got {action}")
    return name


def worker_id(worker: str) -> str:
    """A Membership request's worker id: 1-64 characters without '/'."""
    if not 1 <= len(worker) <= MAX_WORKER_ID or WORKER_SEPARATOR in worker:
        raise InvalidArgument(f"Membership: worker_id must have 1-{MAX_WORKER_ID} characters and no "
                              f"{WORKER_SEPARATOR!r}, got {worker[:80]!r}")
    return worker


def client_id(client: str, what: str) -> str:
    """``client``, if it is non-empty and at most :data:`~optserve.protos.contract.MAX_CLIENT_ID_CHARS` long."""
    if not client:
        raise InvalidArgument(f"{what}: client_id must be non-empty")
    if len(client) > contract.MAX_CLIENT_ID_CHARS:
        raise InvalidArgument(f"{what}: client_id has {len(client)} characters, more than "
                              f"{contract.MAX_CLIENT_ID_CHARS}")
    return client


def push_header(message: data_pb2.PushHeader) -> PushHeader:
    """A push's header for the domain (its client id checked, its loss and scalars as telemetry)."""
    client_id(message.client_id, "push header")
    telemetry = Telemetry(message.loss if message.HasField("loss") else None, dict(message.scalars))
    return PushHeader(message.client_id, message.sequence, message.base_version, message.auto_commit, telemetry,
                      frozenset(message.without_gradient), message.attempt, message.incarnation)


def wait_s(context, header: data_pb2.PushHeader) -> Optional[float]:
    """How long the caller waits for a push's answer: its call's deadline, or the header's own
    (a step on a reused call) if sooner."""
    remaining = context.time_remaining()
    if header.HasField("wait_s") and header.wait_s > 0:
        return header.wait_s if remaining is None else min(remaining, header.wait_s)
    return remaining


def pull_options(request: data_pb2.PullRequest) -> tuple[Optional[DType], int]:
    """How the parameters go back: ``(wire dtype or None for each tensor's own, chunk bytes)``."""
    dtype = None if request.wire_dtype == tensor_pb2.DTYPE_UNSPECIFIED else wire_dtype(request.wire_dtype, what="pull wire_dtype")
    return dtype, contract.clamp_chunk_bytes(request.max_chunk_bytes or None)


def chunk_bytes(requested: int) -> int:
    """A reply's largest piece in bytes (0: the default), clamped as a pull's."""
    return contract.clamp_chunk_bytes(requested or None)


def start_state(first: data_pb2.InitTensorsRequest) -> Optional[StartState]:
    """The saved state an InitTensors starts the session from (its first message's ``start``), or None."""
    if not first.HasField("start"):
        return None
    text = first.start.hyperparams_json or "{}"
    try:
        hyper = json.loads(text)
    except ValueError:
        raise InvalidArgument(f"InitTensors: start.hyperparams_json is not JSON: {text[:80]!r}") from None
    return StartState(int(first.start.version), hyper)


def init_items(requests: Iterator, with_state: bool) -> tuple[Iterator, Iterator]:
    """An InitTensors stream after its first message, as ``(value chunks, state chunks)``: the
    values come first, then (with a saved state) the state's leaves. Read the values to their end
    before the state.

    Raises (while read):
      InvalidArgument: a state piece without ``start``, a value after the state, or a message that
        is neither.
    """
    pending: list = []

    def values() -> Iterator:
        for request in requests:
            kind = request.WhichOneof("item")
            if kind == "chunk":
                yield request.chunk
            elif kind == "state" and with_state:
                pending.append(request.state)
                return
            else:
                raise InvalidArgument(f"InitTensors: unexpected {kind or 'empty'} message after the first "
                                      f"(a saved state's leaves need `start` in the first message)")

    def states() -> Iterator:
        yield from pending
        for request in requests:
            if request.WhichOneof("item") != "state":
                raise InvalidArgument("InitTensors: the values come before the saved state's leaves, not after")
            yield request.state

    return values(), states()
