"""How a session's tensor bytes travel to and from each shard: gRPC chunks or a shared-memory region.

Per shard and per call, one of two paths:

- **gRPC bytes**: tensors go out as chunk messages (:mod:`optserve.protos.tensor_chunks`) and
  pulled parameters come back as chunks, written into arrays by :class:`~optserve.client._wire.Reassembler`.
  A push_pull step of a small session goes as one ``PushPullStep`` message, answered by one
  ``step_result``; a larger one as a stream: ``header``, ``pull`` options, chunks, ``seal``.
- **shared memory** (same host, :mod:`optserve.client._shm`): the step's gradients are written
  into (or already lie in) the shard's region, the step message names the region, and the shard
  writes the parameters back into it. Only for float32 on the wire (a narrower wire dtype rounds
  values, which the float32 regions would not).

Results are per shard, in shard-map order; what they mean for the session's version is the
session's business (:class:`~optserve.client._session.Session`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Optional

import numpy as np

from optserve.client import _retry, _saved_state, _shm, _wire
from optserve.client._fanout import Shard, ShardFanout, all_or_first_error, call_shard
from optserve.client._step_stream import StepHandle, StreamBroken
from optserve.client.errors import (FailedPreconditionError, InvalidArgumentError, NotFoundError, PeerRefusedError,
                                   PermissionDeniedError, ResourceExhaustedError, SessionLostError, StaleError,
                                   UnauthenticatedError, UnavailableError)
from optserve.protos import contract, tensor_chunks
from optserve.protos import shared_memory as shm_contract
from optserve.protos.optserve.v1 import data_pb2, tensor_pb2

Arrays = Mapping[str, np.ndarray]  # tensor name -> array in the tensor's shape
# Sessions of up to this many parameter elements (256 KB in float32: below the default chunk size) send
# each push_pull step to a shard as one `step` message (answered by one `step_result`), read
# their shards' replies in one thread, and send no `pull` options unless they ask for a wire dtype
# or another chunk size.
SMALL_SESSION_ELEMENTS = 64 << 10

# Errors that answer a step without anything left staged on the shard (the push was refused or
# dropped there, or the shard is gone): its region may be written again.
_ANSWERED_REFUSALS = (InvalidArgumentError, StaleError, PeerRefusedError, FailedPreconditionError, UnavailableError,
                      UnauthenticatedError, PermissionDeniedError, ResourceExhaustedError, SessionLostError,
                      NotFoundError)


class StepReply(NamedTuple):
    """One shard's answer to a push_pull step: its ``StepDone`` (version, staleness) and the
    parameters it holds (name -> array; empty for a push through shared memory)."""

    done: data_pb2.StepDone
    arrays: dict[str, np.ndarray]
    received_bytes: int = 0  # tensor bytes the reply carried (chunk payloads; 0 through a region)


class DataPaths:
    """The data-plane calls of one session object, each shard on its path (see the module docstring).

    ``client``: the :class:`~optserve.client.Client` (timeout, retry policy, chunk size);
    ``session``: the session's name; ``fanout``: its shards; ``regions``: this object's
    shared-memory regions (``mode`` False: gRPC bytes everywhere); ``small``: whether the
    session is small enough for one-message steps (:data:`SMALL_SESSION_ELEMENTS`).
    """

    def __init__(self, client, session: str, specs: Mapping[str, tuple[int, tuple[int, ...]]],
                 fanout: ShardFanout, regions: _shm.SessionRegions):
        self.client = client
        self.session = session
        self._specs = specs  # name -> (spec dtype enum, shape)
        self.fanout = fanout
        self.regions = regions
        self.small = sum(int(np.prod(shape)) for _, shape in specs.values()) <= SMALL_SESSION_ELEMENTS
        self.sparse_over_senders = False  # the session's sparse_mean is "senders" (set by the Session)
        self._grad_buffers: Optional[dict[str, np.ndarray]] = None

    def via_shm(self, wire: Optional[int]) -> bool:
        """Whether a call with wire dtype ``wire`` may use shared memory: only with float32 values on
        the wire (None or float32; bf16 / f16 round the values and int8 quantizes them, which the
        float32 regions would not)."""
        return self.regions.mode is not False and wire in (None, contract.FLOAT32)

    def all_via_shm(self, wire: Optional[int]) -> bool:
        """Whether every shard's bytes of a call with wire dtype ``wire`` go through shared memory
        (False while a shard cannot be asked: it is restarting; the call's own tries ask again)."""
        if not self.via_shm(wire):
            return False
        try:
            return all(self.regions.ensure(self.fanout.shards).values())
        except UnavailableError:
            return False

    # ----------------------------------------------------------------- calls
    def initialize(self, params: Arrays, creator_id: str, state: Optional[Mapping] = None) -> None:
        """Sends the session's initial values to every shard: through a shared-memory region's
        reply part where the shard has one (they are then :meth:`parameter_buffers`' values),
        else as chunks; each tensor in its own dtype.
        Only the creating client may: the first message names it (``creator_id``).
        ``state``: a saved state (:mod:`~optserve.client._saved_state`) the session starts from:
        each shard gets its tensors' optimizer state, the shared state, the version and the
        hyperparameters after the values."""
        start = {} if state is None else {"start": _saved_state.start_message(state)}
        try:
            taken = self.regions.acquire(self.fanout.shards) if self.via_shm(None) else {}
        except UnavailableError:  # a shard not reachable yet (restarting): chunks, retried as they always were
            taken = {}

        def send(shard: Shard):
            region = taken.get(shard.index)

            def requests():
                if region is not None:
                    yield data_pb2.InitTensorsRequest(session=self.session, client_id=creator_id,
                                                      shared_memory=region.step(False), **start)
                else:
                    yield data_pb2.InitTensorsRequest(session=self.session, client_id=creator_id, **start)
                    yield from self.chunk_messages(shard, params, None)
                if state is not None:
                    yield from _saved_state.state_requests(state, shard.names)

            if region is not None:
                region.write_parameters(params)
            return _retry.call(lambda: shard.calls.init_tensors(requests(), timeout=self.client.timeout),
                               self.client.retry)

        try:
            self._region_call(taken, lambda: self.fanout.each(send))
        finally:
            self.regions.release(taken)

    def pull(self, wire: Optional[int], out: Optional[Arrays], views: bool,
             evaluation: bool = False) -> list[tuple[int, dict[str, np.ndarray]]]:
        """``(version, parameters)`` of every shard (see ``Session.pull`` for ``out``, ``views``
        and ``evaluation``)."""
        return self.fanout.each(lambda shard: self._pull_shard(shard, wire, out, views, evaluation))

    def push(self, header: data_pb2.PushHeader, grads: Mapping[str, tensor_chunks.Tensor],
             wire: Optional[int]) -> list[data_pb2.PushResponse]:
        """Every shard's ``PushResponse`` to a push of its gradients as gRPC bytes."""
        def push_shard(shard: Shard):
            def requests():
                yield data_pb2.PushRequest(header=header)
                yield from self.chunk_messages(shard, grads, wire)

            return shard.calls.push(requests(), timeout=self.client.timeout)

        return self.fanout.each(lambda shard: call_shard(push_shard, shard))

    def push_pull(self, header: data_pb2.PushHeader, grads: Mapping[str, tensor_chunks.Tensor], wire: Optional[int],
                  out: Optional[Arrays] = None, views: bool = False, reply: bool = True,
                  sparse_base: Optional[Arrays] = None) -> list[StepReply]:
        """Every shard's :class:`StepReply` to one push_pull step (parameters left out when not
        ``reply``: a push through shared memory). ``sparse_base``: the parameters of the header's
        base version, when the gradients are SparseLoCo selections (see ``Session.push_pull``)."""
        taken = self.regions.acquire(self.fanout.shards, grads) if self.via_shm(wire) else {}
        try:
            step = _Step(self, header, grads, wire, out, views, reply, taken, sparse_base)
            return self._region_call(taken, step.run)
        finally:
            self.regions.release(taken)

    # ----------------------------------------------------------------- gradient buffers, closing
    def gradient_buffers(self) -> dict[str, np.ndarray]:
        """Float32 arrays to write gradients into (see ``Session.gradient_buffers``)."""
        regions = self.regions.free_regions(self.fanout.shards)
        paths = self.regions.paths()
        if self._grad_buffers is None:
            self._grad_buffers = {}
        buffers = {}
        for shard in self.fanout.shards:
            region = regions.get(shard.index)
            for name in shard.names:
                if region is not None:
                    buffers[name] = region.push[name]
                elif paths.get(shard.index) == "shared_memory":  # both regions busy: fresh arrays, copied when pushed
                    buffers[name] = np.zeros(self._specs[name][1], np.float32)
                else:  # gRPC bytes: ordinary arrays, the same every call
                    if name not in self._grad_buffers:
                        self._grad_buffers[name] = np.zeros(self._specs[name][1], np.float32)
                    buffers[name] = self._grad_buffers[name]
        return buffers

    def parameter_buffers(self) -> dict[str, np.ndarray]:
        """Float32 arrays over the reply parts of the regions the next step uses (see
        ``Session.parameter_buffers``)."""
        buffers = {}
        for region in self.regions.free_regions(self.fanout.shards).values():
            if region is not None:
                buffers.update(region.parameters())
        return buffers

    def close(self) -> None:
        """Drops the gradient buffers and the regions (the shards are told, best effort)."""
        self._grad_buffers = None
        self.regions.close()

    # ----------------------------------------------------------------- helpers
    def _pull_shard(self, shard: Shard, wire: Optional[int], out: Optional[Arrays], views: bool, evaluation: bool):
        # an evaluation pull goes as bytes: a model may live in the region (the torch adapter's)
        taken = self.regions.acquire([shard]) if self.via_shm(wire) and not evaluation else {}
        if taken:  # the shard writes the parameters into this object's region
            try:
                request = data_pb2.PullRequest(session=self.session, shared_memory=taken[shard.index].step(True),
                                               evaluation=evaluation)
                # the stream is read inside call_shard: an error met while reading it (a region the
                # shard no longer knows) is converted like one met at the call's opening
                version = self._region_call(taken, lambda: call_shard(lambda s: next(
                    v for k, v in s.calls.pull(request, timeout=self.client.timeout) if k == "version"), shard))
                return version, taken[shard.index].read(out, views)
            finally:
                self.regions.release(taken)
        request = data_pb2.PullRequest(session=self.session, wire_dtype=wire or tensor_pb2.DTYPE_UNSPECIFIED,
                                       max_chunk_bytes=self.client.chunk_bytes, evaluation=evaluation)
        assembler = self.reassembler(shard, out)
        version = None
        for kind, value in shard.calls.pull(request, timeout=self.client.timeout):
            if kind == "version":
                version = value
            elif kind == "chunk":
                assembler.add(value)
        return version, assembler.finish()

    def chunk_messages(self, shard: Shard, tensors: Mapping[str, tensor_chunks.Tensor],
                       wire: Optional[int]) -> Iterator[bytes]:
        """The shard's tensors as serialized ``{chunk: ...}`` messages (valid in every request type)."""
        for name in shard.names:
            yield from tensor_chunks.chunk_messages(name, tensors[name], wire, self.client.chunk_bytes)

    def tensor_chunk_list(self, shard: Shard, tensors: Mapping[str, tensor_chunks.Tensor],
                          wire: Optional[int]) -> list[tensor_pb2.TensorChunk]:
        """The shard's tensors as ``TensorChunk`` messages (to go inside one message)."""
        return [chunk for name in shard.names
                for chunk in tensor_chunks.tensor_chunks(name, tensors[name], wire, self.client.chunk_bytes)]

    def reassembler(self, shard: Shard, out: Optional[Arrays], sparse_base: Optional[Arrays] = None) -> _wire.Reassembler:
        return _wire.Reassembler({n: self._specs[n] for n in shard.names}, out, sparse_base, self.sparse_over_senders)

    def _region_call(self, taken: Mapping[int, _shm.ShardRegion], call: Callable[[], Any]) -> Any:
        """Runs ``call`` (a step using the ``taken`` regions); a shard that no longer knows its
        region (expired, restarted) makes the region negotiated anew and the step retried.

        The shards read the gradients where they lie in the regions until the step is answered.
        A step that ends without its answer (a deadline, an internal error, an interruption)
        may still be applied from them later, so those regions are never written again: the
        next step negotiates fresh ones."""
        try:
            return call()
        except NotFoundError as exc:
            if taken and shm_contract.REGION_UNKNOWN in str(exc):
                self._forget_regions(taken)
                unknown = UnavailableError(str(exc), "UNAVAILABLE")
                # the shard answered (a restarted one serves at its predecessor's address, knowing
                # none of its regions): the step is tried again at once, on fresh regions
                unknown.renegotiate = True
                raise unknown from None
            raise
        except BaseException as exc:
            if taken and not isinstance(exc, _ANSWERED_REFUSALS):
                self._forget_regions(taken)
            raise

    def _forget_regions(self, taken: Mapping[int, _shm.ShardRegion]) -> None:
        self.regions.forget(list(taken))
        self._grad_buffers = None


class _Step:
    """One push_pull attempt on every shard: its messages out, the shards' replies in.

    ``taken``: shard index -> the locked region the shard's bytes go through (shards left out
    go by gRPC bytes). ``grads``: name -> array, or :class:`~optserve.protos.tensor_chunks.Int8Gradient`.
    """

    def __init__(self, paths: DataPaths, header: data_pb2.PushHeader, grads: Mapping[str, tensor_chunks.Tensor],
                 wire: Optional[int], out: Optional[Arrays], views: bool, reply: bool,
                 taken: Mapping[int, _shm.ShardRegion], sparse_base: Optional[Arrays] = None):
        self._paths, self._header, self._grads, self._wire = paths, header, grads, wire
        self._out, self._views, self._reply, self._taken = out, views, reply, taken
        self._sparse_base = sparse_base if wire == contract.SPARSE else None
        pull_wire = None if wire in contract.GRADIENT_ONLY else wire  # int8 and sparse encode gradients only
        client = paths.client
        self._pull = data_pb2.PullRequest(session=paths.session, wire_dtype=pull_wire or tensor_pb2.DTYPE_UNSPECIFIED,
                                          max_chunk_bytes=client.chunk_bytes,
                                          sparse_update=self._sparse_base is not None)
        # Small sessions leave out pull options that would only repeat the shard's defaults.
        self._pull_options_needed = (bool(pull_wire) or not paths.small or self._sparse_base is not None
                                     or client.chunk_bytes != contract.DEFAULT_CHUNK_BYTES)

    def run(self) -> list[StepReply]:
        """Sends the step to every shard and returns their replies, in shard-map order."""
        if self._paths.small:  # every shard's step is sent at once; their small replies read in turn
            return all_or_first_error([self._start(shard) for shard in self._paths.fanout.shards])
        # large replies: read concurrently, so no shard's stream waits on flow control
        return self._paths.fanout.each(lambda shard: self._start(shard)())

    def _start(self, shard: Shard) -> Callable[[], StepReply]:
        """Sends the shard's step; returns what receives its reply (or raises the failure)."""
        try:
            if shard.index in self._taken:
                self._taken[shard.index].write({name: self._grads[name] for name in shard.names})
            handle = call_shard(lambda s: s.steps.start(self._requests(s)), shard)
        except BaseException as exc:  # noqa: BLE001 - raised when its reply is asked for
            return functools.partial(_raise, exc)
        return lambda: call_shard(lambda s: self._receive_or_resend(s, handle), shard)

    def _receive_or_resend(self, shard: Shard, handle: StepHandle) -> StepReply:
        """:meth:`_receive`; a call the shard had ended before taking the step (idle while the
        shard was crowded) never started it, so it is sent again at once on a fresh call: the other
        shards, which staged their parts, are waiting for this one's vote (a retry of the whole
        step would come only after their vote timed out)."""
        try:
            return self._receive(shard, handle)
        except StreamBroken:
            handle = shard.steps.start(self._requests(shard))
        try:
            return self._receive(shard, handle)
        except StreamBroken as exc:  # twice: retried with the whole step (the fanout's retries)
            raise UnavailableError(f"shard {shard.address}: {exc}", "UNAVAILABLE") from None

    def _requests(self, shard: Shard) -> Iterator:
        """The shard's ``PushPullRequest`` messages (chunks pre-serialized) for this step."""
        header, paths = self._header, self._paths
        if shard.index in self._taken:  # the bytes are in the region already: the step message alone
            yield data_pb2.PushPullRequest(step=data_pb2.PushPullStep(
                header=header, shared_memory=self._taken[shard.index].step(self._reply)))
            return
        if paths.small:  # the whole step in one message, answered by one `step_result`
            step = data_pb2.PushPullStep(header=header, chunks=paths.tensor_chunk_list(shard, self._grads, self._wire))
            if self._pull_options_needed:
                step.pull.CopyFrom(self._pull)
            yield data_pb2.PushPullRequest(step=step)
            return
        yield data_pb2.PushPullRequest(header=header)
        if self._pull_options_needed:
            yield data_pb2.PushPullRequest(pull=self._pull)
        yield from paths.chunk_messages(shard, self._grads, self._wire)
        yield data_pb2.PushPullRequest(seal=True)

    def _receive(self, shard: Shard, handle: StepHandle) -> StepReply:
        """Reads the shard's reply: chunks into arrays (or the parameters from its region) until ``done``."""
        assembler = self._paths.reassembler(shard, self._out, self._sparse_base)
        done, in_region = [], []

        def on_response(kind, value) -> bool:
            if kind == "chunk":
                assembler.add(value)
            elif kind == "done":
                done.append(value)
                return True
            elif kind == "step_result":
                if value.in_shared_memory:
                    in_region.append(self._taken[shard.index].read(self._out, self._views))
                for chunk in value.chunks:
                    assembler.add(chunk)
                done.append(value.done)
                return True
            return False

        finished = handle.finish(on_response)  # StreamBroken: the shard had ended the call, the step never started
        if not finished:
            raise InvalidArgumentError(f"shard {shard.address} ended the stream without `done`")
        if done[0].stream_closing:
            shard.steps.end_after_step()
        if shard.index in self._taken:
            return StepReply(done[0], in_region[0] if in_region else {})
        return StepReply(done[0], assembler.finish(), assembler.received_bytes)


def _raise(exc: BaseException):
    raise exc
