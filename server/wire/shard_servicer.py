"""Wire layer of a shard: the ShardData gRPC service.

Each method decodes its request, makes one call on the session's
:class:`~optserve.server.domain.shard_session.ShardSession` and encodes the answer; the domain
error table (:mod:`optserve.server.wire.errors`) turns refusals into statuses. Chunks are read
in place and written once (:mod:`optserve.protos.chunk_codec`, served by :func:`add_to_server`).

Step framings on ``PushPull`` (repeated until the client ends the call):

* one message: ``step`` -> ``step_result`` (or chunks, ``done`` when the parameters exceed one chunk);
* streamed: ``header``, [``pull``], chunks, ``seal`` -> chunks, ``done``;
* two-phase (``header.auto_commit`` false): ... ``seal`` -> ``staged``; ``decision`` -> chunks,
  ``done`` (commit) or ``done`` (abort). The SDK never uses it; ``Commit`` / ``Abort`` are the
  same decision as unary calls after a ``Push``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Iterator, Optional

import grpc

from optserve.protos import chunk_codec, contract
from optserve.protos.optserve.v1 import data_pb2, data_pb2_grpc, tensor_pb2
from optserve.server.domain.assembly import wire_dtype
from optserve.server.domain.config import MAX_WORKER_ID, WORKER_SEPARATOR, DType
from optserve.server.domain.errors import Cancelled, InvalidArgument, OptservError, ResourceExhausted
from optserve.server.domain.shard_session import PushHeader, Receipt, ShardRegistry, ShardSession
from optserve.server.domain.telemetry import Telemetry
from optserve.server.wire.errors import grpc_errors, safe_decoder
from optserve.server.wire.security import TokenTable
from optserve.server.wire.shared_memory import RegionTable

_log = logging.getLogger(__name__)


def _first(requests: Iterator, field: str, what: str):
    """The stream's first message, which must carry ``field``."""
    request = next(requests, None)
    if request is None or request.WhichOneof("item") != field:
        raise InvalidArgument(f"{what}: the first message must be `{field}`")
    return request


_MEMBERSHIP_ACTIONS = {data_pb2.MEMBERSHIP_JOIN: "join", data_pb2.MEMBERSHIP_RENEW: "renew",
                       data_pb2.MEMBERSHIP_LEAVE: "leave"}


def _worker_id(worker_id: str) -> str:
    """A Membership request's worker id: 1-64 characters without '/'."""
    if not 1 <= len(worker_id) <= MAX_WORKER_ID or WORKER_SEPARATOR in worker_id:
        raise InvalidArgument(f"Membership: worker_id must have 1-{MAX_WORKER_ID} characters and no "
                              f"{WORKER_SEPARATOR!r}, got {worker_id[:80]!r}")
    return worker_id


def _client_id(client_id: str, what: str) -> str:
    """``client_id``, if it is at most :data:`~optserve.protos.contract.MAX_CLIENT_ID_CHARS` long."""
    if not client_id:
        raise InvalidArgument(f"{what}: client_id must be non-empty")
    if len(client_id) > contract.MAX_CLIENT_ID_CHARS:
        raise InvalidArgument(f"{what}: client_id has {len(client_id)} characters, more than "
                              f"{contract.MAX_CLIENT_ID_CHARS}")
    return client_id


def _push_header(message: data_pb2.PushHeader) -> PushHeader:
    _client_id(message.client_id, "push header")
    telemetry = Telemetry(message.loss if message.HasField("loss") else None, dict(message.scalars))
    return PushHeader(message.client_id, message.sequence, message.base_version, message.auto_commit, telemetry)


def _wait_s(context, header: data_pb2.PushHeader) -> Optional[float]:
    """How long the caller waits for a push's answer: its call's deadline, or the header's own
    (a step on a reused call) if sooner."""
    remaining = context.time_remaining()
    if header.HasField("wait_s") and header.wait_s > 0:
        return header.wait_s if remaining is None else min(remaining, header.wait_s)
    return remaining


