"""Fuzz run: malformed requests against every RPC of Control, ShardData and SessionClock, on a real server.

    .venv/bin/python -m bench.fuzz --requests 10000 --seed 0     # an embedded server (2 shards)
    .venv/bin/python -m bench.fuzz --service SessionClock ...     # the RPCs of one service only
    .venv/bin/python -m bench.fuzz --address HOST:PORT ...        # a running server (no tokens)

Requests are raw bytes on a plain gRPC channel (generic ``unary_unary`` / ``unary_stream`` /
``stream_unary`` / ``stream_stream`` calls with no serializer), drawn from a seeded generator:

- ``random``: random bytes;
- (any kind) names of up to 300,000 characters, which error messages echo;
- ``mutated``: a valid message (a push's header and chunks, a session definition, ...) with bytes
  flipped, inserted, deleted or cut off;
- ``huge_shape``: sessions and chunks declaring 2^40, 2^62 or negative dimensions, or ranks of 100;
- ``bad_offset``: chunks at negative, misaligned or out-of-range offsets, or with short data;
- ``truncated``: valid push streams ended early (no seal, half the chunks), or cancelled mid-way;
- ``deep_json``: optimizer arguments nested up to 100,000 deep;
- ``metadata``: valid requests carrying 16 KiB - 1 MiB of metadata.

SessionClock is the shards' internal endpoint (each shard serves the clocks of the sessions it is
home to; ``RunningServer.clock_addresses``). Its RPCs are unary and carry no tensors: ``huge_shape``
sends the extremes of each number's type (NaN and infinities included), ``bad_offset`` negative or
unknown shard indices, ordinals, keys and waits; ``truncated`` and ``deep_json`` do not apply. Most of
its requests carry the server's internal secret, which an embedded server's shard actors hand the
fuzzer (so the requests reach the servicer), the others a wrong secret or none (refused
UNAUTHENTICATED); fuzzing a running server (``--clock-address``), all go without it. They address
their own session (:data:`CLOCK_TARGET`): with the secret, the fuzzer is a server process and may
decide tickets no shard holds a push for, which stalls that session's data plane by design.

Before the fuzz, a healthy session takes one step; after it, its next step must equal an
in-process run of the same optimizer bit for bit. Printed: statuses by code and by kind,
crashes (a request answered UNAVAILABLE, or a server that stops answering; but for the "retry" of
a session created by the fuzz and never sent its initial values), UNKNOWN answers,
the healthy session's check, and resident memory (shards, and this process when the server is
embedded) before and after.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import json
import os
import random
import sys
import threading
import time
from typing import Callable, Optional

import grpc
import numpy as np
from google.protobuf.descriptor import FieldDescriptor

from optserve.protos import contract, sparse_codec
from optserve.protos.optserve.v1 import clock_pb2, control_pb2, data_pb2, tensor_pb2
from optserve.server.wire.security import INTERNAL_SECRET_KEY, InternalTrust

F32 = tensor_pb2.DTYPE_FLOAT32
KINDS = ("random", "mutated", "huge_shape", "bad_offset", "truncated", "deep_json", "metadata")
HEALTHY = "fuzz-healthy"  # never named by a fuzz request
TARGET = "fuzz-target"  # the session fuzz requests address (pushes, pulls, commits)
CLOCK_TARGET = "fuzz-clock"  # the session whose clock SessionClock requests address (no other request names it)
HEALTHY_OPTIMIZER = {"name": "adam", "args": {"learning_rate": 0.01}}
TARGET_OPTIMIZER = {"name": "sgd", "args": {"learning_rate": 0.01}}
SHAPES = {"a/w": (8, 6), "a/b": (6,), "b/w": (6, 4), "b/b": (4,)}

# (service, method, arity): arity is "uu", "us", "su" or "ss" (request / response streaming)
CONTROL = [(m.name, "uu") for m in control_pb2.DESCRIPTOR.services_by_name["Control"].methods]
DATA = [("InitTensors", "su"), ("Push", "su"), ("Commit", "uu"), ("Abort", "uu"), ("Pull", "us"), ("PushPull", "ss"),
        ("OfferSharedMemory", "uu"), ("OpenSharedMemory", "uu"), ("CloseSharedMemory", "uu"), ("Membership", "uu"),
        ("History", "uu")]
INITIALISING = "its initial values have not reached shard"  # the UNAVAILABLE of a session not yet initialised
CLOCK = [(m.name, "uu") for m in clock_pb2.DESCRIPTOR.services_by_name["SessionClock"].methods]
CLOCK_KINDS = ("random", "mutated", "huge_shape", "bad_offset", "metadata")  # unary, no tensors, no JSON
RPCS = ([("Control", m, a) for m, a in CONTROL] + [("ShardData", m, a) for m, a in DATA]
        + [("SessionClock", m, a) for m, a in CLOCK])
SERVICES = ("Control", "ShardData", "SessionClock")
# SessionClock "huge_shape": each number type's extremes
_EXTREMES = {FieldDescriptor.CPPTYPE_INT64: (2 ** 63 - 1, -(2 ** 63), 1 << 62),
             FieldDescriptor.CPPTYPE_INT32: (2 ** 31 - 1, -(2 ** 31)),
             FieldDescriptor.CPPTYPE_DOUBLE: (float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 5e-324, -0.0)}
# SessionClock "bad_offset": values no server process sends (shard indices past the session's are added)
_OUT_OF_RANGE = {"shard_index": (-1, -7, 2 ** 31 - 1), "ordinal": (-1, -(2 ** 62), 1 << 40), "key": (-1, -(2 ** 62)),
                 "timeout_s": (-1.0, -1e-9), "sequence": (-1, -(2 ** 63)), "base_version": (-5, 1 << 40)}


@dataclasses.dataclass
class Request:
    """One fuzz request: raw messages to one RPC (``messages`` has one item for unary requests)."""

    kind: str
    service: str
    method: str
    arity: str
    messages: list
    shard: int = 0  # ShardData, SessionClock: which shard's endpoint
    metadata: tuple = ()
    credentials: bool = False  # SessionClock: the sender adds the server's internal secret to ``metadata``
    cancel_after_s: Optional[float] = None  # cancel the call mid-stream (a client that vanishes)


@dataclasses.dataclass
class Report:
    """What a fuzz run found."""

    statuses: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    by_kind: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(collections.Counter))
    by_rpc: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(collections.Counter))
    examples: dict = dataclasses.field(default_factory=dict)  # status -> an example (rpc, kind, details)
    # SessionClock's OK replies by "Method: outcome" (:func:`clock_outcome`): what its clocks made of the requests
    clock_outcomes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    requests: int = 0
    crashes: int = 0
    seconds: float = 0.0

    @property
    def unknown(self) -> int:
        return self.statuses.get("UNKNOWN", 0)

    def add(self, request: Request, code: str, details: str) -> None:
        self.requests += 1
        self.statuses[code] += 1
        self.by_kind[request.kind][code] += 1
        self.by_rpc[f"{request.service}/{request.method}"][code] += 1
        if request.service == "SessionClock" and code == "OK":
            self.clock_outcomes[f"{request.method}: {details}"] += 1
        if code not in self.examples or (code in ("UNKNOWN", "INTERNAL") and len(self.examples) < 50):
            self.examples.setdefault(code, (f"{request.service}/{request.method}", request.kind, details[:200]))
        if code == "UNAVAILABLE" and INITIALISING not in details:  # a session fuzzing created and never
            self.crashes += 1  # initialised answers "retry" by design: not a crash


# ----------------------------------------------------------------------------- valid templates

def _tensor_spec(name, shape):
    return tensor_pb2.TensorSpec(name=name, dtype=F32, shape=list(shape))


def _session_config(name, shapes, optimizer, args=None) -> control_pb2.SessionConfig:
    return control_pb2.SessionConfig(
        name=name, tensors=[_tensor_spec(n, s) for n, s in shapes.items()],
        optimizer=control_pb2.OptimizerSpec(name=optimizer["name"],
                                            args_json=args if args is not None else json.dumps(optimizer["args"])),
        mode=control_pb2.MODE_SYNC, num_workers=1)


def _chunk(name, shape, values: np.ndarray, offset=0, dtype=F32) -> tensor_pb2.TensorChunk:
    return tensor_pb2.TensorChunk(name=name, dtype=dtype, shape=list(shape), offset=offset,
                                  data=np.ascontiguousarray(values, np.float32).tobytes())


class Generator:
    """Seeded fuzz requests for a target session laid out as ``layout`` (shard -> tensor names).

    Args:
      services: the services whose RPCs requests are drawn from (a kind that needs a streaming or
        Control RPC may still send a Control or ShardData request).
      clock_shards: the shard indices of :data:`CLOCK_TARGET`, its home (whose endpoint serves its
        clock) first; ``clock_endpoints``: how many SessionClock endpoints the sender reaches.
      trusted: the sender holds the server's internal secret.
    """

    def __init__(self, seed: int, layout: dict[int, list[str]], services=SERVICES, clock_shards=(),
                 clock_endpoints: int = 0, trusted: bool = False):
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        self.layout = layout
        self.sequence = 1_000_000
        self.rpcs = [rpc for rpc in RPCS if rpc[0] in services]
        self.clock_shards = list(clock_shards) or [0]
        self.clock_endpoints = clock_endpoints
        self.trusted = trusted

    # --- pieces
    def _name(self) -> str:
        r = self.rng.random()
        if r < 0.6:
            return TARGET
        if r < 0.8:
            return f"fuzz-scratch-{self.rng.randrange(50)}"
        return self._odd_name()

    def _odd_name(self) -> str:
        """A name no session has: huge (error messages echo it) or of odd characters, maybe empty."""
        if self.rng.random() < 0.15:  # status details must stay small
            return "n" * self.rng.choice([20_000, 300_000])
        return "".join(self.rng.choice("abc/-_\u00e9\u4e2d") for _ in range(self.rng.randrange(0, 40)))

    def _clock_session(self) -> str:
        """A SessionClock request's session: mostly :data:`CLOCK_TARGET`, else one that has no clock."""
        return CLOCK_TARGET if self.rng.random() < 0.7 else self._odd_name()

    def _client(self) -> str:
        return self.rng.choice(["fuzz-a", "fuzz-b", "", "x" * self.rng.randrange(1, 300)])

    def _sequence(self) -> int:
        """A new push's sequence number, or an odd one."""
        self.sequence += 1
        return self.rng.choice([self.sequence, -1, 0, 2 ** 62])

    def _header(self, auto_commit=True) -> data_pb2.PushHeader:
        return data_pb2.PushHeader(session=self._name(), client_id=self._client(), sequence=self._sequence(),
                                   base_version=self.rng.choice([0, -5, 2 ** 40, self.rng.randrange(0, 20)]),
                                   auto_commit=auto_commit)

    def _grad_chunks(self, shard: int) -> list[tensor_pb2.TensorChunk]:
        """A gradient's chunks: float32 values, or (a third of the time) a SparseLoCo selection."""
        chunks = []
        for n in self.layout[shard]:
            values = self.np_rng.standard_normal(SHAPES[n]).astype(np.float32) * 1e-3
            if self.rng.random() < 1 / 3:
                selection = sparse_codec.encode(values, self.rng.choice([2, 4, 64]), self.rng.choice([1, 3, 64]),
                                                self.rng.choice([2, 32]))
                chunks += [tensor_pb2.TensorChunk(name=n, dtype=contract.SPARSE, shape=list(SHAPES[n]), offset=offset,
                                                  data=data) for offset, data in selection.payloads(256)]
            else:
                chunks.append(_chunk(n, SHAPES[n], values))
        return chunks

    def _shard(self) -> int:
        return self.rng.choice(sorted(self.layout))

    def _pull(self) -> data_pb2.PullRequest:
        return data_pb2.PullRequest(session=self._name(), wire_dtype=self.rng.choice([0, 1, 2, 3, 7, -1]),
                                    max_chunk_bytes=self.rng.choice([0, 1, 1 << 16, 1 << 30, -4]))

    def _clock_valid(self, method: str) -> list:
        """A well-formed SessionClock request, as a non-home shard sends it (its content may be refused).
        Waits are short: a staged vote waits ``timeout_s`` for the other shards' votes, a sum
        part (keys 1-4, so parts meet) up to the server's step timeout for the others."""
        r = self.rng
        session, shard_index = self._clock_session(), r.choice(self.clock_shards)
        if method == "Vote":
            return [clock_pb2.ClockVoteRequest(session=session, client_id=self._client(), sequence=self._sequence(),
                                               base_version=r.choice([-1, 0, r.randrange(20)]), shard_index=shard_index,
                                               staged=r.random() < 0.5, timeout_s=r.choice([0.0, 0.05, 0.2]))]
        if method == "Commit":
            return [clock_pb2.ClockCommitRequest(session=session, client_id=self._client(), sequence=self._sequence(),
                                                 base_version=r.choice([0, -5, r.randrange(20)]))]
        if method == "GetTicket":
            return [clock_pb2.ClockTicketRequest(session=session, ordinal=r.randrange(40))]
        return [clock_pb2.ClockSumRequest(session=session, key=r.randrange(1, 5), shard_index=shard_index,
                                          value=r.uniform(-1.0, 1.0))]

    def valid(self, service: str, method: str, shard: int) -> list:
        """Messages of a well-formed request to ``method`` (valid in form; its content may be refused)."""
        r = self.rng
        if service == "SessionClock":
            return self._clock_valid(method)
        if service == "Control":
            if method == "CreateSession":
                shapes = {f"t{i}": tuple(r.randrange(1, 5) for _ in range(r.randrange(0, 3))) for i in range(r.randrange(1, 4))}
                return [control_pb2.CreateSessionRequest(
                    config=_session_config(f"fuzz-scratch-{r.randrange(50)}", shapes, TARGET_OPTIMIZER),
                    client_id=self._client())]
            if method == "GetSession":
                request = control_pb2.GetSessionRequest(name=self._name())
                if r.random() < 0.5:
                    request.expect_optimizer.CopyFrom(control_pb2.OptimizerSpec(name="sgd", args_json='{"learning_rate": 0.5}'))
                return [request]
            if method == "CloseSession":
                return [control_pb2.CloseSessionRequest(name=f"fuzz-scratch-{r.randrange(50)}")]
            request_class = getattr(control_pb2, f"{method}Request")
            request = request_class()
            if "name" in request_class.DESCRIPTOR.fields_by_name:
                request.name = self._name()
            return [request]
        if method == "InitTensors":
            return ([data_pb2.InitTensorsRequest(session=self._name(), client_id=self._client())]
                    + [data_pb2.InitTensorsRequest(chunk=c) for c in self._grad_chunks(shard)])
        if method == "Push":
            return ([data_pb2.PushRequest(header=self._header(auto_commit=r.random() < 0.5))]
                    + [data_pb2.PushRequest(chunk=c) for c in self._grad_chunks(shard)])
        if method in ("Commit", "Abort"):
            message = data_pb2.CommitRequest if method == "Commit" else data_pb2.AbortRequest
            return [message(session=self._name(), client_id=self._client(), sequence=r.choice([self.sequence, -1, 0]))]
        if method == "Pull":
            return [self._pull()]
        if method == "OfferSharedMemory":
            return [data_pb2.OfferSharedMemoryRequest(session=self._name(), client_id=self._client())]
        if method == "OpenSharedMemory":
            return [data_pb2.OpenSharedMemoryRequest(session=self._name(), client_id=self._client(),
                                                     offer=r.choice(["", "o" * 40, os.urandom(8).hex()]),
                                                     nonce=os.urandom(r.choice([0, 16, 32])))]
        if method == "CloseSharedMemory":
            return [data_pb2.CloseSharedMemoryRequest(session=self._name(), region=r.choice(["", "r1", "x" * 300]))]
        if method == "Membership":
            return [data_pb2.MembershipRequest(session=self._name(), worker_id=r.choice(["w1", "", "a/b", "w" * 80]),
                                               action=r.choice([0, 1, 2, 3, 9]))]
        if method == "History":
            return [data_pb2.HistoryRequest(session=self._name(), since=r.choice([0, -5, 1 << 40]))]
        # PushPull: one-message step, streamed, or two-phase
        framing = r.choice(["step", "streamed", "two_phase"])
        if framing == "step":
            return [data_pb2.PushPullRequest(step=data_pb2.PushPullStep(header=self._header(), pull=self._pull(),
                                                                        chunks=self._grad_chunks(shard)))]
        messages = [data_pb2.PushPullRequest(header=self._header(auto_commit=framing == "streamed")),
                    data_pb2.PushPullRequest(pull=self._pull())]
        messages += [data_pb2.PushPullRequest(chunk=c) for c in self._grad_chunks(shard)]
        messages.append(data_pb2.PushPullRequest(seal=True))
        if framing == "two_phase":
            messages.append(data_pb2.PushPullRequest(decision=data_pb2.PushDecision(commit=r.random() < 0.5)))
        return messages

    # --- kinds
    def _mutate(self, raw: bytes) -> bytes:
        data = bytearray(raw)
        for _ in range(self.rng.randrange(1, 5)):
            op = self.rng.randrange(5)
            if op == 0 and data:  # flip a byte
                data[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
            elif op == 1:  # insert random bytes
                at = self.rng.randrange(len(data) + 1)
                data[at:at] = os.urandom(self.rng.randrange(1, 8))
            elif op == 2 and data:  # delete a range
                at = self.rng.randrange(len(data))
                del data[at:at + self.rng.randrange(1, 16)]
            elif op == 3 and data:  # cut off
                del data[self.rng.randrange(len(data)):]
            else:  # a varint's continuation bit set: lengths become huge
                if data:
                    data[self.rng.randrange(len(data))] |= 0x80
        return bytes(data)

    def request(self) -> Request:
        service, method, arity = self.rng.choice(self.rpcs)
        kind = self.rng.choice(CLOCK_KINDS if service == "SessionClock" else KINDS)
        shard = self._clock_endpoint() if service == "SessionClock" else self._shard()
        request = getattr(self, f"_{kind}")(Request(kind, service, method, arity, [], shard))
        if request.service == "SessionClock":
            self._credentials(request)
        return request

    def _clock_endpoint(self) -> int:
        """Mostly the clock target's home shard (its clock is there), else any shard's endpoint."""
        if self.rng.random() < 0.8 or self.clock_endpoints == 0:
            return self.clock_shards[0]
        return self.rng.randrange(self.clock_endpoints)

    def _credentials(self, request: Request) -> None:
        """A SessionClock request carries the internal secret (mostly, when the sender holds it),
        else a wrong one or none."""
        r = self.rng.random()
        if self.trusted and r < 0.8:
            request.credentials = True
        elif r >= 0.9:
            request.metadata += ((INTERNAL_SECRET_KEY, self.rng.randbytes(32).hex()),)

    def _serialized(self, request: Request) -> list[bytes]:
        return [m.SerializeToString() for m in self.valid(request.service, request.method, request.shard)]

    def _random(self, request: Request) -> Request:
        count = 1 if request.arity in ("uu", "us") else self.rng.randrange(1, 4)
        request.messages = [os.urandom(self.rng.choice([0, 1, 5, 40, 300, 4000])) for _ in range(count)]
        return request

    def _mutated(self, request: Request) -> Request:
        messages = self._serialized(request)
        at = self.rng.randrange(len(messages))
        messages[at] = self._mutate(messages[at])
        request.messages = messages
        return request

    def _huge_shape(self, request: Request) -> Request:
        if request.service == "SessionClock":
            return self._clock_numbers(request, _EXTREMES, lambda field: field.cpp_type)
        shape = self.rng.choice([(1 << 40,), (1 << 62,), (1 << 31, 1 << 31), (1 << 20, 1 << 20), (-1, 4),
                                 (2 ** 63 - 1,), (1,) * 100, (3, 0, 1 << 50)])
        if request.service == "Control":
            request.method, request.arity = "CreateSession", "uu"
            config = _session_config(f"fuzz-scratch-{self.rng.randrange(50)}", {"w": shape, "b": (3,)}, TARGET_OPTIMIZER)
            request.messages = [control_pb2.CreateSessionRequest(config=config, client_id="fuzz-a").SerializeToString()]
            return request
        messages = self.valid(request.service, request.method, request.shard)
        for message in messages:
            chunk = _chunk_field(message)
            if chunk is not None:
                del chunk.shape[:]
                chunk.shape.extend(shape)
                break
        request.messages = [m.SerializeToString() for m in messages]
        return request

    def _bad_offset(self, request: Request) -> Request:
        if request.service == "SessionClock":
            beyond = max(self.clock_shards) + 1  # a shard the session does not have
            table = {**_OUT_OF_RANGE, "shard_index": _OUT_OF_RANGE["shard_index"] + (beyond,)}
            return self._clock_numbers(request, table, lambda field: field.name)
        if request.service == "Control" or request.method in ("Commit", "Abort", "Pull"):
            request.service, request.method = "ShardData", self.rng.choice(["Push", "PushPull", "InitTensors"])
            request.arity = dict(DATA)[request.method]
        messages = self.valid(request.service, request.method, request.shard)
        chunks = [c for c in (_chunk_field(m) for m in messages) if c is not None]
        if chunks:
            chunk = self.rng.choice(chunks)
            how = self.rng.randrange(4)
            if how == 0:
                chunk.offset = self.rng.choice([-4, -(2 ** 62), 2 ** 62, 2 ** 63 - 1])
            elif how == 1:
                chunk.offset = self.rng.choice([1, 3, 6])  # misaligned
            elif how == 2:
                chunk.data = chunk.data[: self.rng.randrange(len(chunk.data) + 1)]
            else:
                chunk.offset = len(chunk.data)  # overlaps the end
        request.messages = [m.SerializeToString() for m in messages]
        return request

    def _clock_numbers(self, request: Request, values: dict, key: Callable) -> Request:
        """A well-formed SessionClock request with some of its numeric fields set from
        ``values[key(field)]`` (at least one: every clock request has one)."""
        message = self._clock_valid(request.method)[0]
        fields = [f for f in message.DESCRIPTOR.fields if key(f) in values]
        for field in self.rng.sample(fields, self.rng.randrange(1, len(fields) + 1)):
            setattr(message, field.name, self.rng.choice(values[key(field)]))
        request.messages = [message.SerializeToString()]
        return request

    def _truncated(self, request: Request) -> Request:
        if request.arity not in ("su", "ss"):
            request.service, request.method = "ShardData", self.rng.choice(["Push", "PushPull", "InitTensors"])
            request.arity = dict(DATA)[request.method]
        messages = self._serialized(request)
        if self.rng.random() < 0.3:
            request.cancel_after_s = self.rng.choice([0.0, 0.05, 0.2])
            messages.append(None)  # the stream stalls here until the call is cancelled
        else:
            messages = messages[: self.rng.randrange(0, len(messages))]
            if messages and self.rng.random() < 0.5:
                messages[-1] = messages[-1][: self.rng.randrange(len(messages[-1]) + 1)]
        request.messages = messages
        return request

    def _deep_json(self, request: Request) -> Request:
        depth = self.rng.choice([20, 40, 100, 999, 5000, 100_000])
        inner = self.rng.choice(["[", '{"a":'])
        close = "]" if inner == "[" else "}"
        args = '{"learning_rate": 0.01, "momentum": ' + inner * depth + close * depth + "}"
        if self.rng.random() < 0.2:
            args = '{"learning_rate": "' + "x" * self.rng.choice([1000, 2 << 20]) + '"}'
        spec = control_pb2.OptimizerSpec(name="sgd", args_json=args)
        if self.rng.random() < 0.5:
            config = _session_config(f"fuzz-scratch-{self.rng.randrange(50)}", {"w": (3,)}, TARGET_OPTIMIZER)
            config.optimizer.CopyFrom(spec)
            request.service, request.method, request.arity = "Control", "CreateSession", "uu"
            request.messages = [control_pb2.CreateSessionRequest(config=config).SerializeToString()]
        else:
            request.service, request.method, request.arity = "Control", "GetSession", "uu"
            request.messages = [control_pb2.GetSessionRequest(name=TARGET, expect_optimizer=spec).SerializeToString()]
        return request

    def _metadata(self, request: Request) -> Request:
        request.messages = self._serialized(request)
        size = self.rng.choice([16 << 10, 100 << 10, 1 << 20])
        if self.rng.random() < 0.5:
            request.metadata = (("x-fuzz", "m" * size),)
        else:
            request.metadata = tuple((f"x-fuzz-{i}", "m" * 1000) for i in range(size // 1000))
        return request


def _chunk_field(message):
    """The TensorChunk a data-plane message carries, or None."""
    if isinstance(message, data_pb2.PushPullRequest) and message.WhichOneof("item") == "step":
        return message.step.chunks[0] if message.step.chunks else None
    if "item" in message.DESCRIPTOR.oneofs_by_name and message.WhichOneof("item") == "chunk":
        return message.chunk
    return None


# ----------------------------------------------------------------------------- sending

@dataclasses.dataclass(frozen=True)
class ClockAccess:
    """How the fuzzer reaches the shards' SessionClock endpoints: their addresses by shard index,
    and the server's :class:`~optserve.server.wire.security.InternalTrust` (None: the fuzzer is
    not a server process, and every request goes without the secret)."""

    addresses: tuple
    trust: Optional[InternalTrust] = None


def clock_access_of(running) -> ClockAccess:
    """An embedded server's (a ``RunningServer``) clock endpoints, with the internal trust its
    shard actors were started with."""
    import ray

    return ClockAccess(tuple(running.clock_addresses), ray.get(running.fleet.actors[0].internal_trust.remote()))


def clock_outcome(method: str, reply: bytes) -> str:
    """What a SessionClock reply holds: "ticket", "total", "neither" (no such ticket; a refusing
    vote) or "error KIND" (a domain refusal, e.g. "error NOT_FOUND")."""
    message = (clock_pb2.ClockSumReply if method == "ReduceSum" else clock_pb2.ClockTicketReply).FromString(reply)
    outcome = message.WhichOneof("outcome")
    if outcome == "error":
        return "error " + clock_pb2.ClockErrorKind.Name(message.error.kind).removeprefix("CLOCK_ERROR_KIND_")
    return outcome or "neither"


class Sender:
    """Sends raw requests on plain channels to the coordinator and the shards (and, with ``clock``,
    to the shards' SessionClock endpoints: TLS ones when the server's internal trust has TLS)."""

    def __init__(self, address: str, shard_addresses: list[str], timeout_s: float, clock: Optional[ClockAccess] = None):
        options = list(contract.CHANNEL_OPTIONS)
        trust = clock.trust if clock is not None else None
        self._channels = {"Control": [grpc.insecure_channel(address, options=options)],
                          "ShardData": [grpc.insecure_channel(a, options=options) for a in shard_addresses],
                          "SessionClock": [trust.channel(a) if trust is not None else grpc.insecure_channel(a, options)
                                           for a in (clock.addresses if clock is not None else ())]}
        self._secret = trust.metadata if trust is not None else ()
        self._timeout = timeout_s

    def close(self) -> None:
        for channels in self._channels.values():
            for channel in channels:
                channel.close()

    def send(self, request: Request) -> tuple[str, str]:
        channel = self._channels[request.service][0 if request.service == "Control" else request.shard]
        path = f"/optserve.v1.{request.service}/{request.method}"
        call_kind = {"uu": channel.unary_unary, "us": channel.unary_stream, "su": channel.stream_unary,
                     "ss": channel.stream_stream}[request.arity]
        rpc = call_kind(path, request_serializer=None, response_deserializer=None)
        metadata = request.metadata + (self._secret if request.credentials else ())
        kwargs = {"timeout": self._timeout, "metadata": metadata or None}
        try:
            if request.arity in ("uu", "us"):
                payload = request.messages[0] if request.messages else b""
                result = rpc(payload, **kwargs)
                if request.service == "SessionClock":
                    return "OK", clock_outcome(request.method, result)
                if request.arity == "us":
                    for _ in result:
                        pass
            elif request.cancel_after_s is not None:
                stop = threading.Event()
                call = (rpc.future if request.arity == "su" else rpc)(_stalling(request.messages, stop), **kwargs)
                time.sleep(request.cancel_after_s)
                call.cancel()
                stop.set()
                try:
                    call.result() if request.arity == "su" else list(call)
                except grpc.FutureCancelledError:
                    return "CANCELLED", "cancelled by the fuzzer"
            else:
                result = rpc(iter(request.messages), **kwargs)
                if request.arity == "ss":
                    for _ in result:
                        pass
        except grpc.RpcError as error:
            return error.code().name, error.details() or ""
        return "OK", ""


def _stalling(messages, stop: threading.Event):
    for message in messages:
        if message is None:
            stop.wait(30)
            return
        yield message


# ----------------------------------------------------------------------------- the run

def _target_shards(address: str, name: str) -> list:
    """Creates (or finds) a fuzz target session with initial values; returns its shard map (the
    ``ShardAssignment`` list, its home shard first)."""
    from optserve.client import AlreadyExistsError, Client

    with Client(address, timeout=60) as client:
        try:
            session = client.create_session(name, _params(1), optimizer=TARGET_OPTIMIZER)
        except AlreadyExistsError:
            session = client.session(name)
        return list(session.info.shards)


def target_layout(address: str) -> dict[int, list[str]]:
    """Creates (or finds) the fuzz target session with initial values; returns shard -> tensor names."""
    return {i: list(s.tensor_names) for i, s in enumerate(_target_shards(address, TARGET))}


def clock_target_shards(address: str) -> list[int]:
    """Creates (or finds) :data:`CLOCK_TARGET` (spread over the shards, so its home shard serves
    its clock); returns its shard indices, its home first."""
    return [s.shard_index for s in _target_shards(address, CLOCK_TARGET)]


def shard_addresses_of(address: str) -> list[str]:
    from optserve.client import Client

    with Client(address, timeout=60) as client:
        return [s.address for s in client.session(TARGET).info.shards]


def _params(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def run(address: str, requests: int, seed: int = 0, concurrency: int = 8, timeout_s: float = 10.0,
        progress: Optional[Callable[[int], None]] = None, clock: Optional[ClockAccess] = None,
        services=SERVICES) -> Report:
    """Sends ``requests`` fuzz requests (seeded) to the server at ``address``; returns the report.

    ``services``: the services whose RPCs are fuzzed; SessionClock only with ``clock`` (its
    endpoints, and the secret if known). The fuzz target sessions are created first; they are
    closed at the end, as are the scratch sessions fuzz requests may have created. A request
    answered UNAVAILABLE counts as a crash.
    """
    fuzzed = [s for s in services if s != "SessionClock" or clock is not None]
    if not fuzzed:
        raise ValueError(f"nothing to fuzz: services {list(services)} (SessionClock needs its endpoints, clock=)")
    services = fuzzed
    layout = target_layout(address)
    clock_shards = clock_target_shards(address) if "SessionClock" in services else []
    sender = Sender(address, shard_addresses_of(address), timeout_s, clock)
    generator = Generator(seed, {i: names for i, names in layout.items() if names}, services, clock_shards,
                          len(clock.addresses) if clock is not None else 0,
                          clock is not None and clock.trust is not None)
    report = Report()
    started = time.perf_counter()
    lock = threading.Lock()
    slots = threading.Semaphore(2 * concurrency)  # requests are generated as slots free up, not all at once

    def one(request: Request) -> None:
        try:
            code, details = sender.send(request)
        except Exception as exc:  # noqa: BLE001 - the fuzzer's own fault: counted, never lost
            code, details = "FUZZER_ERROR", f"{type(exc).__name__}: {exc}"
        finally:
            slots.release()
        with lock:
            report.add(request, code, details)
            if progress is not None and report.requests % 1000 == 0:
                progress(report.requests)

    try:
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            for _ in range(requests):
                slots.acquire()
                pool.submit(one, generator.request())
    finally:
        report.seconds = time.perf_counter() - started
        sender.close()
        cleanup(address)
    return report


def cleanup(address: str) -> None:
    """Closes the target sessions and the scratch ones."""
    from optserve.client import Client, NotFoundError

    with Client(address, timeout=60) as client:
        for name in client.list_sessions():
            if name in (TARGET, CLOCK_TARGET) or name.startswith("fuzz-scratch-"):
                try:
                    client.close_session(name)
                except NotFoundError:
                    pass


def server_answers(address: str) -> bool:
    """The coordinator answers and every shard reports healthy."""
    from optserve.protos.optserve.v1 import control_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            status = control_pb2_grpc.ControlStub(channel).GetServerStatus(control_pb2.GetServerStatusRequest(),
                                                                           timeout=30)
        except grpc.RpcError:
            return False
    return all(s.healthy for s in status.shards)


def shard_resident_bytes(address: str) -> list[int]:
    from optserve.protos.optserve.v1 import control_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        status = control_pb2_grpc.ControlStub(channel).GetServerStatus(control_pb2.GetServerStatusRequest(), timeout=30)
    return [s.resident_bytes for s in status.shards]


class HealthySession:
    """A session stepped before and after the fuzz, checked against the same optimizer in process."""

    def __init__(self, address: str):
        import jax
        import optax

        from optserve.client import Client
        from optserve.optim_kernels import build_optimizer

        self._client = Client(address, timeout=60)
        params = _params(0)
        self.session = self._client.create_session(HEALTHY, params, optimizer=HEALTHY_OPTIMIZER)
        tx = build_optimizer(HEALTHY_OPTIMIZER["name"], HEALTHY_OPTIMIZER["args"]).transformation
        self._params = {k: jax.numpy.asarray(v) for k, v in params.items()}
        self._state = tx.init(self._params)

        def step(p, s, g):
            updates, s = tx.update(g, s, p)
            return optax.apply_updates(p, updates), s

        self._step = jax.jit(step)
        self.step_number = 0

    def step_matches(self) -> bool:
        """One more step on the server and in process: bit-identical parameters?"""
        rng = np.random.default_rng(1000 + self.step_number)
        grads = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
        self.step_number += 1
        served = self.session.push_pull(grads)
        self._params, self._state = self._step(self._params, self._state, grads)
        return all(np.array_equal(served[n], np.asarray(self._params[n])) for n in SHAPES)

    def close(self) -> None:
        self.session.close()
        self._client.close()


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"


def print_report(report: Report, out=sys.stdout) -> None:
    print(f"requests: {report.requests} in {report.seconds:.1f} s ({report.requests / max(report.seconds, 1e-9):.0f}/s)",
          file=out)
    print("statuses: " + ", ".join(f"{c} {n}" for c, n in report.statuses.most_common()), file=out)
    print(f"crashes (UNAVAILABLE): {report.crashes}   UNKNOWN: {report.unknown}   "
          f"INTERNAL: {report.statuses.get('INTERNAL', 0)}", file=out)
    print("by kind:", file=out)
    for kind in KINDS:
        counts = report.by_kind.get(kind, {})
        print(f"  {kind:<11} " + ", ".join(f"{c} {n}" for c, n in sorted(counts.items(), key=lambda i: -i[1])),
              file=out)
    print("by rpc:", file=out)
    for rpc in sorted(report.by_rpc):
        counts = report.by_rpc[rpc]
        print(f"  {rpc:<26} " + ", ".join(f"{c} {n}" for c, n in sorted(counts.items(), key=lambda i: -i[1])),
              file=out)
    if report.clock_outcomes:
        print("SessionClock replies (OK): " + ", ".join(f"{o} {n}" for o, n in sorted(report.clock_outcomes.items())),
              file=out)
    for code in ("UNKNOWN", "INTERNAL"):
        if code in report.examples:
            print(f"example {code}: {report.examples[code]}", file=out)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--small", action="store_true", help="2,000 requests (as `python -m bench --small`)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--address", default=None, help="fuzz a running server (default: start an embedded one)")
    parser.add_argument("--service", action="append", choices=SERVICES, default=None,
                        help="fuzz this service's RPCs only (repeatable; default: every service)")
    parser.add_argument("--clock-address", action="append", default=[],
                        help="with --address: a shard's SessionClock endpoint, by shard index (repeatable); "
                             "requests go without the internal secret")
    args = parser.parse_args(argv)
    if args.small:
        args.requests = min(args.requests, 2_000)

    running = None
    address = args.address
    if address is None:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        from optserve.server.app import start_server
        from optserve.server.domain.config import ServerConfig

        # short waits: a push the fuzzer sends to one shard only is refused after vote_timeout_s
        running = start_server(ServerConfig(host="127.0.0.1", port=0, shards=2, min_shard_bytes=0,
                                            vote_timeout_s=1.0, step_timeout_s=5.0, staged_push_ttl_s=2.0))
        address = running.address
    clock = clock_access_of(running) if running is not None else (
        ClockAccess(tuple(args.clock_address)) if args.clock_address else None)
    from optserve.server.ops.metrics import resident_bytes

    try:
        healthy = HealthySession(address)
        first = healthy.step_matches()
        shards_before, self_before = shard_resident_bytes(address), resident_bytes()
        report = run(address, args.requests, args.seed, args.concurrency,
                     progress=lambda n: print(f"  ... {n} requests", flush=True), clock=clock,
                     services=args.service or SERVICES)
        alive = server_answers(address)
        second = healthy.step_matches()
        healthy.close()
        shards_after, self_after = shard_resident_bytes(address), resident_bytes()
    finally:
        if running is not None:
            running.stop()
    print_report(report)
    print(f"server answers afterwards (coordinator + every shard healthy): {alive}")
    print(f"healthy session bit-exact with the in-process optimizer: before the fuzz {first}, after {second}")
    print("shard RSS before -> after: " + ", ".join(f"{_mib(b)} -> {_mib(a)}"
                                                    for b, a in zip(shards_before, shards_after)))
    if running is not None:
        print(f"coordinator + fuzzer process RSS before -> after: {_mib(self_before)} -> {_mib(self_after)}")
    ok = (alive and first and second and report.crashes == 0 and report.unknown == 0
          and report.statuses.get("INTERNAL", 0) == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
