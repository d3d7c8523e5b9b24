"""Wire layer of a shard: the ShardData gRPC service.

Each method decodes its request (:mod:`~optserve.server.wire.data_requests`), makes one call on
the session's :class:`~optserve.server.domain.shard.shard_session.ShardSession` and encodes the answer
(:mod:`~optserve.server.wire.data_replies`); the domain error table
(:mod:`optserve.server.wire.errors`) turns refusals into statuses. ``PushPull``, the training
step's stream, is served by :mod:`~optserve.server.wire.push_pull`; the same-host shared-memory
regions by :mod:`~optserve.server.wire.shared_memory`. Chunks are read in place and written once
(:mod:`optserve.protos.chunk_codec`, served by :func:`add_to_server`).
"""

from __future__ import annotations

import time
from concurrent.futures import Executor
from typing import Optional

import grpc

from optserve.protos import chunk_codec
from optserve.protos.optserve.v1 import data_pb2, data_pb2_grpc
from optserve.server.domain.errors import InvalidArgument
from optserve.server.domain.shard import ShardRegistry, ShardSession
from optserve.server.wire import data_requests
from optserve.server.wire.data_replies import pull_chunks, pull_into_region, push_response, state_replies
from optserve.server.wire.errors import grpc_errors, safe_decoder
from optserve.server.wire.loop_server import LoopServer
from optserve.server.wire.open_streams import OpenStreams
from optserve.server.wire.push_pull import PushPullCalls
from optserve.server.wire.security import TokenTable
from optserve.server.wire.shared_memory import RegionTable


class ShardDataServicer(data_pb2_grpc.ShardDataServicer):
    """ShardData on one shard actor (serve it with :func:`add_to_server`).

    ``pool``: the server's thread pool, where PushPull's steps run between their waits.
    ``max_open_streams``: PushPull calls past this many end after their current step
    (``StepDone.stream_closing``) and idle ones end at once (:class:`~optserve.server.wire.open_streams.OpenStreams`).
    ``tokens``: the server's tenant tokens (None: no tenants); a call reaches only its tenant's
    sessions (the interceptor already refused calls without a valid token).
    ``max_streams_per_tenant``: PushPull calls one tenant may hold open here (None: no bound);
    one more is RESOURCE_EXHAUSTED naming the limit.
    """

    def __init__(self, registry: ShardRegistry, pool: Executor, max_open_streams: int = 16,
                 tokens: Optional[TokenTable] = None, max_streams_per_tenant: Optional[int] = None):
        self._registry = registry
        self._pool = pool
        self._tokens = tokens
        self.regions = RegionTable(registry)  # same-host fast path (server/wire/shared_memory.py)
        self._push_pull = PushPullCalls(self._session, self._tenant, self.regions,
                                        OpenStreams(max_open_streams, max_per_tenant=max_streams_per_tenant))

    def _tenant(self, context) -> str:
        return self._tokens.tenant(context) if self._tokens is not None else ""

    def _session(self, name: str, context) -> ShardSession:
        return self._registry.get(name, self._tenant(context))

    @grpc_errors
    def InitTensors(self, request_iterator, context):
        first = data_requests.first_message(request_iterator, "session", "InitTensors")
        session = self._session(first.session, context)
        start = data_requests.start_state(first)
        values, states = data_requests.init_items(request_iterator, with_state=start is not None)
        if first.HasField("shared_memory"):  # the values lie in the creating client's region
            session.check_creator(first.client_id)  # before anything is read
            region = self.regions.use(session, None, first.shared_memory)
            if next(values, None) is not None:
                raise InvalidArgument("InitTensors: chunks and shared_memory are exclusive")
            version = session.initialize(region.parameter_chunks(), first.client_id, in_place=True, start=start,
                                         state_chunks=states)
        else:
            version = session.initialize(values, first.client_id, start=start, state_chunks=states)
        return data_pb2.InitTensorsResponse(version=version)

    @grpc_errors
    def ExportState(self, request, context):
        saved = self._session(request.session, context).export_state()
        yield from state_replies(saved, data_requests.chunk_bytes(request.max_chunk_bytes))

    @grpc_errors
    def Push(self, request_iterator, context):
        start = time.perf_counter()
        header = data_requests.first_message(request_iterator, "header", "Push").header
        session = self._session(header.session, context)
        receipt = session.push(data_requests.push_header(header), (r.chunk for r in request_iterator),
                               context.is_active, wait_s=data_requests.wait_s(context, header))
        session.observer.pushed(time.perf_counter() - start)
        receipt.durable()  # the answer acknowledges the push: its step is in the step log first
        return push_response(receipt)

    @grpc_errors
    def Commit(self, request, context):
        session = self._session(request.session, context)
        receipt = session.commit(data_requests.client_id(request.client_id, "Commit"), request.sequence,
                                 wait_s=context.time_remaining())
        receipt.durable()
        return data_pb2.CommitResponse(version=receipt.version, staleness=receipt.staleness, scale=receipt.scale)

    @grpc_errors
    def Abort(self, request, context):
        session = self._session(request.session, context)
        dropped = session.abort(data_requests.client_id(request.client_id, "Abort"), request.sequence)
        return data_pb2.AbortResponse(dropped=dropped)

    @grpc_errors
    def Pull(self, request, context):
        start = time.perf_counter()
        session = self._session(request.session, context)
        if request.HasField("shared_memory"):  # the parameters go into the client's region
            region = self.regions.use(session, None, request.shared_memory)
            yield from pull_into_region(session, region, start, request.evaluation)
            return
        dtype, chunk_bytes = data_requests.pull_options(request)
        yield from pull_chunks(session, dtype, chunk_bytes, start, request.evaluation)

    async def PushPull(self, request_iterator, context):
        """Training steps on one open call (see :mod:`~optserve.server.wire.push_pull`): served on
        the server's event loop, each step run in its thread pool."""
        async for answer in self._push_pull.serve(context, self._pool):
            yield answer

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

    # ------------------------------------------------------------- elastic membership (home shard)
    @grpc_errors
    def Membership(self, request, context):
        session = self._session(request.session, context)
        action = data_requests.membership_action(request.action)
        version, members, lease_s = session.home.membership(data_requests.worker_id(request.worker_id), action)
        return data_pb2.MembershipResponse(version=version, members=members, lease_s=lease_s)

    @grpc_errors
    def History(self, request, context):
        home = self._session(request.session, context).home
        changes = home.hyperparam_history(request.since)
        return data_pb2.HistoryResponse(
            records=[r.to_proto() for r in home.history(request.since)],
            hyperparams=[data_pb2.HyperparamChange(version=c.version, group=group, values=values)
                         for c in changes for group, values in sorted(c.values.items())])

    @grpc_errors
    def SetHyperparams(self, request, context):
        home = self._session(request.session, context).home
        version, changed = home.set_hyperparams(dict(request.values), request.group or None)
        return data_pb2.SetHyperparamsResponse(version=version, changed=changed)


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


