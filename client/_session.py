"""A session as the client sees it: the public API, checking its input before anything is sent.

What a call does on the wire is in the modules below this one, in the order a call passes them:

- :mod:`optserve.client._fanout`: the session's shards, calls on all of them in parallel, and
  retries across a shard's recovery (:meth:`~optserve.client._fanout.ShardFanout.served`);
- :mod:`optserve.client._session_tries`: one try of a push or push_pull (its header, int8
  encoding and each attempt), as that retry loop calls it;
- :mod:`optserve.client._paths`: each shard's bytes as gRPC chunks or through its shared-memory
  region (:mod:`optserve.client._shm`);
- :mod:`optserve.protos.tensor_chunks`: tensors encoded as chunk messages (and
  :mod:`optserve.client._wire` for what only the client adds: checked dtype options, int8 error
  feedback, reassembly of pulled chunks).

What a call is given is checked first (:mod:`optserve.client._inputs`); an elastic session's
membership is :mod:`optserve.client._membership`.

Push protocol (see protos/optserve/v1/data.proto): every push is sent with ``auto_commit``: each
shard stages its part and votes at the session clock, which commits the push only if every
shard staged it; so a push applies on all shards or on none, in one round trip per shard.
Each push has a fresh sequence number; retries (UNAVAILABLE) reuse it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import uuid
from typing import Callable, Iterable, Mapping, Optional

import numpy as np

from optserve.client import _fanout, _membership, _paths, _shm, _wire
from optserve.client._inputs import check_worker_id, checked_gradients
from optserve.client._session_tries import SessionTries
from optserve.client._version_view import VersionView
from optserve.client._whole_session import WholeSession
from optserve.client.errors import FutureBaseError, InvalidArgumentError, LateError
from optserve.client.options import SessionOptions
from optserve.client.status import SessionStatus, StepOutcome
from optserve.protos import contract
from optserve.protos.optserve.v1 import control_pb2


class Session(WholeSession):
    """A session of an optserve server. Create with ``Client.create_session`` or ``Client.session``.

    Arrays are NumPy, keyed by tensor name; gradients must have every tensor, in its shape.
    ``wire_dtype`` (None, "float32", "bfloat16", "float16") compresses gradients and pulled
    parameters on the wire; the server keeps the math in float32.

    ``worker_id``: who this object pushes as (1-64 characters, no '/'; default: generated). In an
    elastic sync session (``SessionOptions.elastic``) it is the member id: the object joins at its
    first push or pull (or :meth:`join`), keeps its lease alive in the background and leaves at
    :meth:`leave`, :meth:`close` or :meth:`detach`. ``last_step`` tells what became of the latest
    push (:class:`~optserve.client.status.StepOutcome`: its version, or dropped as late).
    """

    def __init__(self, client, info: control_pb2.SessionInfo, version: int = 0, worker_id: Optional[str] = None):
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
        self._fanout = _fanout.ShardFanout(client, info)
        self.worker_id = check_worker_id(worker_id) if worker_id is not None else uuid.uuid4().hex[:16]
        # this object's push identity (PushHeader; its worker, then this object); not Client.client_id
        self.client_id = f"{self.worker_id}/{uuid.uuid4().hex}"
        self.last_step: Optional[StepOutcome] = None
        self._member = (_membership.Membership(client, self.name, self.worker_id, lambda: self._shards[0].address,
                                               self.options.lease_s) if self.options.elastic else None)
        self._versions = VersionView(version)
        self.last_staleness = 0  # staleness the server assigned to this object's latest push (async)
        self.last_applied_version = 0  # the version this object's latest push_pull went into
        self.last_received_bytes = 0  # tensor bytes the latest push_pull's reply carried (gRPC chunks)
        self._background = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="optserve-async")
        # same-host fast path (client/_shm.py): tensor bytes through shared memory, proven per shard
        self._shm = _shm.SessionRegions(client.shared_memory, client.shard_data, self.name, self.client_id,
                                        self.specs, client.timeout)
        self._paths = _paths.DataPaths(client, self.name, self.specs, self._fanout, self._shm)
        self._paths.sparse_over_senders = info.config.sparse_mean_over_senders
        self._feedback = _wire.ErrorFeedback()  # int8 gradients: per-tensor residuals
        self._tries = SessionTries(self)  # one try of a push / push_pull on the wire (client/_session_tries.py)
        # the tries by their former names (a test resends one header through them, as a retry does)
        self._header, self._push_once, self._push_pull_once = (self._tries.header, self._tries.push_once,
                                                                self._tries.push_pull_once)

    @property
    def _shards(self) -> list[_fanout.Shard]:
        """The session's shards as this object reaches them now (the shard map may be re-read)."""
        return self._fanout.shards

    @property
    def version(self) -> int:
        """The session's version as this object last heard it: raised by push answers, set by
        pulls (lower after a restore rolled back a version this object had pulled)."""
        return self._versions.value

    def pull(self, wire_dtype: _wire.DTypeLike = "default", out: Optional[Mapping[str, np.ndarray]] = None,
             views: bool = False, evaluation: bool = False) -> dict[str, np.ndarray]:
        """Current parameters from every shard (float16 tensors as float16, others float32).

        ``out``: arrays to write into (e.g. the previous result), avoiding fresh allocations.
        ``views``: on shards reached through shared memory, return read-only views of the
        region (no copy; valid until this session object's next step); elsewhere copies.
        ``evaluation``: the parameters to evaluate the model with: schedule-free optimizers
        (``optax.contrib.schedule_free_*``) train one sequence and evaluate another; for other
        optimizers these are the trained parameters (as bytes: a torch model may live in the region).
        """
        wire = self._wire(wire_dtype)
        wire = None if wire in contract.GRADIENT_ONLY else wire  # int8 and sparse encode gradients only
        self._keep_membership()
        mark = self._versions.mark()
        results = self._fanout.served(lambda: self._paths.pull(wire, out, views, evaluation))
        self._versions.settle(min(version for version, _ in results), mark)  # the server's word
        return {name: value for _, arrays in results for name, value in arrays.items()}

    def push(self, grads: Mapping[str, np.ndarray], wire_dtype: _wire.DTypeLike = "default",
             base_version: Optional[int] = None, loss: Optional[float] = None,
             scalars: Optional[Mapping[str, float]] = None, without_gradient: Iterable[str] = ()) -> int:
        """Applies ``grads`` (sync: joins the current step and waits for it); returns the new version.

        ``base_version``: the version of the parameters the gradient was computed from (async
        staleness is measured against it); default: the latest version this object has seen.
        ``loss`` / ``scalars``: telemetry kept with the push's version and staleness
        (``Client.session_series``, ``optserve report``); they never change the update.
        ``without_gradient``: tensors this push has no gradient for (their ``grads`` entries are
        zeros): the step leaves each alone, its parameter and the optimizer state kept under its
        name, as a torch optimizer skips a parameter whose ``.grad`` is None (a sync step: when
        no push of the step had a gradient for it; state shared by several tensors, like a step
        count, moves on).

        Raises:
          InvalidArgumentError, StaleError, ...: the server's refusal; nothing was applied.
        """
        grads = checked_gradients(grads, self.specs, self.name)
        wire = self._wire(wire_dtype)
        grads = self._tries.encode(grads, wire)
        self._keep_membership()

        def tries(header):
            if self._paths.all_via_shm(wire):  # every shard's bytes in shared memory: a step that returns the version
                return self._fanout.served(lambda: self._tries.push_pull_once(header, grads, wire, reply=False))
            return self._fanout.served(lambda: self._tries.push_once(header, grads, wire))

        try:
            version = self._from_current_base(tries, base_version, loss, scalars, without_gradient)
        except LateError as late:
            self._dropped_late(late)
            self.pull()
            return self.version
        self.last_step = StepOutcome(version, None, version)
        return version

    def push_pull(self, grads: Mapping[str, np.ndarray], wire_dtype: _wire.DTypeLike = "default",
                  out: Optional[Mapping[str, np.ndarray]] = None,
                  base_version: Optional[int] = None, loss: Optional[float] = None,
                  scalars: Optional[Mapping[str, float]] = None, views: bool = False,
                  without_gradient: Iterable[str] = (),
                  sparse_base: Optional[tuple[int, Mapping[str, np.ndarray]]] = None) -> dict[str, np.ndarray]:
        """Pushes ``grads`` and returns the parameters of the step they joined (into ``out`` if given).

        ``base_version``, ``loss``, ``scalars``, ``without_gradient``: as for :meth:`push`.
        ``views``: as for :meth:`pull`. ``sparse_base``: with SparseLoCo selections
        (``wire_dtype`` sparse), the ``(version, parameters)`` this client holds: a push based on
        that version may get tensors back as its step's sparse parts, rebuilt here from those
        parameters (``PullRequest.sparse_update``; the shard checks the rebuild is exact).
        """
        grads = checked_gradients(grads, self.specs, self.name)
        wire = self._wire(wire_dtype)
        grads = self._tries.encode(grads, wire)
        self._keep_membership()

        def tries(header):
            return self._fanout.served(lambda: self._tries.push_pull_once(header, grads, wire, out, views=views,
                                                                          sparse_base=sparse_base))

        try:
            params = self._from_current_base(tries, base_version, loss, scalars, without_gradient)
        except LateError as late:
            self._dropped_late(late)
            return self.pull(out=out, views=views)
        self.last_step = StepOutcome(self.last_applied_version, None, self.version)
        return params

    def _from_current_base(self, tries: Callable, base_version: Optional[int], loss, scalars, without_gradient):
        """``tries(header)`` for a fresh push header. A push stamped with this object's own view of
        the version (``base_version`` None) that the session has not reached, because a restore
        rolled back a version this object had pulled, is tried again at once from the session's
        version (the same push and sequence number: the refused try was applied nowhere, and the
        clock does not keep that refusal for its retries); the view is corrected either way."""
        header = self._tries.header(base_version, loss, scalars, without_gradient)
        try:
            return tries(header)
        except FutureBaseError as ahead:
            if ahead.current_version is None:
                raise
            self._set_version(ahead.current_version)
            if base_version is not None:
                raise
            header.base_version = ahead.current_version  # the same push (sequence), a try of its own
            return tries(header)

    def gradient_buffers(self) -> dict[str, np.ndarray]:
        """Float32 arrays, one per tensor, to write gradients into and pass to :meth:`push_pull`
        / :meth:`push`: on shards reached through shared memory they live in a push region that
        no step of this object is using (no copy when pushed), elsewhere they are ordinary arrays.
        While steps take turns every call returns the same arrays; while one is in flight (it
        reads its gradients where they lie until answered: :meth:`push_pull_async`, overlap mode)
        a call returns the other set of a double-buffered pair (a second region per shard):
        call it once per step there, and write the next gradient while the step runs."""
        return self._paths.gradient_buffers()

    def parameter_buffers(self) -> dict[str, np.ndarray]:
        """Writable float32 arrays over the reply part of the region this object's next step uses,
        one per float32 tensor on a shard reached through shared memory: they hold the parameters
        the last call answered through it returned (its ``views``), the next overwrites them in
        place (writing them changes nothing on the server). The torch adapter keeps a model there.
        A region dropped after a failed step is replaced by a fresh one, filled by the next call."""
        return self._paths.parameter_buffers()

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
        """The session's status from the coordinator; each shard's ``data_path`` is how this
        object's bytes reach it ("grpc" for shards not tried yet)."""
        status = self._client.session_status(self.name)
        paths = self._shm.paths()
        return dataclasses.replace(status, shards=[dataclasses.replace(s, data_path=paths.get(s.index, "grpc"))
                                                   for s in status.shards])

    # ----------------------------------------------------------------- elastic membership
    def join(self) -> tuple[str, ...]:
        """Elastic sync: becomes a member now (else at the first push or pull) and keeps the lease
        alive in the background; returns the members. Takes part from the next round.

        Raises:
          ResourceExhaustedError: the session has ``max_workers`` members.
          FailedPreconditionError: not an elastic session.
        """
        if self._member is None:
            raise InvalidArgumentError(f"session {self.name!r} is not elastic (min_workers < num_workers or "
                                       f"max_workers > num_workers): it has no membership to join")
        return self._member.join()

    def leave(self) -> None:
        """Elastic sync: stops being a member now (the open round stops waiting for this worker)."""
        if self._member is not None:
            self._member.leave()

    def _keep_membership(self) -> None:
        """Elastic sessions: the first push or pull joins; from then on the lease is renewed in
        the background (a member computing longer than ``lease_s`` between steps stays one)."""
        if self._member is not None:
            self._member.keep_alive()

    def _dropped_late(self, late: LateError) -> None:
        current = late.current_version if late.current_version is not None else self.version
        self._see_version(current)
        self.last_step = StepOutcome(None, "late", current)

    def close(self) -> None:
        """Closes the session on the server (for every client) and releases local threads."""
        try:
            self.leave()
            self._client.close_session(self.name)
        finally:
            self.detach()

    def detach(self) -> None:
        """Releases this object's threads and open calls without closing the server-side session
        (an elastic session's member leaves)."""
        self.leave()
        self._fanout.close()
        self._paths.close()
        self._background.shutdown(wait=False)

    # ----------------------------------------------------------------- input checking
    def _wire(self, requested) -> Optional[int]:
        """A ``wire_dtype`` argument as a wire enum (None: each tensor's own); "default": the session's."""
        if isinstance(requested, str) and requested == "default":
            return self.wire_dtype
        return _wire.wire_option_enum(requested, what="wire_dtype")

    # ----------------------------------------------------------------- initial values; the version seen
    def _initialize(self, params: Mapping[str, np.ndarray], state: Optional[Mapping] = None) -> None:
        """Sends the session's initial values to its shards (the creating client, once); with
        ``state`` (a checked saved state), the optimizer state, version and hyperparameters too."""
        self._paths.initialize(params, self._client.client_id, state)
        if state is not None:
            self._set_version(int(state["version"]))

    def _see_version(self, version: int) -> None:
        self._versions.see(version)

    def _set_version(self, version: int) -> None:
        self._versions.set(version)