def _pull_options(request: data_pb2.PullRequest) -> tuple[Optional[DType], int]:
    dtype = None if request.wire_dtype == tensor_pb2.DTYPE_UNSPECIFIED else wire_dtype(request.wire_dtype, what="pull wire_dtype")
    return dtype, contract.clamp_chunk_bytes(request.max_chunk_bytes or None)


def _param_slices(session: ShardSession, params, dtype: Optional[DType], chunk_bytes: int):
    """(name, wire dtype value, shape, byte offset, bytes view) of the shard's parameters, in order."""
    for name, spec in session.specs.items():
        wire = dtype or spec.dtype
        array = params[name]
        for offset, data in contract.slices(contract.wire_bytes(array, wire.value), wire.itemsize, chunk_bytes):
            yield name, wire.value, array.shape, offset, data


def _tensor_chunk(name, dtype, shape, offset, data) -> tensor_pb2.TensorChunk:
    return tensor_pb2.TensorChunk(name=name, dtype=dtype, shape=list(shape), offset=offset, data=bytes(data))


def _push_response(receipt: Receipt) -> data_pb2.PushResponse:
    return data_pb2.PushResponse(already_applied=receipt.already_applied, version=receipt.version,
                                 committed=receipt.committed, staleness=receipt.staleness)


class _OpenStream:
    """One open PushPull call: ``idle_since`` (monotonic) while it waits for a step's first
    message, None while a step runs; ``served``: a step ran on it; ``evicted`` once
    :class:`_OpenStreams` ended it."""

    __slots__ = ("context", "tenant", "idle_since", "served", "evicted", "pushers", "goodbye", "noted")

    def __init__(self, context, tenant: str = ""):
        self.context = context
        self.tenant = tenant
        self.pushers: dict[tuple[int, str], ShardSession] = {}  # elastic sessions' pushers on this call
        self.goodbye = False  # the client ended the call on purpose (see PushPullRequest.goodbye)
        self.noted: Optional[tuple[str, str]] = None  # (session, client_id) of the last step looked at
        self.idle_since: Optional[float] = time.monotonic()
        self.served = False
        self.evicted = False


class _OpenStreams:
    """The open PushPull calls; each holds a server thread for as long as it stays open.

    Past ``limit`` open calls the table is *crowded*: a call ends after its current step
    (``StepDone.stream_closing``), and calls that wait idle for their next step are ended at once,
    the longest idle first, down to ``limit`` (the client reopens: a reused call that ended before
    its step started is retried). A sweeper thread (while any call is open) does this every
    ``period_s``, so a crowd of idle calls cannot hold the threads a new client needs. A call
    idle for less than ``min_idle_s`` is left alone (its step's first message is on its way), and
    a new call that has not served a step yet for less than ``new_idle_s`` (the SDK opens a call
    with its step's messages, so only a call that sends nothing waits that long).
    """

    def __init__(self, limit: int, min_idle_s: float = 0.5, new_idle_s: float = 3.0, period_s: float = 0.25,
                 max_per_tenant: Optional[int] = None):
        self.limit = limit
        self._max_per_tenant = max_per_tenant
        self._min_idle_s = min_idle_s
        self._new_idle_s = new_idle_s
        self._period_s = period_s
        self._open: set[_OpenStream] = set()
        self._lock = threading.Lock()
        self._sweeping = False

    def open(self, context, tenant: str = "") -> _OpenStream:
        """Registers a new call of ``tenant``.

        Raises:
          ResourceExhausted: the tenant already holds ``max_per_tenant`` open calls here.
        """
        stream = _OpenStream(context, tenant)
        with self._lock:
            held = sum(1 for s in self._open if s.tenant == tenant)
            if self._max_per_tenant is not None and held >= self._max_per_tenant:
                raise ResourceExhausted(f"tenant {tenant!r}: {held + 1} open PushPull calls on this shard: over the "
                                        f"limit max_streams_per_tenant={self._max_per_tenant} "
                                        f"(server flag --max-streams-per-tenant)")
            self._open.add(stream)
            start = not self._sweeping
            self._sweeping = True
        if start:
            threading.Thread(target=self._sweep, name="optserve-stream-sweeper", daemon=True).start()
        return stream

    def close(self, stream: _OpenStream) -> None:
        with self._lock:
            self._open.discard(stream)

    def idle(self, stream: _OpenStream) -> None:
        """The call waits for its next step's first message."""
        with self._lock:
            stream.idle_since = time.monotonic()

    def busy(self, stream: _OpenStream) -> bool:
        """A step's first message arrived; False if the call was ended meanwhile (drop the step:
        the client hears CANCELLED before any answer, and retries it on a new call)."""
        with self._lock:
            stream.idle_since = None
            stream.served = True
            return not stream.evicted

    def crowded(self) -> bool:
        return len(self._open) > self.limit

    def _sweep(self) -> None:
        while True:
            time.sleep(self._period_s)
            with self._lock:
                if not self._open:
                    self._sweeping = False
                    return
                now = time.monotonic()
                idle = sorted((s for s in self._open if s.idle_since is not None and not s.evicted
                               and now - s.idle_since >= (self._min_idle_s if s.served else self._new_idle_s)),
                              key=lambda s: s.idle_since)
                excess = len(self._open) - sum(s.evicted for s in self._open) - self.limit
                ended = [(stream, now - stream.idle_since) for stream in idle[:max(0, excess)]]
                for stream, _ in ended:
                    stream.evicted = True
                count = len(self._open)
            for stream, idle_s in ended:
                _log.info("event=stream_ended reason=idle_while_crowded peer=%s idle_s=%.1f open=%d limit=%d",
                          stream.context.peer(), idle_s, count, self.limit)
                stream.context.cancel()


