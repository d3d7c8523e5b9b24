"""A session as the client sees it: fan-out of pushes and pulls to the shards, in parallel.

Push protocol (see protos/optserve/v1/data.proto): every push is sent with ``auto_commit``: each
shard stages its part and votes at the session clock, which commits the push only if every
shard staged it; so a push applies on all shards or on none, in one round trip per shard.
Each push has a fresh sequence number; retries (UNAVAILABLE) reuse it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import random
import threading
import time
import uuid
from typing import Any, Callable, Mapping, Optional

import grpc
import numpy as np

from optserve.client import _retry, _shm, _wire
from optserve.client._step_stream import StepStream, StreamBroken
from optserve.client.errors import (FailedPreconditionError, InvalidArgumentError, NotFoundError, OptservError,
                                   PeerRefusedError, PermissionDeniedError, ResourceExhaustedError, SessionLostError,
                                   StaleError, UnauthenticatedError, UnavailableError, from_rpc_error)
from optserve.client.options import SessionOptions
from optserve.client.status import SessionStatus
from optserve.protos import chunk_codec, contract
from optserve.protos import shared_memory as _shm_contract
from optserve.protos.optserve.v1 import control_pb2, data_pb2, tensor_pb2

_SERVICE = "/optserve.v1.ShardData/"
# Sessions of up to this many parameter elements (256 KB in float32: below the default chunk size) send
# each push_pull step to a shard as one `step` message (answered by one `step_result`), read
# their shards' replies in one thread, and send no `pull` options unless they ask for a wire dtype
# or another chunk size.
_SMALL_SESSION_ELEMENTS = 64 << 10




def _scalar(value: Any, what: str) -> float:
    """A telemetry value as a float (a 0-d array or a framework scalar tensor works too)."""
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{what}: must be a number, got {type(value).__name__}") from None


# Errors that answer a step without anything left staged on the shard (the push was refused or
# dropped there, or the shard is gone): its region may be written again.
_ANSWERED_REFUSALS = (InvalidArgumentError, StaleError, PeerRefusedError, FailedPreconditionError, UnavailableError,
                      UnauthenticatedError, PermissionDeniedError, ResourceExhaustedError, SessionLostError,
                      NotFoundError)


class _ShardCalls:
    """The chunk-carrying ShardData methods on one channel, with the copy-saving codecs of
    :mod:`optserve.protos.chunk_codec`: requests may be pre-encoded chunk messages (bytes) and
    responses arrive as ``(kind, value)`` pairs whose chunks are views, not copies."""

    def __init__(self, channel: grpc.Channel):
        send = chunk_codec.serialize
        self.init_tensors = channel.stream_unary(_SERVICE + "InitTensors", request_serializer=send,
                                                 response_deserializer=data_pb2.InitTensorsResponse.FromString)
        self.push = channel.stream_unary(_SERVICE + "Push", request_serializer=send,
                                         response_deserializer=data_pb2.PushResponse.FromString)
        self.pull = channel.unary_stream(_SERVICE + "Pull", request_serializer=send,
                                         response_deserializer=chunk_codec.chunk_or_message(data_pb2.PullResponse))
        self.push_pull = channel.stream_stream(
            _SERVICE + "PushPull", request_serializer=send,
            response_deserializer=chunk_codec.chunk_or_message(data_pb2.PushPullResponse))


@dataclasses.dataclass(frozen=True)
class _Shard:
    index: int
    address: str
    names: tuple[str, ...]
    calls: _ShardCalls
    steps: StepStream  # the shard's open PushPull call, reused by consecutive push_pull steps


class Session:
    """A session of an optserve server. Create with ``Client.create_session`` or ``Client.session``.

    Arrays are NumPy, keyed by tensor name; gradients must have every tensor, in its shape.
    ``wire_dtype`` (None, "float32", "bfloat16", "float16") compresses gradients and pulled
    parameters on the wire; the server keeps the math in float32.
    """

    def __init__(self, client, info: control_pb2.SessionInfo, version: int = 0):
        self._client = client
        self.name = info.config.name
        self.info = info
        self.mode = "sync" if info.config.mode == control_pb2.MODE_SYNC else "async"
        self.specs: dict[str, tuple[int, tuple[int, ...]]] = {
            t.name: (t.dtype, tuple(t.shape)) for t in info.config.tensors
        }
        self.options = SessionOptions.from_config(info.config)
        self.optimizer = {"name": self.options.optimizer, "args": dict(self.options.optimizer_args)}
        self.wire_dtype: Optional[int] = info.config.wire_dtype or None
        self._shards = self._connect(info)
        self._small = sum(int(np.prod(shape)) for _, shape in self.specs.values()) <= _SMALL_SESSION_ELEMENTS
        self.client_id = uuid.uuid4().hex  # this object's push identity (PushHeader); not Client.client_id
        self._sequence = itertools.count(1)
        self._version = version
        self.last_staleness = 0  # staleness the server assigned to this object's latest push (async)
        self._version_lock = threading.Lock()
        self._fanout = concurrent.futures.ThreadPoolExecutor(max_workers=max(2, len(self._shards)), thread_name_prefix="optserve-shard")
        self._background = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="optserve-async")
        # same-host fast path (client/_shm.py): tensor bytes through shared memory, proven per shard
        self._shm = _shm.SessionRegions(getattr(client, "shared_memory", "auto"), client._channel, self.name,
                                        self.client_id, self.specs, client.timeout)
        self._grad_buffers: Optional[dict[str, np.ndarray]] = None
        self._feedback = _wire.ErrorFeedback()  # int8 gradients: per-tensor residuals

    # ----------------------------------------------------------------- public API
    @property
    def version(self) -> int:
        """The latest parameter version this session object has seen (pull / push results)."""
        return self._version

    def pull(self, wire_dtype: _wire.DTypeLike = "default", out: Optional[Mapping[str, np.ndarray]] = None,
             views: bool = False) -> dict[str, np.ndarray]:
        """Current parameters from every shard (float16 tensors as float16, others float32).

        ``out``: arrays to write into (e.g. the previous result), avoiding fresh allocations.
        ``views``: on shards reached through shared memory, return read-only views of the
        region (no copy; valid until this session object's next step); elsewhere copies.
        """
        wire = self._wire(wire_dtype)
        wire = None if wire == contract.INT8 else wire  # int8 encodes gradients only
        results = self._served(lambda: self._each_shard(lambda shard: self._pull_shard(shard, wire, out, views)))
        self._see_version(min(version for version, _ in results))
        return {name: value for _, arrays in results for name, value in arrays.items()}

    def push(self, grads: Mapping[str, np.ndarray], wire_dtype: _wire.DTypeLike = "default",
             base_version: Optional[int] = None, loss: Optional[float] = None,
             scalars: Optional[Mapping[str, float]] = None) -> int:
        """Applies ``grads`` (sync: joins the current step and waits for it); returns the new version.

        ``base_version``: the version of the parameters the gradient was computed from (async
        staleness is measured against it); default: the latest version this object has seen.
        ``loss`` / ``scalars``: telemetry kept with the push's version and staleness
        (``Client.session_series``, ``optserve report``); they never change the update.

        Raises:
          InvalidArgumentError, StaleError, ...: the server's refusal; nothing was applied.
        """
        grads = self._check_grads(grads)
        wire = self._wire(wire_dtype)
        grads = self._encode(grads, wire)
        header = self._header(base_version, loss, scalars)
        if self._via_shm(wire) and all(self._shm.ensure(self._shards).values()):  # every shard's bytes in shared memory
            return self._served(lambda: self._push_pull_once(header, grads, wire, reply=False))
        return self._served(lambda: self._push_once(header, grads, wire))

    def push_pull(self, grads: Mapping[str, np.ndarray], wire_dtype: _wire.DTypeLike = "default",
                  out: Optional[Mapping[str, np.ndarray]] = None,
                  base_version: Optional[int] = None, loss: Optional[float] = None,
                  scalars: Optional[Mapping[str, float]] = None, views: bool = False) -> dict[str, np.ndarray]:
        """Pushes ``grads`` and returns the parameters of the step they joined (into ``out`` if given).

        ``base_version``, ``loss``, ``scalars``: as for :meth:`push`. ``views``: as for :meth:`pull`.
        """
        grads = self._check_grads(grads)
        wire = self._wire(wire_dtype)
        grads = self._encode(grads, wire)
        header = self._header(base_version, loss, scalars)
        return self._served(lambda: self._push_pull_once(header, grads, wire, out, views=views))

    def _encode(self, grads: dict[str, np.ndarray], wire: Optional[int]) -> dict:
        """int8: the gradients quantized once per push (retries resend the same bytes), with
        this object's error feedback; other wire dtypes are converted per chunk."""
        return self._feedback.quantize(grads) if wire == contract.INT8 else grads

    def gradient_buffers(self) -> dict[str, np.ndarray]:
        """Float32 arrays, one per tensor, to write gradients into and pass to :meth:`push_pull`
        / :meth:`push`: on shards reached through shared memory they live in a push region that
        no step of this object is using (no copy when pushed), elsewhere they are ordinary arrays.

        While this object's steps take turns, every call returns the same arrays. While a step
        is in flight (:meth:`push_pull_async`, overlap mode) it reads its gradients where they
        lie until it is answered, so a call then returns the other set of a double-buffered pair
        (a second region per shard, negotiated on first need): write the next gradient there
        while the step runs. Call it once per step in overlap mode; the values are this object's
        to overwrite once the step that pushed them is answered."""
        regions = self._shm.free_regions(self._shards)
        paths = self._shm.paths()
        if self._grad_buffers is None:
            self._grad_buffers = {}
        buffers = {}
        for shard in self._shards:
            region = regions.get(shard.index)
            for name in shard.names:
                if region is not None:
                    buffers[name] = region.push[name]
                elif paths.get(shard.index) == "shared_memory":  # both regions busy: fresh arrays, copied when pushed
                    buffers[name] = np.zeros(self.specs[name][1], np.float32)
                else:  # gRPC bytes: ordinary arrays, the same every call
                    buffers[name] = self._grad_buffers.setdefault(name, np.zeros(self.specs[name][1], np.float32))
        return buffers

    def data_paths(self) -> dict[int, str]:
        """Shard index -> "shared_memory" or "grpc": how this object's tensor bytes reach each shard."""
        return {index: "shared_memory" if region is not None else "grpc"
                for index, region in self._shm.ensure(self._shards).items()}

    def push_pull_async(self, grads: Mapping[str, np.ndarray], **kwargs) -> concurrent.futures.Future:
        """``push_pull`` in a background thread (one at a time per session, in call order).

        Gradients in :meth:`gradient_buffers` stay this step's until the future is done: the next
        :meth:`gradient_buffers` call hands out the other set of a double-buffered pair."""
        reserved = self._shm.reserve(grads)

        def step():
            try:
                return self.push_pull(grads, **kwargs)
            finally:  # before the future is done: whoever waits on it finds the regions free
                self._shm.unreserve(reserved)

        return self._background.submit(step)

    def status(self) -> SessionStatus:
        response = _retry.call(
            lambda: self._client._control.GetStatus(control_pb2.GetStatusRequest(name=self.name), timeout=self._client.timeout),
            self._client.retry,
        )
        status = SessionStatus.from_proto(response)
        paths = self._shm.paths()
        return dataclasses.replace(status, shards=[dataclasses.replace(s, data_path=paths.get(s.index, "grpc"))
                                                   for s in status.shards])

    def close(self) -> None:
        """Closes the session on the server (for every client) and releases local threads."""
        try:
            self._client.close_session(self.name)
        finally:
            self.detach()

    def detach(self) -> None:
        """Releases this object's threads and open calls without closing the server-side session."""
        for shard in self._shards:
            shard.steps.close()
        self._grad_buffers = None
        self._shm.close()
        self._fanout.shutdown(wait=False)
        self._background.shutdown(wait=False)

    # ----------------------------------------------------------------- helpers
    def _connect(self, info: control_pb2.SessionInfo) -> list[_Shard]:
        """One :class:`_Shard` per entry of the session's shard map."""
        client = self._client
        shards = []
        for s in info.shards:
            calls = _ShardCalls(client._channel(s.address))
            shards.append(_Shard(s.shard_index, s.address, tuple(s.tensor_names), calls,
                                 StepStream(calls.push_pull, client.timeout, idle_s=client.stream_idle_s)))
        return shards

    def _served(self, attempt: Callable[[], Any]) -> Any:
        """Runs a data-plane ``attempt``, riding out a shard's recovery.

        A failure that may mean a shard died or restarted (UNAVAILABLE, or a shard that does not
        know the session) sends the client to the coordinator: a lost session raises
        :class:`SessionLostError` at once; otherwise the shard map is read again (a restarted
        shard or server serves at new addresses) and the attempt is retried with the same push
        identity (applied at most once), with backoff, for up to the client's ``timeout``.
        """
        policy = self._client.retry
        deadline = time.monotonic() + self._client.timeout
        for attempt_number in itertools.count():
            try:
                return attempt()
            except grpc.RpcError as rpc_error:
                error: OptservError = from_rpc_error(rpc_error)
            except (UnavailableError, NotFoundError) as exc:
                error = exc
            if not isinstance(error, (UnavailableError, NotFoundError)):
                raise error
            self._refresh_shard_map()  # raises SessionLostError, or NotFoundError if the session is gone
            retryable = isinstance(error, UnavailableError) or attempt_number == 0
            if not retryable or time.monotonic() >= deadline:
                raise error
            backoff = min(policy.max_backoff_s, policy.initial_backoff_s * 2 ** attempt_number)
            time.sleep(min(backoff * random.uniform(0.8, 1.2), max(0.0, deadline - time.monotonic())))
        raise AssertionError("unreachable")

    def _refresh_shard_map(self) -> None:
        """Asks the coordinator for the session: raises SessionLostError (or NotFoundError) if it
        is lost (or gone); reconnects to shards whose address changed. A coordinator that does not
        answer (restarting) changes nothing."""
        request = control_pb2.GetSessionRequest(name=self.name)
        try:
            info = self._client._control.GetSession(request, timeout=min(5.0, self._client.timeout)).session
        except grpc.RpcError as exc:
            error: OptservError = from_rpc_error(exc)
            if isinstance(error, (SessionLostError, NotFoundError)):
                raise error from None
            return
        if [(s.shard_index, s.address) for s in info.shards] != [(s.index, s.address) for s in self._shards]:
            old, self._shards = self._shards, self._connect(info)
            for shard in old:
                shard.steps.close()

    def _wire(self, requested) -> Optional[int]:
        if isinstance(requested, str) and requested == "default":
            return self.wire_dtype
        return _wire.wire_option_enum(requested, what="wire_dtype")

    def _header(self, base_version: Optional[int] = None, loss: Optional[float] = None,
                scalars: Optional[Mapping[str, float]] = None) -> data_pb2.PushHeader:
        base = self._version if base_version is None else int(base_version)
        header = data_pb2.PushHeader(session=self.name, client_id=self.client_id, sequence=next(self._sequence),
                                     base_version=base, auto_commit=True, wait_s=self._client.timeout)
        if loss is not None:
            header.loss = _scalar(loss, "loss")
        for name, value in (scalars or {}).items():
            if not isinstance(name, str) or not 1 <= len(name) <= contract.MAX_SCALAR_NAME:
                raise InvalidArgumentError(f"scalars: a name must be a string of 1-{contract.MAX_SCALAR_NAME} characters, "
                                           f"got {name!r}")
            header.scalars[name] = _scalar(value, f"scalars[{name!r}]")
        if len(header.scalars) > contract.MAX_SCALARS:
            raise InvalidArgumentError(f"scalars: at most {contract.MAX_SCALARS} per push, got {len(header.scalars)}")
        return header

    def _see_version(self, version: int) -> None:
        with self._version_lock:
            self._version = max(self._version, version)

    def _set_version(self, version: int) -> None:
        with self._version_lock:
            self._version = version

    def _check_grads(self, grads: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Validates names, shapes and dtypes against the session's specs, before sending."""
        unknown = sorted(set(grads) - set(self.specs))
        if unknown:
            raise InvalidArgumentError(f"unknown tensor {unknown[0]!r}: session {self.name!r} has {sorted(self.specs)}")
        missing = sorted(set(self.specs) - set(grads))
        if missing:
            raise InvalidArgumentError(f"missing tensor {missing[0]!r}: a push must include every tensor")
        checked = {}
        for name, value in grads.items():
            array = np.asarray(value)
            if tuple(array.shape) != self.specs[name][1]:
                raise InvalidArgumentError(
                    f"tensor {name!r}: shape {list(array.shape)} does not match the session's {list(self.specs[name][1])}")
            _wire.array_dtype_enum(array, name=name)
            checked[name] = array
        return checked

    def _each_shard(self, fn: Callable[[_Shard], Any]) -> list:
        """Runs ``fn`` on every shard concurrently; raises the first failure (after all finish)."""
        if len(self._shards) == 1:
            return [fn(self._shards[0])]
        futures = [self._fanout.submit(fn, shard) for shard in self._shards[1:]]
        results, errors = [], []
        try:  # the first shard in the calling thread: one thread hand-off less per call
            results.append(fn(self._shards[0]))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
        for future in futures:
            try:
                results.append(future.result())
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)
        if errors:  # the refusing shard's own error explains more than its peers' PeerRefused
            raise next((e for e in errors if not isinstance(e, PeerRefusedError)), errors[0])
        return results

    def _chunks(self, shard: _Shard, arrays: Mapping[str, np.ndarray], wire: Optional[int]):
        """The shard's tensors as serialized ``{chunk: ...}`` messages (valid in every request type)."""
        size = self._client.chunk_bytes
        for name in shard.names:
            array = arrays[name]
            if isinstance(array, _wire.Int8Gradient):
                yield from _wire.iter_int8_chunk_messages(name, array, size)
                continue
            yield from _wire.iter_chunk_messages(name, array, wire or _wire.array_dtype_enum(array, name=name), size)

    def _tensor_chunks(self, shard: _Shard, arrays: Mapping[str, np.ndarray], wire: Optional[int]) -> list:
        """The shard's tensors as ``TensorChunk`` messages (to go inside one message)."""
        size = self._client.chunk_bytes
        if wire == contract.INT8:
            return [chunk for name in shard.names for chunk in _wire.iter_int8_chunks(name, arrays[name], size)]
        return [chunk for name in shard.names
                for chunk in _wire.iter_chunks(name, arrays[name], wire or _wire.array_dtype_enum(arrays[name], name=name), size)]

    def _pull_shard(self, shard: _Shard, wire: Optional[int], out=None, views: bool = False):
        taken = self._shm.acquire([shard]) if self._via_shm(wire) else {}
        if taken:  # the shard writes the parameters into this object's region
            try:
                request = data_pb2.PullRequest(session=self.name, shared_memory=taken[shard.index].step(True))
                version = self._region_call(taken, lambda: next(
                    v for k, v in _rpc(lambda s: s.calls.pull(request, timeout=self._client.timeout), shard)
                    if k == "version"))
                return version, taken[shard.index].read(out, views)
            finally:
                self._shm.release(taken)
        request = data_pb2.PullRequest(session=self.name, wire_dtype=wire or tensor_pb2.DTYPE_UNSPECIFIED,
                                       max_chunk_bytes=self._client.chunk_bytes)
        assembler = _wire.Reassembler({n: self.specs[n] for n in shard.names}, out)
        version = None
        for kind, value in shard.calls.pull(request, timeout=self._client.timeout):
            if kind == "version":
                version = value
            elif kind == "chunk":
                assembler.add(value)
        return version, assembler.finish()

    def _initialize(self, params: Mapping[str, np.ndarray]) -> None:
        def send(shard: _Shard):
            def requests():
                # Only the creating client may send a session's initial values: the first message says who it is.
                yield data_pb2.InitTensorsRequest(session=self.name, client_id=self._client.client_id)
                yield from self._chunks(shard, params, None)

            return _retry.call(lambda: shard.calls.init_tensors(requests(), timeout=self._client.timeout),
                               self._client.retry)

        self._each_shard(send)

    # ----------------------------------------------------------------- push
    def _push_once(self, header, grads, wire) -> int:
        """One attempt: every shard stages its part and commits with its peers (auto_commit)."""

        def push_shard(shard: _Shard):
            def requests():
                yield data_pb2.PushRequest(header=header)
                yield from self._chunks(shard, grads, wire)

            return shard.calls.push(requests(), timeout=self._client.timeout)

        responses = self._each_shard(lambda shard: _rpc(push_shard, shard))
        version = max(r.version for r in responses)
        self.last_staleness = responses[0].staleness
        self._see_version(version)
        return version

    def _via_shm(self, wire: Optional[int]) -> bool:
        """Whether a step may use shared memory: not when it asks for a narrower wire dtype
        (bf16 / f16 round the values, which the float32 regions would not)."""
        return self._shm.mode is not False and wire in (None, contract.FLOAT32)

    def _region_call(self, taken: Mapping[int, Any], call: Callable[[], Any]) -> Any:
        """Runs ``call`` (a step using the ``taken`` regions); a shard that no longer knows its
        region (expired, restarted) makes the region negotiated anew and the step retried.

        The shards read the gradients where they lie in the regions until the step is answered.
        A step that ends without its answer (a deadline, an internal error, an interruption)
        may still be applied from them later, so those regions are never written again: the
        next step negotiates fresh ones."""
        try:
            return call()
        except NotFoundError as exc:
            if taken and _shm_contract.REGION_UNKNOWN in str(exc):
                self._forget_regions(taken)
                raise UnavailableError(str(exc), "UNAVAILABLE") from None
            raise
        except BaseException as exc:
            if taken and not isinstance(exc, _ANSWERED_REFUSALS):
                self._forget_regions(taken)
            raise

    def _forget_regions(self, taken: Mapping[int, Any]) -> None:
        self._shm.forget(list(taken))
        self._grad_buffers = None

    def _push_pull_once(self, header, grads, wire, out=None, views: bool = False, reply: bool = True):
        """One attempt: push (auto_commit) and receive the step's parameters, per shard (the
        new version alone when not ``reply``: a push through shared memory)."""
        taken = self._shm.acquire(self._shards, grads) if self._via_shm(wire) else {}
        try:
            return self._region_call(taken, lambda: self._push_pull_attempt(header, grads, wire, out, views, reply, taken))
        finally:
            self._shm.release(taken)

    def _push_pull_attempt(self, header, grads, wire, out, views, reply, taken):
        pull_wire = None if wire == contract.INT8 else wire  # int8 encodes gradients only
        pull = data_pb2.PullRequest(session=self.name, wire_dtype=pull_wire or tensor_pb2.DTYPE_UNSPECIFIED,
                                    max_chunk_bytes=self._client.chunk_bytes)
        # Small sessions leave out pull options that would only repeat the shard's defaults.
        pull_options_needed = bool(pull_wire) or not self._small or self._client.chunk_bytes != contract.DEFAULT_CHUNK_BYTES

        def requests(shard: _Shard):
            if shard.index in taken:  # the bytes are in the region already: the step message alone
                yield data_pb2.PushPullRequest(step=data_pb2.PushPullStep(
                    header=header, shared_memory=taken[shard.index].step(reply)))
                return
            if self._small:  # the whole step in one message, answered by one `step_result`
                step = data_pb2.PushPullStep(header=header, chunks=self._tensor_chunks(shard, grads, wire))
                if pull_options_needed:
                    step.pull.CopyFrom(pull)
                yield data_pb2.PushPullRequest(step=step)
                return
            yield data_pb2.PushPullRequest(header=header)
            if pull_options_needed:
                yield data_pb2.PushPullRequest(pull=pull)
            yield from self._chunks(shard, grads, wire)
            yield data_pb2.PushPullRequest(seal=True)

        def receive(shard: _Shard, handle):
            assembler = _wire.Reassembler({n: self.specs[n] for n in shard.names}, out)
            done, in_region = [], []

            def on_response(kind, value) -> bool:
                if kind == "chunk":
                    assembler.add(value)
                elif kind == "done":
                    done.append(value)
                    return True
                elif kind == "step_result":
                    if value.in_shared_memory:
                        in_region.append(taken[shard.index].read(out, views))
                    for chunk in value.chunks:
                        assembler.add(chunk)
                    done.append(value.done)
                    return True
                return False

            try:
                finished = handle.finish(on_response)
            except StreamBroken as exc:  # the reused call had ended: the step never started; retried
                raise UnavailableError(f"shard {shard.address}: {exc}", "UNAVAILABLE") from None
            if not finished:
                raise InvalidArgumentError(f"shard {shard.address} ended the stream without `done`")
            if done[0].stream_closing:
                shard.steps.end_after_step()
            if shard.index in taken:
                return done[0], in_region[0] if in_region else {}
            return done[0], assembler.finish()

        def start(shard: _Shard) -> Callable[[], Any]:
            """Sends the shard's step; returns what receives its reply (or raises the failure)."""
            try:
                if shard.index in taken:
                    taken[shard.index].write({name: grads[name] for name in shard.names})
                handle = _rpc(lambda s: s.steps.start(requests(s)), shard)
            except BaseException as exc:  # noqa: BLE001 - raised when its reply is asked for
                return functools.partial(_raise, exc)
            return lambda: _rpc(lambda s: receive(s, handle), shard)

        if self._small:  # every shard's step is sent at once; their small replies read in turn
            results = _all_or_first_error([start(shard) for shard in self._shards])
        else:  # large replies: read concurrently, so no shard's stream waits on flow control
            results = self._each_shard(lambda shard: start(shard)())
        self.last_staleness = results[0][0].staleness
        self._see_version(min(done.version for done, _ in results))
        if not reply:
            return max(done.version for done, _ in results)
        return {name: value for _, arrays in results for name, value in arrays.items()}


def _raise(exc: BaseException):
    raise exc


def _all_or_first_error(calls: list[Callable[[], Any]]) -> list:
    """Runs every call in turn; raises the most telling failure after all ran (see ``_each_shard``)."""
    results, errors = [], []
    for call in calls:
        try:
            results.append(call())
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
    if errors:
        raise next((e for e in errors if not isinstance(e, PeerRefusedError)), errors[0])
    return results


def _rpc(fn, shard):
    """Runs one shard's RPC, converting gRPC errors to client errors (retries happen above)."""
    try:
        return fn(shard)
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from None
