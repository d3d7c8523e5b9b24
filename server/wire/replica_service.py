"""The standby's end of ``ShardReplica`` (``replica.proto``): one stream from a primary shard's
process, whose messages go to the standby's followers in the order they came.

Each whole message (:mod:`~optserve.server.wire.replica_frames`) is handed to its session's
:class:`~optserve.server.domain.shard.replica.StandbyFollower` off the event loop, one at a time,
and answered: the last version the follower holds once a start or a step is held, the sequence of
clock entries once booked, or, when the follower cannot take it (a gap, a session it does not
follow, a start that is not the session's state), the reason, after which that session's follower
holds nothing more (the others go on). A frame that does not decode or does not fit where it came
ends the stream INVALID_ARGUMENT: nothing after a damaged frame can be trusted.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor
from typing import Callable

import grpc

from optserve.protos.optserve.v1 import replica_pb2
from optserve.server.domain.errors import OptservError, Unavailable
from optserve.server.domain.shard import StandbyFollower
from optserve.server.wire.errors import Malformed, safe_decoder
from optserve.server.wire.replica_frames import ClockMessage, FrameAssembler, Message, StartMessage, StepMessage

_log = logging.getLogger(__name__)
SERVICE = "optserve.v1.ShardReplica"


class ReplicaServicer:
    """Serves ``ShardReplica.Follow`` and ``ShardReplica.Probe``.

    Args:
      followers: ``session -> StandbyFollower`` of the sessions this process is a standby for
        (raises an :class:`OptservError`, such as NotFound, for another).
      pool: where messages are handed to followers (a start installs a whole state).
      out_of_sync: ``() -> session names``: this process's primary parts whose standby holds
        nothing more (what a probe answers).
    """

    def __init__(self, followers: Callable[[str], StandbyFollower], pool: Executor,
                 out_of_sync: Callable[[], list] = list):
        self._followers = followers
        self._pool = pool
        self._out_of_sync = out_of_sync

    async def Probe(self, request, context) -> replica_pb2.ProbeAnswer:
        return replica_pb2.ProbeAnswer(out_of_sync=self._out_of_sync())

    async def Follow(self, frames, context):
        assembler = FrameAssembler()
        loop = asyncio.get_running_loop()
        async for frame in frames:
            if isinstance(frame, Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"ShardReplica.Follow: a frame did not "
                                                                      f"decode ({frame.reason})")
            try:
                message = assembler.add(frame)
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"ShardReplica.Follow: {exc}")
            if message is not None:
                yield await loop.run_in_executor(self._pool, self._deliver, message)

    def _deliver(self, message: Message) -> replica_pb2.ReplicaAnswer:
        """Hands ``message`` to its follower; the answer to send back."""
        sequence = message.sequence if isinstance(message, ClockMessage) else 0
        follower = None
        try:
            follower = self._followers(message.session)
            if isinstance(message, StartMessage):
                follower.start(message.start)
            elif isinstance(message, StepMessage):
                follower.receive(message.record, message.grads, message.roots, message.digest)
            else:
                follower.clock_entries(message.entries)
        except Exception as exc:  # noqa: BLE001 - answered: the primary stops counting on this standby
            error = exc if isinstance(exc, OptservError) else Unavailable(
                f"session {message.session!r}: the standby failed taking a message: {exc!r}")
            if follower is not None and not isinstance(exc, OptservError):
                follower.close()  # its state may be half changed: it must never be promoted
            _log.warning("event=standby_refused session=%s error=%s", message.session, error)
            return replica_pb2.ReplicaAnswer(session=message.session, clock_sequence=sequence, error=str(error) or
                                             type(error).__name__)
        return replica_pb2.ReplicaAnswer(session=message.session, held_version=follower.held.held,
                                         clock_sequence=sequence)


def add_replica_service(server, servicer: ReplicaServicer) -> None:
    """Serves ``servicer`` on ``server`` (a :class:`~optserve.server.wire.loop_server.LoopServer`)."""
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.Follow, request_deserializer=safe_decoder(replica_pb2.ReplicaFrame.FromString),
        response_serializer=replica_pb2.ReplicaAnswer.SerializeToString)
    probe = grpc.unary_unary_rpc_method_handler(
        servicer.Probe, request_deserializer=safe_decoder(replica_pb2.ProbeRequest.FromString),
        response_serializer=replica_pb2.ProbeAnswer.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Follow": handler,
                                                                                     "Probe": probe}),))