class ShardDataServicer(data_pb2_grpc.ShardDataServicer):
    """ShardData on one shard actor (serve it with :func:`add_to_server`).

    ``max_open_streams``: PushPull calls past this many end after their current step
    (``StepDone.stream_closing``) and idle ones end at once (:class:`_OpenStreams`), so open
    streams never take all the server's threads.
    ``tokens``: the server's tenant tokens (None: no tenants); a call reaches only its tenant's
    sessions (the interceptor already refused calls without a valid token).
    ``max_streams_per_tenant``: PushPull calls one tenant may hold open here (None: no bound);
    one more is RESOURCE_EXHAUSTED naming the limit.
    """

    def __init__(self, registry: ShardRegistry, max_open_streams: int = 16, tokens: Optional[TokenTable] = None,
                 max_streams_per_tenant: Optional[int] = None):
        self._registry = registry
        self._streams = _OpenStreams(max_open_streams, max_per_tenant=max_streams_per_tenant)
        self._tokens = tokens
        self.regions = RegionTable(registry)  # same-host fast path (server/wire/shared_memory.py)

    def _tenant(self, context) -> str:
        return self._tokens.tenant(context) if self._tokens is not None else ""

    def _session(self, name: str, context) -> ShardSession:
        return self._registry.get(name, self._tenant(context))

    @grpc_errors
    def InitTensors(self, request_iterator, context):
        first = _first(request_iterator, "session", "InitTensors")
        version = self._session(first.session, context).initialize((r.chunk for r in request_iterator), first.client_id)
        return data_pb2.InitTensorsResponse(version=version)

    @grpc_errors
    def Push(self, request_iterator, context):
        start = time.perf_counter()
        header = _first(request_iterator, "header", "Push").header
        session = self._session(header.session, context)
        receipt = session.push(_push_header(header), (r.chunk for r in request_iterator), context.is_active,
                               wait_s=_wait_s(context, header))
        session.observer.pushed(time.perf_counter() - start)
        receipt.durable()  # the answer acknowledges the push: its step is in the step log first
        return _push_response(receipt)

    @grpc_errors
    def Commit(self, request, context):
        session = self._session(request.session, context)
        receipt = session.commit(_client_id(request.client_id, "Commit"), request.sequence,
                                 wait_s=context.time_remaining())
        receipt.durable()
        return data_pb2.CommitResponse(version=receipt.version, staleness=receipt.staleness, scale=receipt.scale)

    @grpc_errors
    def Abort(self, request, context):
        dropped = self._session(request.session, context).abort(_client_id(request.client_id, "Abort"), request.sequence)
        return data_pb2.AbortResponse(dropped=dropped)

    @grpc_errors
    def Pull(self, request, context):
        start = time.perf_counter()
        session = self._session(request.session, context)
        if request.HasField("shared_memory"):  # the parameters go into the client's region
            region = self.regions.use(session, None, request.shared_memory)
            version, params = session.snapshot()
            sent = region.write_params(params)
            del params
            session.observer.sent(time.perf_counter() - start, sent)
            yield data_pb2.PullResponse(version=version)
            return
        dtype, chunk_bytes = _pull_options(request)
        version, params = session.snapshot()
        yield data_pb2.PullResponse(version=version)
        sent = 0
        for piece in _param_slices(session, params, dtype, chunk_bytes):
            sent += len(piece[-1])
            yield chunk_codec.encode_chunk_message(*piece)
        session.observer.sent(time.perf_counter() - start, sent)

    # ------------------------------------------------------------- same-host fast path
    @grpc_errors
    def OfferSharedMemory(self, request, context):
        offer, probe = self.regions.offer(self._session(request.session, context), request.client_id)
        return data_pb2.OfferSharedMemoryResponse(offer=offer, probe=probe)

    @grpc_errors
    def OpenSharedMemory(self, request, context):
        session = self._session(request.session, context)
        region = self.regions.open(session, request.client_id, request.offer, request.nonce)
        return data_pb2.OpenSharedMemoryResponse(region=self.regions.region_id(region), name=region.name,
                                                 size=region.layout.size,
                                                 tensor_names=[slot.name for slot in region.layout.push])

    @grpc_errors
    def CloseSharedMemory(self, request, context):
        dropped = self.regions.close(self._session(request.session, context), request.region)
        return data_pb2.CloseSharedMemoryResponse(dropped=dropped)

    @grpc_errors
    def PushPull(self, request_iterator, context):
        """Steps in any of the module's framings until the client ends the call (or the shard,
        when crowded, after a step's ``done``)."""
        stream = self._streams.open(context, self._tenant(context))
        ended_by_shard = False  # after a step's `stream_closing`: the client is alive and reopens
        try:
            while True:
                try:
                    first = next(request_iterator, None)
                except grpc.RpcError:  # the client closed the call after its last step (or it was ended idle)
                    return
                if first is None:
                    return
                if not self._streams.busy(stream):  # ended idle just now: the client hears CANCELLED
                    context.cancel()  # (not OK without `done`) and retries the step, which never ran here
                    return
                kind = first.WhichOneof("item")
                if kind == "goodbye":
                    stream.goodbye = True
                    return
                started = time.perf_counter()
                self._note_pusher(stream, first, context)
                if kind == "step":
                    closing = yield from self._one_message_step(first.step, context, started)
                elif kind == "header" and first.header.auto_commit:
                    closing = yield from self._streamed_step(first.header, request_iterator, context, started)
                elif kind == "header":
                    closing = yield from self._two_phase_step(first.header, request_iterator, context, started)
                else:
                    raise InvalidArgument("PushPull: each step must start with `header` or `step`")
                if closing is not False:  # True: crowded, the client reopens; None: the call ended mid-step
                    ended_by_shard = closing is True
                    return
                self._streams.idle(stream)
        except Exception:  # a refusal ends the call with its status: the shard ended it, not a client gone
            ended_by_shard = True
            raise
        finally:
            self._streams.close(stream)
            if stream.pushers and not stream.evicted and not stream.goodbye and not ended_by_shard:
                for (_, client_id), session in stream.pushers.items():  # the client vanished: see _note_pusher
                    session.disconnected(client_id)

    def _note_pusher(self, stream: _OpenStream, first, context) -> None:
        """Elastic sessions: remembers who pushes on this call, so that a call that ends without
        the client's ``goodbye`` (its process died) and not by this shard makes that worker leave
        at once (no lease to wait out)."""
        header = first.step.header if first.WhichOneof("item") == "step" else first.header
        if not header.session or not header.client_id:
            return
        noted = (header.session, header.client_id)
        if stream.noted == noted:  # a client's later steps on its call: already looked at
            return
        try:
            session = self._session(header.session, context)
        except OptservError:
            return  # the step itself reports it
        stream.noted = noted
        if session.config.is_elastic:
            stream.pushers[(id(session), header.client_id)] = session

    @grpc_errors
    def Membership(self, request, context):
        session = self._session(request.session, context)
        action = _MEMBERSHIP_ACTIONS.get(request.action)
        if action is None:
            raise InvalidArgument(f"Membership: action must be JOIN, RENEW or LEAVE, got {request.action}")
        version, members, lease_s = session.membership(_worker_id(request.worker_id), action)
        return data_pb2.MembershipResponse(version=version, members=members, lease_s=lease_s)

    @grpc_errors
    def History(self, request, context):
        records = self._session(request.session, context).history(request.since)
        return data_pb2.HistoryResponse(records=[r.to_proto() for r in records])

    # ------------------------------------------------------------- framings
    def _one_message_step(self, step: data_pb2.PushPullStep, context, started: float):
        if not step.header.auto_commit:
            raise InvalidArgument("PushPull `step`: header.auto_commit must be true (a one-message step "
                                  "commits with its peers; use header, chunks, seal for a decision)")
        session = self._session(step.header.session, context)
        if step.HasField("shared_memory"):  # the gradients are in the client's region, read once here
            if step.chunks:
                raise InvalidArgument("PushPull `step`: chunks and shared_memory are exclusive")
            read = _RegionRead(self.regions, session, step.header.client_id, step.shared_memory)
            receipt = session.push(_push_header(step.header), read.chunks(), context.is_active,
                                   wait_s=_wait_s(context, step.header), in_place=True)
            session.observer.pushed(time.perf_counter() - started)
            return (yield from self._answer_in_region(session, receipt, read.region, step.shared_memory.reply))
        framing = _OneMessagePush(step)
        receipt = session.push(_push_header(step.header), framing.chunks(), context.is_active,
                               wait_s=_wait_s(context, step.header))
        session.observer.pushed(time.perf_counter() - started)
        return (yield from self._answer(session, receipt, framing.reply, one_message=True))

    def _answer_in_region(self, session: ShardSession, receipt: Receipt, region, reply: bool):
        """A shared-memory step's answer: the parameters written once into the region (``reply``),
        then one ``step_result`` without chunks."""
        started = time.perf_counter()
        closing = self._streams.crowded()
        version = receipt.version
        if reply:
            version, params = session.snapshot()
            sent = region.write_params(params)
            del params  # as in _answer: a held view would stop the next update from donating
            session.observer.sent(time.perf_counter() - started, sent)
        done = data_pb2.StepDone(version=version, staleness=receipt.staleness, committed=True, stream_closing=closing)
        receipt.durable()  # `done` acknowledges the push: its step is in the step log first
        yield data_pb2.PushPullResponse(step_result=data_pb2.PushPullStepResult(done=done, in_shared_memory=reply))
        return closing

    def _streamed_step(self, header, request_iterator, context, started: float):
        session = self._session(header.session, context)
        framing = _StreamedPush(request_iterator)
        try:
            receipt = session.push(_push_header(header), framing.chunks(),
                                   lambda: framing.sealed and context.is_active(), wait_s=_wait_s(context, header))
        except Cancelled:
            return None
        session.observer.pushed(time.perf_counter() - started)
        return (yield from self._answer(session, receipt, framing.reply, one_message=False))

    def _two_phase_step(self, header, request_iterator, context, started: float):
        """The client decides after ``staged``: commit streams the parameters, abort drops the push."""
        session = self._session(header.session, context)
        framing = _StreamedPush(request_iterator)
        push = _push_header(header)
        try:
            staged = session.push(push, framing.chunks(), lambda: framing.sealed and context.is_active(),
                                  wait_s=context.time_remaining())
        except Cancelled:
            return None
        yield data_pb2.PushPullResponse(staged=_push_response(staged))
        decision = next(request_iterator, None)
        if decision is None or decision.WhichOneof("item") != "decision" or not decision.decision.commit:
            session.abort(push.client_id, push.sequence)
            if decision is None:
                return None
            closing = self._streams.crowded()
            yield data_pb2.PushPullResponse(
                done=data_pb2.StepDone(version=session.version, committed=False, stream_closing=closing))
            return closing
        receipt = session.commit(push.client_id, push.sequence, wait_s=context.time_remaining())
        session.observer.pushed(time.perf_counter() - started)
        return (yield from self._answer(session, receipt, framing.reply, one_message=False))

    def _answer(self, session: ShardSession, receipt: Receipt, reply: tuple[Optional[DType], int], one_message: bool):
        """The step's parameters and ``done`` in the ``reply`` options (:func:`_pull_options`, checked
        before the push): one ``step_result`` when ``one_message`` and they fit in one chunk, else
        chunks then ``done``. Returns whether the shard ends the call."""
        started = time.perf_counter()
        dtype, chunk_bytes = reply
        version, params = session.snapshot()
        closing = self._streams.crowded()
        done = data_pb2.StepDone(version=version, staleness=receipt.staleness, committed=True, stream_closing=closing)
        reply_bytes = sum(params[name].size * (dtype or spec.dtype).itemsize for name, spec in session.specs.items())
        if one_message and reply_bytes <= chunk_bytes:
            chunks = [_tensor_chunk(*piece) for piece in _param_slices(session, params, dtype, chunk_bytes)]
            # The snapshot's arrays are views of the shard's device buffers: held while the stream
            # waits for its next step, they would stop that step's update from donating (reusing)
            # those buffers, and JAX would allocate fresh ones.
            del params
            session.observer.sent(time.perf_counter() - started, reply_bytes)
            receipt.durable()  # `done` acknowledges the push: its step is in the step log first
            yield data_pb2.PushPullResponse(step_result=data_pb2.PushPullStepResult(done=done, chunks=chunks))
        else:
            for piece in _param_slices(session, params, dtype, chunk_bytes):
                yield chunk_codec.encode_chunk_message(*piece)
            del params
            session.observer.sent(time.perf_counter() - started, reply_bytes)
            receipt.durable()  # `done` acknowledges the push: its step is in the step log first
            yield data_pb2.PushPullResponse(done=done)
        return closing


