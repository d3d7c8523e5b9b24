"""Wire layer of a shard: the ShardData gRPC service (decode, validate, map errors).

Every method is a short paragraph over :class:`~optserve.server.shard_state.ShardSession`.
:func:`add_to_server` serves it with the chunk codecs of :mod:`optserve.protos.chunk_codec`
(same wire format, tensor bytes not copied by protobuf); the generated
``add_ShardDataServicer_to_server`` works too, with the generated classes' copies.
"""

from __future__ import annotations

import threading

import grpc
from typing import Iterator

from optserve.protos import chunk_codec
from optserve.protos.optserve.v1 import data_pb2, data_pb2_grpc, tensor_pb2
from optserve.server.assembly import iter_slices, wire_dtype
from optserve.server.errors import FailedPrecondition, InvalidArgument, NonFinite, NotFound, grpc_errors
from optserve.server.shard_state import ShardSession

DEFAULT_CHUNK_BYTES = 1 << 20  # as the SDK: a chunk copied while it is still in cache
_MIN_CHUNK, _MAX_CHUNK = 64 << 10, 64 << 20


class ShardRegistry:
    """The sessions one shard holds, by name (thread-safe)."""

    def __init__(self):
        self._sessions: dict[str, ShardSession] = {}
        self._lock = threading.Lock()

    def add(self, session: ShardSession) -> None:
        with self._lock:
            self._sessions[session.config.name] = session

    def remove(self, name: str) -> bool:
        with self._lock:
            return self._sessions.pop(name, None) is not None

    def get(self, name: str) -> ShardSession:
        with self._lock:
            session = self._sessions.get(name)
        if session is None:
            raise NotFound(f"session {name!r} not found on this shard")
        return session

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._sessions)


def _first(requests: Iterator, field: str, what: str):
    request = next(requests, None)
    if request is None or request.WhichOneof("item") != field:
        raise InvalidArgument(f"{what}: the first message must be `{field}`")
    return getattr(request, field)


def _pull_options(request: data_pb2.PullRequest):
    dtype = None if request.wire_dtype == tensor_pb2.DTYPE_UNSPECIFIED else wire_dtype(request.wire_dtype, what="pull wire_dtype")
    size = request.max_chunk_bytes or DEFAULT_CHUNK_BYTES
    return dtype, min(max(size, _MIN_CHUNK), _MAX_CHUNK)


def _param_chunks(session: ShardSession, params, dtype, chunk_bytes, encode):
    """The shard's parameters as chunk responses, each made by ``encode(name, dtype, shape, offset, data)``."""
    for name, spec in session.specs.items():
        wire = dtype or spec.dtype
        array = params[name]
        for offset, data in iter_slices(array, wire, chunk_bytes):
            yield encode(name, wire.value, array.shape, offset, data)


def _tensor_chunk(name, dtype, shape, offset, data) -> tensor_pb2.TensorChunk:
    return tensor_pb2.TensorChunk(name=name, dtype=dtype, shape=list(shape), offset=offset, data=bytes(data))


def _message_encoder(response_type):
    """Chunk -> ``response_type(chunk=TensorChunk(...))``, for the generated serializers."""

    def encode(name, dtype, shape, offset, data):
        return response_type(chunk=_tensor_chunk(name, dtype, shape, offset, data))

    return encode


def _receive_push(session: ShardSession, header, chunks: Iterator, context) -> bool:
    """Assembles and stages one push from ``chunks``; returns True if it was already applied.

    A stream that breaks or a chunk that fails validation stages nothing (and, with
    ``header.auto_commit``, tells the peer shards to drop their parts).
    """
    try:
        return _stage(session, header, chunks, context)
    except BaseException:
        if header.auto_commit:
            session.commit_with_peers(header.client_id, header.sequence, staged=False)
        raise


def _stage(session: ShardSession, header, chunks: Iterator, context) -> bool:
    if not header.client_id:
        raise InvalidArgument("push header: client_id must be non-empty")
    assembler, buffers = session.assembler_for_push()
    try:
        for chunk in chunks:
            assembler.add(chunk)
        grads = assembler.finish()
        # gRPC can report a cancelled client stream as a clean end of stream; a call that is
        # no longer active was broken, even if its chunks happened to be complete.
        if not context.is_active():
            raise FailedPrecondition(f"push {header.sequence} from client {header.client_id!r}: the call was cancelled")
    except NonFinite:
        session.release_buffers(buffers)
        session.count_rejection("nonfinite")
        raise
    except InvalidArgument:
        session.release_buffers(buffers)
        session.count_rejection("invalid")
        raise
    except BaseException:
        session.release_buffers(buffers)
        session.count_rejection("aborted")
        raise
    if session.already_applied(header.client_id, header.sequence):
        session.release_buffers(buffers)
        return True
    session.stage(header.client_id, header.sequence, header.base_version, grads)
    return False


