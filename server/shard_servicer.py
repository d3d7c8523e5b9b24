"""Wire layer of a shard: the ShardData gRPC service (decode, validate, map errors).

Every method is a short paragraph over :class:`~optserve.server.shard_state.ShardSession`.
"""

from __future__ import annotations

import threading

import grpc
from typing import Iterator

from optserve.protos.optserve.v1 import data_pb2, data_pb2_grpc, tensor_pb2
from optserve.server.assembly import iter_chunks, wire_dtype
from optserve.server.errors import FailedPrecondition, InvalidArgument, NonFinite, NotFound, grpc_errors
from optserve.server.shard_state import ShardSession

DEFAULT_CHUNK_BYTES = 4 << 20
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


def _param_chunks(session: ShardSession, params, dtype, chunk_bytes):
    for name, spec in session.specs.items():
        yield from iter_chunks(name, params[name], dtype or spec.dtype, chunk_bytes, tensor_pb2.TensorChunk)


def _receive_push(session: ShardSession, header, chunks: Iterator) -> bool:
    """Assembles and stages one push from ``chunks``; returns True if it was already applied.

    A stream that breaks or a chunk that fails validation stages nothing (and, with
    ``header.auto_commit``, tells the peer shards to drop their parts).
    """
    try:
        return _stage(session, header, chunks)
    except BaseException:
        if header.auto_commit:
            session.commit_with_peers(header.client_id, header.sequence, staged=False)
        raise


def _stage(session: ShardSession, header, chunks: Iterator) -> bool:
    if not header.client_id:
        raise InvalidArgument("push header: client_id must be non-empty")
    assembler, buffers = session.assembler_for_push()
    try:
        for chunk in chunks:
            assembler.add(chunk)
        grads = assembler.finish()
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


class ShardDataServicer(data_pb2_grpc.ShardDataServicer):
    """ShardData on one shard actor."""

    def __init__(self, registry: ShardRegistry):
        self._registry = registry

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
        done = _receive_push(session, header, (r.chunk for r in request_iterator))
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
        for chunk in _param_chunks(session, params, dtype, chunk_bytes):
            yield data_pb2.PullResponse(chunk=chunk)

    @grpc_errors
    def PushPull(self, request_iterator, context):
        """Per step: header, [pull], chunks, seal -> staged; decision -> chunks, done."""
        while True:
            try:
                first = next(request_iterator, None)
            except grpc.RpcError:  # the client closed the call after its last step
                return
            if first is None:
                return
            if first.WhichOneof("item") != "header":
                raise InvalidArgument("PushPull: each step must start with `header`")
            header = first.header
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

            done = _receive_push(session, header, chunks())
            if not sealed.is_set():  # the stream ended before `seal`: a broken push
                if header.auto_commit:
                    session.commit_with_peers(header.client_id, header.sequence, staged=False)
                session.abort(header.client_id, header.sequence)
                return
            if header.auto_commit:
                ticket = session.commit_with_peers(header.client_id, header.sequence, staged=True)
            else:
                yield data_pb2.PushPullResponse(
                    staged=data_pb2.PushResponse(already_applied=done, version=session.version))
                decision = next(request_iterator, None)
                if decision is None or decision.WhichOneof("item") != "decision" or not decision.decision.commit:
                    session.abort(header.client_id, header.sequence)
                    if decision is None:
                        return
                    yield data_pb2.PushPullResponse(done=data_pb2.StepDone(version=session.version, committed=False))
                    continue
                ticket = session.commit(header.client_id, header.sequence)
            dtype, chunk_bytes = _pull_options(pull)
            version, params = session.snapshot()
            for chunk in _param_chunks(session, params, dtype, chunk_bytes):
                yield data_pb2.PushPullResponse(chunk=chunk)
            yield data_pb2.PushPullResponse(
                done=data_pb2.StepDone(version=version, staleness=ticket.staleness, committed=True))