class _OneMessagePush:
    """A one-message step's chunks, after its reply options (``pull``) are checked: inside the push,
    so bad options refuse it like a bad chunk (nothing applied, the session's other shards drop
    their parts) instead of failing after it was applied."""

    def __init__(self, step: data_pb2.PushPullStep):
        self._step = step
        self.reply: tuple[Optional[DType], int] = (None, contract.DEFAULT_CHUNK_BYTES)

    def chunks(self):
        self.reply = _pull_options(self._step.pull)
        yield from self._step.chunks


class _StreamedPush:
    """The chunks of a streamed push, up to its ``seal``; remembers the reply options (``pull``)
    sent with them, checked as they arrive: bad ones refuse the push before it is applied."""

    def __init__(self, request_iterator):
        self._requests = request_iterator
        self.reply = _pull_options(data_pb2.PullRequest())
        self.sealed = False

    def chunks(self):
        for request in self._requests:
            kind = request.WhichOneof("item")
            if kind == "chunk":
                yield request.chunk
            elif kind == "pull":
                self.reply = _pull_options(request.pull)
            elif kind == "seal":
                self.sealed = True
                return
            else:
                raise InvalidArgument(f"PushPull: unexpected `{kind}` before `seal`")


class _RegionRead:
    """A shared-memory step's gradients as the push's chunks: the region is looked up (session,
    client, nonce) inside the push, so a refused lookup is a refused push that the session's
    other shards hear of at once (their parts are dropped), as a bad chunk would be."""

    def __init__(self, regions: RegionTable, session: ShardSession, client_id: str, step: data_pb2.SharedMemoryStep):
        self._lookup = lambda: regions.use(session, client_id, step)
        self.region = None

    def chunks(self):
        self.region = self._lookup()
        yield from self.region.gradient_chunks()