class _StreamCount:
    """Open PushPull calls; each holds a server thread for as long as it stays open."""

    def __init__(self, limit: int):
        self.limit = limit
        self._open = 0
        self._lock = threading.Lock()

    def __enter__(self):
        with self._lock:
            self._open += 1
        return self

    def __exit__(self, *exc):
        with self._lock:
            self._open -= 1

    def crowded(self) -> bool:
        return self._open > self.limit


class ShardDataServicer(data_pb2_grpc.ShardDataServicer):
    """ShardData on one shard actor.

    ``raw_chunks``: yield chunk responses as pre-serialized messages (bytes); only for the
    serializers of :func:`add_to_server`.
    ``max_open_streams``: PushPull calls past this many end after their current step
    (``StepDone.stream_closing``), so idle streams never take all the server's threads.
    """

    def __init__(self, registry: ShardRegistry, raw_chunks: bool = False, max_open_streams: int = 16):
        self._registry = registry
        self._streams = _StreamCount(max_open_streams)
        raw = chunk_codec.encode_chunk_message
        self._pull_chunk = raw if raw_chunks else _message_encoder(data_pb2.PullResponse)
        self._push_pull_chunk = raw if raw_chunks else _message_encoder(data_pb2.PushPullResponse)

    @grpc_errors
    def InitTensors(self, request_iterator, context):
        session = self._registry.get(_first(request_iterator, "session", "InitTensors"))
        if session.initialized:
            raise FailedPrecondition(f"session {session.config.name!r}: parameters are already initialized")
        assembler = session.assembler_for_init()
        for request in request_iterator:
            assembler.add(request.chunk)
        return data_pb2.InitTensorsResponse(version=session.initialize(assembler.finish()))

    @grpc_errors
    def Push(self, request_iterator, context):
        header = _first(request_iterator, "header", "Push")
        session = self._registry.get(header.session)
        done = _receive_push(session, header, (r.chunk for r in request_iterator), context)
        if not header.auto_commit:
            return data_pb2.PushResponse(already_applied=done, version=session.version)
        ticket = session.commit_with_peers(header.client_id, header.sequence, staged=True)
        return data_pb2.PushResponse(already_applied=done, version=ticket.target_version, committed=True,
                                     staleness=ticket.staleness)

    @grpc_errors
    def Commit(self, request, context):
        ticket = self._registry.get(request.session).commit(request.client_id, request.sequence)
        return data_pb2.CommitResponse(version=ticket.target_version, staleness=ticket.staleness, scale=ticket.scale)

    @grpc_errors
    def Abort(self, request, context):
        return data_pb2.AbortResponse(dropped=self._registry.get(request.session).abort(request.client_id, request.sequence))

    @grpc_errors
    def Pull(self, request, context):
        session = self._registry.get(request.session)
        dtype, chunk_bytes = _pull_options(request)
        version, params = session.snapshot()
        yield data_pb2.PullResponse(version=version)
        yield from _param_chunks(session, params, dtype, chunk_bytes, self._pull_chunk)

    @grpc_errors
    def PushPull(self, request_iterator, context):
        """Per step: header, [pull], chunks, seal -> staged; decision -> chunks, done (or one
        ``step`` -> one ``step_result``). Steps repeat until the client ends the stream (or the
        shard, when crowded, after a step's ``done``)."""
        with self._streams:
            yield from self._push_pull_steps(request_iterator, context)

    def _push_pull_steps(self, request_iterator, context):
        while True:
            try:
                first = next(request_iterator, None)
            except grpc.RpcError:  # the client closed the call after its last step
                return
            if first is None:
                return
            kind = first.WhichOneof("item")
            if kind == "step":
                closing = yield from self._one_message_step(first.step, context)
            elif kind == "header":
                closing = yield from self._streamed_step(first.header, request_iterator, context)
            else:
                raise InvalidArgument("PushPull: each step must start with `header` or `step`")
            if closing is not False:  # True: crowded, the client reopens; None: the call ended mid-step
                return

    def _streamed_step(self, header, request_iterator, context):
        """header, [pull], chunks, seal -> [staged, decision] -> chunks, done. Returns whether the
        shard ends the call after this step, or None if the call ended during it."""
        session = self._registry.get(header.session)
        pull = data_pb2.PullRequest()
        sealed = threading.Event()

        def chunks():
            nonlocal pull
            for request in request_iterator:
                kind = request.WhichOneof("item")
                if kind == "chunk":
                    yield request.chunk
                elif kind == "pull":
                    pull = request.pull
                elif kind == "seal":
                    sealed.set()
                    return
                else:
                    raise InvalidArgument(f"PushPull: unexpected `{kind}` before `seal`")

        done = _receive_push(session, header, chunks(), context)
        if not sealed.is_set():  # the stream ended before `seal`: a broken push
            if header.auto_commit:
                session.commit_with_peers(header.client_id, header.sequence, staged=False)
            session.abort(header.client_id, header.sequence)
            return None
        if header.auto_commit:
            ticket = session.commit_with_peers(header.client_id, header.sequence, staged=True)
        else:
            yield data_pb2.PushPullResponse(
                staged=data_pb2.PushResponse(already_applied=done, version=session.version))
            decision = next(request_iterator, None)
            if decision is None or decision.WhichOneof("item") != "decision" or not decision.decision.commit:
                session.abort(header.client_id, header.sequence)
                if decision is None:
                    return None
                closing = self._streams.crowded()
                yield data_pb2.PushPullResponse(
                    done=data_pb2.StepDone(version=session.version, committed=False, stream_closing=closing))
                return closing
            ticket = session.commit(header.client_id, header.sequence)
        dtype, chunk_bytes = _pull_options(pull)
        version, params = session.snapshot()
        yield from _param_chunks(session, params, dtype, chunk_bytes, self._push_pull_chunk)
        # The snapshot's arrays are views of the shard's device buffers: held while the stream
        # waits for its next step, they would stop that step's update from donating (reusing)
        # those buffers, and JAX would allocate fresh ones (page faults: ~35 ms per 64 MB).
        del params
        closing = self._streams.crowded()
        yield data_pb2.PushPullResponse(
            done=data_pb2.StepDone(version=version, staleness=ticket.staleness, committed=True,
                                   stream_closing=closing))
        return closing

    def _one_message_step(self, step: data_pb2.PushPullStep, context):
        """A `step` message: stage, commit with the peers, answer with one `step_result` if the
        parameters fit in one chunk (else chunks, done). Returns whether the call ends after it."""
        header = step.header
        if not header.auto_commit:
            raise InvalidArgument("PushPull `step`: header.auto_commit must be true (a one-message step "
                                  "commits with its peers; use header, chunks, seal for a decision)")
        session = self._registry.get(header.session)
        _receive_push(session, header, iter(step.chunks), context)
        ticket = session.commit_with_peers(header.client_id, header.sequence, staged=True)
        dtype, chunk_bytes = _pull_options(step.pull)
        version, params = session.snapshot()
        closing = self._streams.crowded()
        done = data_pb2.StepDone(version=version, staleness=ticket.staleness, committed=True, stream_closing=closing)
        reply_bytes = sum(params[name].size * (dtype or spec.dtype).itemsize for name, spec in session.specs.items())
        if reply_bytes <= chunk_bytes:
            chunks = list(_param_chunks(session, params, dtype, chunk_bytes, _tensor_chunk))
            del params  # see _streamed_step: no views may outlive the step
            yield data_pb2.PushPullResponse(step_result=data_pb2.PushPullStepResult(done=done, chunks=chunks))
        else:
            yield from _param_chunks(session, params, dtype, chunk_bytes, self._push_pull_chunk)
            del params
            yield data_pb2.PushPullResponse(done=done)
        return closing


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

    return decode


