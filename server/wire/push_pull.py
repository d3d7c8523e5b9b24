"""The PushPull call of ShardData: steps on one open stream, each a push and the parameters back.

Step framings (repeated until the client ends the call):

* one message: ``step`` -> ``step_result`` (or chunks, ``done`` when the parameters exceed one chunk);
  with ``shared_memory`` the gradients are read from, and the parameters written into, the
  client's region, and ``step_result`` carries no chunks;
* streamed: ``header``, [``pull``], chunks, ``seal`` -> chunks, ``done``;
* two-phase (``header.auto_commit`` false): ... ``seal`` -> ``staged``; ``decision`` -> chunks,
  ``done`` (commit) or ``done`` (abort). The SDK never uses it; ``Commit`` / ``Abort`` are the
  same decision as unary calls after a ``Push``.

``done`` (or ``step_result``) acknowledges the push, so it is sent only once the step is in the
step log (``Receipt.durable``). A call that ends without the client's ``goodbye``, and not by this
shard, means the client process is gone: its workers leave their elastic sessions at once.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from typing import Callable, Optional

import grpc

from optserve.protos import chunk_codec
from optserve.protos.optserve.v1 import data_pb2
from optserve.server.domain.config import DType
from optserve.server.domain.errors import Cancelled, InvalidArgument, OptservError
from optserve.server.domain.shard import Receipt, ShardSession
from optserve.server.domain.waits import next_of
from optserve.server.wire import data_requests
from optserve.server.wire.data_replies import param_slices, push_response, tensor_chunk
from optserve.server.wire.errors import abort_call, checked_message, checked_messages
from optserve.server.wire.loop_calls import Answered, CallEnded, LoopCallContext, LoopRequests, PoolRuns, Returned
from optserve.server.wire.open_streams import OpenStream, OpenStreams
from optserve.server.wire.push_framings import OneMessagePush, RegionRead, StreamedPush
from optserve.server.wire.shared_memory import RegionTable, reply_into


class PushPullCalls:
    """Serves PushPull calls (the servicer's ``PushPull`` hands each call to :meth:`serve`).

    Args:
      session_for: ``(session name, context) -> ShardSession`` (the caller's tenant checked).
      tenant_of: ``context -> tenant`` ("" without tenants).
      regions: the shared-memory regions the shard serves.
      streams: the table of open calls (bounds them, see :class:`OpenStreams`).
    """

    def __init__(self, session_for: Callable[[str, object], ShardSession], tenant_of: Callable[[object], str],
                 regions: RegionTable, streams: OpenStreams):
        self._session = session_for
        self._tenant = tenant_of
        self._regions = regions
        self._streams = streams

    async def serve(self, context: grpc.aio.ServicerContext, pool: Executor):
        """Steps in any of the module's framings until the client ends the call (or the shard,
        when crowded, after a step's ``done``). The call waits for each step's first message on
        the event loop, holding no thread; the step runs in ``pool``."""
        loop = asyncio.get_running_loop()
        call = LoopCallContext(context, loop)
        try:
            stream = self._streams.open(call, self._tenant(call))
        except Exception as exc:  # noqa: BLE001 - over a limit: refused with its status
            await abort_call(context, exc, "ShardData/PushPull")
            return
        ended_by_shard = False  # after a step's `stream_closing`: the client is alive and reopens
        steps = PoolRuns(pool)
        try:
            while True:
                try:
                    first = await call.read()
                except CallEnded:
                    if call.cancelled:  # ended idle (OpenStreams): the client hears CANCELLED
                        break  # (not OK without `done`) and retries the step, which never ran here
                    return  # the client closed the call after its last step (or it timed out)
                if first is None:
                    return
                first = checked_message(first, "PushPull")
                if not self._streams.busy(stream):  # ended idle just now: as above
                    break
                if first.WhichOneof("item") == "goodbye":
                    stream.goodbye = True
                    return
                closing = None
                requests = checked_messages(LoopRequests(call, loop, _more_follows), "PushPull")  # the step's further messages
                async for item in steps.run(self._step(stream, first, requests, call)):
                    if isinstance(item, Returned):
                        closing = item.value
                    else:
                        yield item
                if closing is not False:  # True: crowded, the client reopens; None: the call ended mid-step
                    ended_by_shard = closing is True
                    return
                self._streams.idle(stream)
            ended_by_shard = True
            await context.abort(grpc.StatusCode.CANCELLED, "the shard ended this idle call (crowded); "
                                                           "the next step goes on a new call")
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - a refusal ends the call with its status: the shard
            ended_by_shard = not context.done()  # ended it, unless the call broke first (client gone)
            await abort_call(context, exc, "ShardData/PushPull")
        finally:
            steps.after(lambda: self._ended(stream, ended_by_shard))

    def _ended(self, stream: OpenStream, ended_by_shard: bool) -> None:
        """The call ended (and its last step with it)."""
        self._streams.close(stream)
        if stream.pushers and not stream.evicted and not stream.goodbye and not ended_by_shard:
            for (_, client_id), session in stream.pushers.items():  # the client vanished: see _note_pusher
                session.home.disconnected(client_id)

    def _step(self, stream: OpenStream, first, request_iterator, context):
        """One step, in the framing its first message starts; returns its last answer with whether
        the shard ends the call (:class:`Answered`), or None (the call ended mid-step)."""
        started = time.perf_counter()
        self._note_pusher(stream, first, context)
        kind = first.WhichOneof("item")
        if kind == "step":
            return (yield from self._one_message_step(first.step, context, started))
        if kind == "header" and first.header.auto_commit:
            return (yield from self._streamed_step(first.header, request_iterator, context, started))
        if kind == "header":
            return (yield from self._two_phase_step(first.header, request_iterator, context, started))
        raise InvalidArgument("PushPull: each step must start with `header` or `step`")

    def _note_pusher(self, stream: OpenStream, first, context) -> None:
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

    # ------------------------------------------------------------- framings
    def _one_message_step(self, step: data_pb2.PushPullStep, context, started: float):
        if not step.header.auto_commit:
            raise InvalidArgument("PushPull `step`: header.auto_commit must be true (a one-message step "
                                  "commits with its peers; use header, chunks, seal for a decision)")
        session = self._session(step.header.session, context)
        if step.HasField("shared_memory"):  # the gradients are in the client's region, read once here
            if step.chunks:
                raise InvalidArgument("PushPull `step`: chunks and shared_memory are exclusive")
            read = RegionRead(self._regions, session, step.header.client_id, step.shared_memory)
            try:
                receipt = yield from session.push_steps(data_requests.push_header(step.header), read.chunks(),
                                                        context.is_active,
                                                        wait_s=data_requests.wait_s(context, step.header), in_place=True)
            finally:
                read.done()
            session.observer.pushed(time.perf_counter() - started)
            return (yield from self._answer_in_region(session, receipt, read.region, step.shared_memory.reply))
        framing = OneMessagePush(step)
        receipt = yield from session.push_steps(data_requests.push_header(step.header), framing.chunks(),
                                                context.is_active, wait_s=data_requests.wait_s(context, step.header))
        session.observer.pushed(time.perf_counter() - started)
        return (yield from self._answer(session, receipt, framing.reply, one_message=True,
                                        sparse_base=_sparse_base(framing, step.header)))

    def _streamed_step(self, header, request_iterator, context, started: float):
        session = self._session(header.session, context)
        framing = StreamedPush(request_iterator)
        try:
            receipt = yield from session.push_steps(data_requests.push_header(header), framing.chunks(),
                                                    lambda: framing.sealed and context.is_active(),
                                                    wait_s=data_requests.wait_s(context, header))
        except Cancelled:
            return None
        session.observer.pushed(time.perf_counter() - started)
        return (yield from self._answer(session, receipt, framing.reply, one_message=False,
                                        sparse_base=_sparse_base(framing, header)))

    def _two_phase_step(self, header, request_iterator, context, started: float):
        """The client decides after ``staged``: commit streams the parameters, abort drops the push."""
        session = self._session(header.session, context)
        framing = StreamedPush(request_iterator)
        push = data_requests.push_header(header)
        try:
            staged = yield from session.push_steps(push, framing.chunks(),
                                                   lambda: framing.sealed and context.is_active(),
                                                   wait_s=context.time_remaining())
        except Cancelled:
            return None
        yield data_pb2.PushPullResponse(staged=push_response(staged))
        decision = yield from next_of(request_iterator)
        kind = None if decision is None else decision.WhichOneof("item")
        if kind != "decision" or not decision.decision.commit:
            session.abort(push.client_id, push.sequence)
            if decision is None:
                return None
            if kind != "decision":  # ends the call (a message of the push may still be on its way)
                raise InvalidArgument(f"PushPull: after `staged` a step takes its `decision`, got `{kind}`; "
                                      f"the push was dropped")
            closing = self._streams.crowded()
            return Answered(data_pb2.PushPullResponse(
                done=data_pb2.StepDone(version=session.version, committed=False, stream_closing=closing)), closing)
        receipt = yield from session.commit_steps(push.client_id, push.sequence, wait_s=context.time_remaining())
        session.observer.pushed(time.perf_counter() - started)
        return (yield from self._answer(session, receipt, framing.reply, one_message=False))

    # ------------------------------------------------------------- answers
    def _answer_in_region(self, session: ShardSession, receipt: Receipt, region, reply: bool):
        """A shared-memory step's answer: the parameters written once into the region (``reply``),
        then one ``step_result`` without chunks."""
        started = time.perf_counter()
        closing = self._streams.crowded()
        version = receipt.version
        if reply:
            version, sent = reply_into(session, region)
            session.observer.sent(time.perf_counter() - started, sent)
        done = data_pb2.StepDone(version=version, staleness=receipt.staleness, committed=True, stream_closing=closing,
                                 applied_version=receipt.version)
        yield from receipt.durable_steps()  # `done` acknowledges the push: its step is in the step log first
        return Answered(data_pb2.PushPullResponse(
            step_result=data_pb2.PushPullStepResult(done=done, in_shared_memory=reply)), closing)

    def _answer(self, session: ShardSession, receipt: Receipt, reply: tuple[Optional[DType], int], one_message: bool,
                sparse_base: Optional[int] = None):
        """The step's parameters and ``done`` in the ``reply`` options (``data_requests.pull_options``,
        checked before the push): one ``step_result`` when ``one_message`` and they fit in one chunk,
        else chunks then ``done``. ``sparse_base``: the push's base version when it asked for
        ``sparse_update`` (tensors its step's sparse parts rebuild go as those). Returns the last
        answer with whether the shard ends the call (:class:`Answered`)."""
        started = time.perf_counter()
        dtype, chunk_bytes = reply
        if sparse_base is None:
            (version, params), relayed = (yield from session.snapshot_steps()), {}
        else:
            version, params, relayed = yield from session.snapshot_steps(relayed_since=sparse_base)
            # parts another worker cut larger than this client takes in one chunk go as values
            relayed = {name: parts for name, parts in relayed.items()
                       if all(len(data) <= chunk_bytes for part in parts for _, data in part)}
        closing = self._streams.crowded()
        done = data_pb2.StepDone(version=version, staleness=receipt.staleness, committed=True, stream_closing=closing,
                                 applied_version=receipt.version)
        reply_bytes = sum(sum(len(data) for part in relayed[name] for _, data in part) if name in relayed
                          else params[name].size * (dtype or spec.dtype).itemsize for name, spec in session.specs.items())
        if one_message and reply_bytes <= chunk_bytes:
            chunks = [tensor_chunk(*piece) for piece in param_slices(session, params, dtype, chunk_bytes, relayed)]
            # On CPU the snapshot's arrays are views of the shard's device buffers: held while the
            # stream waits for its next step, they would stop that step's update from donating
            # (reusing) those buffers, and JAX would allocate fresh ones (on an accelerator they
            # are views of a pinned host copy, harmless to hold but dropped all the same).
            del params
            session.observer.sent(time.perf_counter() - started, reply_bytes)
            yield from receipt.durable_steps()  # `done` acknowledges the push: its step is in the step log first
            return Answered(data_pb2.PushPullResponse(
                step_result=data_pb2.PushPullStepResult(done=done, chunks=chunks)), closing)
        else:
            for piece in param_slices(session, params, dtype, chunk_bytes, relayed):
                yield chunk_codec.encode_chunk_message(*piece)
            del params
            session.observer.sent(time.perf_counter() - started, reply_bytes)
            yield from receipt.durable_steps()  # `done` acknowledges the push: its step is in the step log first
            return Answered(data_pb2.PushPullResponse(done=done), closing)


def _more_follows(request) -> bool:
    """Whether a streamed push's message is followed by another of its step (not after ``seal``)."""
    return isinstance(request, data_pb2.PushPullRequest) and request.WhichOneof("item") in ("chunk", "pull")


def _sparse_base(framing, header) -> Optional[int]:
    """The push's base version when its pull options ask for ``sparse_update``, else None."""
    return header.base_version if framing.sparse_update else None