class _ChunkRequest:
    """A request that holds one chunk, decoded without copying its bytes (:func:`add_to_server`).

    It answers what the servicer asks of a request: ``WhichOneof("item")`` and ``chunk``.
    """

    __slots__ = ("chunk",)

    def __init__(self, chunk: chunk_codec.ChunkView):
        self.chunk = chunk

    def WhichOneof(self, group: str) -> str:  # noqa: N802 - the protobuf method's name
        return "chunk"


def _request_decoder(message_type):
    """Deserializer: chunk requests as :class:`_ChunkRequest`, others as ``message_type``."""

    def decode(serialized: bytes):
        chunk = chunk_codec.split_chunk(serialized)
        return message_type.FromString(serialized) if chunk is None else _ChunkRequest(chunk)

    return safe_decoder(decode)


def add_to_server(registry: ShardRegistry, server: grpc.Server, max_open_streams: int = 16,
                  tokens: Optional[TokenTable] = None,
                  max_streams_per_tenant: Optional[int] = None) -> "ShardDataServicer":
    """Serves ShardData for ``registry`` on ``server`` with the copy-saving chunk codecs.

    Same service name, methods and wire format as ``data_pb2_grpc.add_ShardDataServicer_to_server``;
    chunk requests are read in place and chunk responses serialized by hand
    (:mod:`optserve.protos.chunk_codec`), sparing protobuf's copies of every tensor byte.
    ``max_open_streams``, ``tokens`` and ``max_streams_per_tenant``: see :class:`ShardDataServicer`.
    Returns the servicer (its ``regions``: the shared-memory regions it serves).
    """
    servicer = ShardDataServicer(registry, max_open_streams=max_open_streams, tokens=tokens,
                                 max_streams_per_tenant=max_streams_per_tenant)
    handlers = {
        "InitTensors": grpc.stream_unary_rpc_method_handler(
            servicer.InitTensors, request_deserializer=_request_decoder(data_pb2.InitTensorsRequest),
            response_serializer=data_pb2.InitTensorsResponse.SerializeToString),
        "Push": grpc.stream_unary_rpc_method_handler(
            servicer.Push, request_deserializer=_request_decoder(data_pb2.PushRequest),
            response_serializer=data_pb2.PushResponse.SerializeToString),
        "Commit": grpc.unary_unary_rpc_method_handler(
            servicer.Commit, request_deserializer=safe_decoder(data_pb2.CommitRequest.FromString),
            response_serializer=data_pb2.CommitResponse.SerializeToString),
        "Abort": grpc.unary_unary_rpc_method_handler(
            servicer.Abort, request_deserializer=safe_decoder(data_pb2.AbortRequest.FromString),
            response_serializer=data_pb2.AbortResponse.SerializeToString),
        "Pull": grpc.unary_stream_rpc_method_handler(
            servicer.Pull, request_deserializer=safe_decoder(data_pb2.PullRequest.FromString),
            response_serializer=chunk_codec.serialize),
        "PushPull": grpc.stream_stream_rpc_method_handler(
            servicer.PushPull, request_deserializer=_request_decoder(data_pb2.PushPullRequest),
            response_serializer=chunk_codec.serialize),
        **{method: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, method), request_deserializer=safe_decoder(getattr(data_pb2, f"{method}Request").FromString),
            response_serializer=getattr(data_pb2, f"{method}Response").SerializeToString)
           for method in ("OfferSharedMemory", "OpenSharedMemory", "CloseSharedMemory", "Membership", "History")},
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("optserve.v1.ShardData", handlers),))
    return servicer
