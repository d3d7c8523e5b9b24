"""The client: connects to a server's coordinator and opens sessions.

    client = Client("127.0.0.1:50051")
    session = client.create_session("run-1", params, optimizer={"name": "adafactor_hf", "args": {}})
    new_params = session.push_pull(grads)
"""

from __future__ import annotations

import json
import threading
from typing import Mapping, Optional

import grpc
import numpy as np

from optserve.client import _retry, _wire
from optserve.client._session import Session
from optserve.client.errors import InvalidArgumentError
from optserve.protos import heap
from optserve.protos.optserve.v1 import control_pb2, control_pb2_grpc, tensor_pb2

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    # A pulled stream may run this far ahead of the chunks already copied out (default 64 KiB).
    ("grpc.http2.lookahead_bytes", 16 << 20),
]

_MODES = {"sync": control_pb2.MODE_SYNC, "async": control_pb2.MODE_ASYNC}
_POLICIES = {"reject": control_pb2.STALENESS_POLICY_REJECT, "scale": control_pb2.STALENESS_POLICY_SCALE}


def _preconditioner_options(spec: Optional[Mapping]) -> control_pb2.PreconditionerOptions:
    """``{"in_process": bool, "max_age": int}`` (both optional) -> the wire message."""
    spec = dict(spec or {})
    unknown = sorted(set(spec) - {"in_process", "max_age"})
    if unknown:
        raise InvalidArgumentError(f"optimizer preconditioners: unknown option {unknown[0]!r} (in_process, max_age)")
    options = control_pb2.PreconditionerOptions(in_process=bool(spec.get("in_process", False)))
    if spec.get("max_age") is not None:
        options.max_age = int(spec["max_age"])
    return options


class Client:
    """A connection to an optserve server.

    Args:
      address: the coordinator's "host:port".
      timeout: per-RPC deadline in seconds (a sync push waits for its step within it).
      chunk_bytes: tensor chunk size on the wire (default 1 MB, clamped to 1-4 MB; 1 MB measured
        fastest: each chunk is copied three times on its way out, best while it is in cache).
      retry: retry policy for UNAVAILABLE.
      stream_idle_s: each session keeps one PushPull call open per shard for consecutive
        ``push_pull`` steps (a few times cheaper than a call per step); a call unused this long is
        ended, freeing the shard's thread, and the next step opens a new one.
      retain_freed_memory: keep freed message memory in this process (glibc malloc thresholds,
        see :mod:`optserve.protos.heap`) instead of page-faulting fresh pages for every received
        chunk; process-wide, costs up to 1 GiB of free heap kept resident. False: leave malloc as is.
    """

    def __init__(self, address: str, *, timeout: float = 120.0, chunk_bytes: Optional[int] = None,
                 retry: _retry.RetryPolicy = _retry.RetryPolicy(), stream_idle_s: float = 10.0,
                 retain_freed_memory: bool = True):
        if not stream_idle_s > 0:
            raise ValueError(f"stream_idle_s must be > 0, got {stream_idle_s}")
        if retain_freed_memory:
            heap.retain_freed_memory()
        self.address = address
        self.timeout = timeout
        self.stream_idle_s = float(stream_idle_s)
        self.chunk_bytes = _wire.chunk_size(chunk_bytes)
        self.retry = retry
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        self._control = control_pb2_grpc.ControlStub(self._channel(address))

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
            return channel

    def _call(self, method, request):
        return _retry.call(lambda: method(request, timeout=self.timeout), self.retry)

    def create_session(
        self,
        name: str,
        params: Mapping[str, np.ndarray],
        optimizer: Mapping,
        mode: str = "sync",
        num_workers: int = 1,
        max_staleness: Optional[int] = None,
        staleness_policy: str = "reject",
        wire_dtype: _wire.DTypeLike = None,
        allow_nonfinite: bool = False,
    ) -> Session:
        """Creates a session holding ``params`` (name -> array; float32/bfloat16/float16).

        Args:
          optimizer: ``{"name": registry name, "args": {keyword arguments}}``; Shampoo also takes
            ``"preconditioners": {"in_process": bool, "max_age": int}`` (where its inverse roots are
            computed and their age bound in steps; see ``PreconditionerOptions`` in control.proto).
          mode: "sync" (a step = mean of ``num_workers`` pushes on one version) or "async".
          max_staleness: async: the largest accepted staleness (None: unlimited).
          staleness_policy: async: "reject" (ABORTED) or "scale" (step * 1 / (1 + staleness)).
          wire_dtype: default wire dtype for gradients and pulls (None: each tensor's own).
          allow_nonfinite: pass NaN/Inf gradients to the optimizer instead of refusing them.

        Raises:
          AlreadyExistsError, InvalidArgumentError (naming the option or tensor).
        """
        if mode not in _MODES:
            raise InvalidArgumentError(f"mode must be 'sync' or 'async', got {mode!r}")
        if staleness_policy not in _POLICIES:
            raise InvalidArgumentError(f"staleness_policy must be 'reject' or 'scale', got {staleness_policy!r}")
        if "name" not in optimizer:
            raise InvalidArgumentError("optimizer must be {'name': ..., 'args': {...}}")
        arrays = {n: np.asarray(v) for n, v in params.items()}
        config = control_pb2.SessionConfig(
            name=name,
            tensors=[tensor_pb2.TensorSpec(name=n, dtype=_wire.array_dtype_enum(a, name=n), shape=list(a.shape))
                     for n, a in arrays.items()],
            optimizer=control_pb2.OptimizerSpec(name=optimizer["name"], args_json=json.dumps(dict(optimizer.get("args") or {})),
                                                preconditioners=_preconditioner_options(optimizer.get("preconditioners"))),
            mode=_MODES[mode],
            num_workers=num_workers,
            max_staleness=-1 if max_staleness is None else max_staleness,
            staleness_policy=_POLICIES[staleness_policy],
            allow_nonfinite=allow_nonfinite,
            wire_dtype=_wire.dtype_enum(wire_dtype, what="wire_dtype") or tensor_pb2.DTYPE_UNSPECIFIED,
        )
        info = self._call(self._control.CreateSession, control_pb2.CreateSessionRequest(config=config)).session
        session = Session(self, info)
        try:
            session._initialize(arrays)
        except BaseException:
            self.close_session(name)
            session.detach()
            raise
        return session

    def session(self, name: str) -> Session:
        """Attaches to an existing session (e.g. after a client restart); version = the server's."""
        info = self._call(self._control.GetSession, control_pb2.GetSessionRequest(name=name)).session
        status = self._call(self._control.GetStatus, control_pb2.GetStatusRequest(name=name))
        return Session(self, info, version=status.version)

    def list_sessions(self) -> list[str]:
        return list(self._call(self._control.ListSessions, control_pb2.ListSessionsRequest()).names)

    def close_session(self, name: str) -> None:
        self._call(self._control.CloseSession, control_pb2.CloseSessionRequest(name=name))

    def close(self) -> None:
        """Closes the channels (sessions stay open on the server)."""
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