def add_to_server(registry: ShardRegistry, server: LoopServer, max_open_streams: int = 16,
                  tokens: Optional[TokenTable] = None,
                  max_streams_per_tenant: Optional[int] = None,
                  step_pool: Optional[Executor] = None) -> "ShardDataServicer":
    """Serves ShardData for ``registry`` on ``server`` with the copy-saving chunk codecs.

    Same service name, methods and wire format as ``data_pb2_grpc.add_ShardDataServicer_to_server``;
    chunk requests are read in place and chunk responses serialized by hand
    (:mod:`optserve.protos.chunk_codec`), sparing protobuf's copies of every tensor byte.
    ``max_open_streams``, ``tokens`` and ``max_streams_per_tenant``: see :class:`ShardDataServicer`.
    ``step_pool``: where PushPull's steps run between their waits (default: the server's pool, where
    the unary calls run; a pool of their own keeps a unary call, such as an elastic worker's lease
    renewal, from queueing behind the steps). Returns the servicer (its ``regions``: the
    shared-memory regions it serves).
    """
    pool = server.thread_pool if step_pool is None else step_pool
    servicer = ShardDataServicer(registry, pool, max_open_streams=max_open_streams, tokens=tokens,
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
        "ExportState": grpc.unary_stream_rpc_method_handler(
            servicer.ExportState, request_deserializer=safe_decoder(data_pb2.ExportStateRequest.FromString),
            response_serializer=data_pb2.ExportStateResponse.SerializeToString),
        "PushPull": grpc.stream_stream_rpc_method_handler(
            servicer.PushPull, request_deserializer=_request_decoder(data_pb2.PushPullRequest),
            response_serializer=chunk_codec.serialize),
        **{method: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, method), request_deserializer=safe_decoder(getattr(data_pb2, f"{method}Request").FromString),
            response_serializer=getattr(data_pb2, f"{method}Response").SerializeToString)
           for method in ("OfferSharedMemory", "OpenSharedMemory", "CloseSharedMemory", "Membership", "History",
                          "SetHyperparams")},
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("optserve.v1.ShardData", handlers),))
    return servicer