def add_to_server(registry: ShardRegistry, server: grpc.Server, max_open_streams: int = 16) -> None:
    """Serves ShardData for ``registry`` on ``server`` with the copy-saving chunk codecs.

    Same service name, methods and wire format as ``data_pb2_grpc.add_ShardDataServicer_to_server``;
    chunk requests are read in place and chunk responses serialized by hand
    (:mod:`optserve.protos.chunk_codec`), sparing protobuf's copies of every tensor byte.
    ``max_open_streams``: see :class:`ShardDataServicer` (keep it below the server's threads).
    """
    servicer = ShardDataServicer(registry, raw_chunks=True, max_open_streams=max_open_streams)
    handlers = {
        "InitTensors": grpc.stream_unary_rpc_method_handler(
            servicer.InitTensors, request_deserializer=_request_decoder(data_pb2.InitTensorsRequest),
            response_serializer=data_pb2.InitTensorsResponse.SerializeToString),
        "Push": grpc.stream_unary_rpc_method_handler(
            servicer.Push, request_deserializer=_request_decoder(data_pb2.PushRequest),
            response_serializer=data_pb2.PushResponse.SerializeToString),
        "Commit": grpc.unary_unary_rpc_method_handler(
            servicer.Commit, request_deserializer=data_pb2.CommitRequest.FromString,
            response_serializer=data_pb2.CommitResponse.SerializeToString),
        "Abort": grpc.unary_unary_rpc_method_handler(
            servicer.Abort, request_deserializer=data_pb2.AbortRequest.FromString,
            response_serializer=data_pb2.AbortResponse.SerializeToString),
        "Pull": grpc.unary_stream_rpc_method_handler(
            servicer.Pull, request_deserializer=data_pb2.PullRequest.FromString,
            response_serializer=chunk_codec.serialize),
        "PushPull": grpc.stream_stream_rpc_method_handler(
            servicer.PushPull, request_deserializer=_request_decoder(data_pb2.PushPullRequest),
            response_serializer=chunk_codec.serialize),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("optserve.v1.ShardData", handlers),))
