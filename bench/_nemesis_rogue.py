"""The nemesis's rogue client: garbage and oversize requests against the run's own sessions, each
of which must be refused with the status the docs promise, applying nothing (if one were applied,
the checker would find a push in the history that no worker sent).

A burst (:meth:`Rogue.burst`) sends, to each target session:

- ``nan``: a push of NaN gradients through the SDK, over gRPC and, to the async session, through
  shared memory (INVALID_ARGUMENT: the session does not allow non-finite gradients);
- ``wrong_shape``: a raw Push whose chunk declares a shape the tensor does not have (the SDK would
  refuse it before sending) (INVALID_ARGUMENT);
- ``future_base``: a push through the SDK from a base version 1000 past the session's
  (INVALID_ARGUMENT);
- ``random_bytes``: random bytes as the first message of Push, PushPull and CreateSession (starting
  with a zero byte: field number 0, which no protobuf parser takes) (INVALID_ARGUMENT);
- ``oversize``: a session over ``--max-session-bytes`` and one Push message over the 64 MiB
  message limit (RESOURCE_EXHAUSTED).

SDK pushes go to plain sync and async sessions only: a push to an elastic session would make the
rogue a member its rounds wait for. Raw requests (which join nothing) go to every session.
"""

from __future__ import annotations

import random
import time
import uuid
from typing import Callable, Optional

import grpc
import numpy as np

from bench.checker import CallRecord
from optserve.protos import contract
from optserve.protos.optserve.v1 import control_pb2, data_pb2, tensor_pb2

INVALID = ("INVALID_ARGUMENT",)
TOO_BIG = ("RESOURCE_EXHAUSTED",)


class Rogue:
    """Sends bursts of garbage to the server at ``address``; :attr:`records` logs every call."""

    def __init__(self, address: str, sessions: dict[str, str], max_session_bytes: int, rng: random.Random,
                 timeout_s: float = 20.0):
        """``sessions``: name -> "sync", "async" or "elastic"."""
        self.address, self.sessions, self.max_session_bytes = address, sessions, max_session_bytes
        self.rng, self.timeout_s = rng, timeout_s
        self.records: list[CallRecord] = []
        self.worker = "rogue"

    def burst(self) -> None:
        from optserve.client import Client

        with Client(self.address, timeout=self.timeout_s, shared_memory=False) as grpc_client, \
                Client(self.address, timeout=self.timeout_s, shared_memory=True) as shm_client:
            channel = grpc.insecure_channel(self.address, options=list(contract.CHANNEL_OPTIONS))
            try:
                for name, kind in self.sessions.items():
                    info = grpc_client.control.GetSession(control_pb2.GetSessionRequest(name=name),
                                                          timeout=self.timeout_s).session
                    if kind != "elastic":
                        self._sdk_pushes(grpc_client, name, "nan", _nan)
                        self._sdk_pushes(grpc_client, name, "future_base", None)
                        if kind == "async":
                            self._sdk_pushes(shm_client, name, "nan_shm", _nan)
                    self._raw_pushes(name, info)
                self._call("", "rogue:random_bytes", INVALID, lambda: channel.unary_unary(
                    "/optserve.v1.Control/CreateSession", request_serializer=None, response_deserializer=None)(
                    self._garbage(), timeout=self.timeout_s))
                self._call("", "rogue:oversize", TOO_BIG, lambda: grpc_client.create_session(
                    f"rogue-{uuid.uuid4().hex[:8]}", {"w": np.zeros(self.max_session_bytes // 4 + 1024, np.float32)},
                    {"name": "sgd", "args": {"learning_rate": 0.1}}))
            finally:
                channel.close()

    # ------------------------------------------------------------------ the garbage
    def _sdk_pushes(self, client, name: str, what: str, grads_of: Optional[Callable]) -> None:
        session = client.session(name, worker_id=self.worker)
        try:
            shapes = {n: shape for n, (_, shape) in session.specs.items()}
            if grads_of is not None:
                self._call(name, f"rogue:{what}", INVALID, lambda: session.push(grads_of(shapes)), session.client_id)
            else:
                zeros = {n: np.zeros(s, np.float32) for n, s in shapes.items()}
                self._call(name, f"rogue:{what}", INVALID,
                           lambda: session.push(zeros, base_version=session.version + 1000), session.client_id)
        finally:
            session.detach()

    def _raw_pushes(self, name: str, info) -> None:
        home = info.shards[0]
        # a plain channel without the SDK's send limit: the oversize message must reach the shard
        with grpc.insecure_channel(home.address, options=[("grpc.max_send_message_length", -1)]) as channel:
            self._raw_pushes_on(channel, name, info)

    def _raw_pushes_on(self, stub: grpc.Channel, name: str, info) -> None:
        home = info.shards[0]
        push = stub.stream_unary("/optserve.v1.ShardData/Push", request_serializer=None, response_deserializer=None)
        push_pull = stub.stream_stream("/optserve.v1.ShardData/PushPull", request_serializer=None,
                                       response_deserializer=None)
        tensor = next(t for t in info.config.tensors if t.name == home.tensor_names[0])
        client_id = f"{self.worker}/{uuid.uuid4().hex}"
        header = data_pb2.PushHeader(session=name, client_id=client_id, sequence=1, base_version=0, auto_commit=True)
        wrong = list(tensor.shape) + [2]
        chunk = tensor_pb2.TensorChunk(name=tensor.name, dtype=tensor_pb2.DTYPE_FLOAT32, shape=wrong, offset=0,
                                       data=np.zeros(int(np.prod(wrong)), np.float32).tobytes())
        messages = [data_pb2.PushRequest(header=header).SerializeToString(),
                    data_pb2.PushRequest(chunk=chunk).SerializeToString()]
        self._call(name, "rogue:wrong_shape", INVALID, lambda: push(iter(messages), timeout=self.timeout_s), client_id)
        self._call(name, "rogue:random_bytes", INVALID, lambda: push(iter([self._garbage()]), timeout=self.timeout_s))
        self._call(name, "rogue:random_bytes", INVALID,
                   lambda: list(push_pull(iter([self._garbage()]), timeout=self.timeout_s)))
        huge = tensor_pb2.TensorChunk(name=tensor.name, dtype=tensor_pb2.DTYPE_FLOAT32, shape=list(tensor.shape),
                                      data=b"\0" * (contract.MAX_MESSAGE_BYTES + 4096))
        oversize = [data_pb2.PushRequest(header=header).SerializeToString(),
                    data_pb2.PushRequest(chunk=huge).SerializeToString()]
        self._call(name, "rogue:oversize", TOO_BIG, lambda: push(iter(oversize), timeout=self.timeout_s), client_id)

    def _garbage(self) -> bytes:
        return b"\0" + bytes(self.rng.getrandbits(8) for _ in range(self.rng.randrange(16, 2048)))

    def _call(self, session: str, kind: str, expected: tuple[str, ...], fn: Callable, client_id: str = "") -> None:
        from optserve.client.errors import OptservError

        started, outcome, detail = time.time(), "ok", ""
        try:
            fn()
        except OptservError as error:
            outcome, detail = error.code, str(error)
        except grpc.RpcError as error:
            outcome, detail = error.code().name, error.details() or ""
        except Exception as error:
            outcome, detail = f"exception:{type(error).__name__}", str(error)
        self.records.append(CallRecord(session, self.worker, client_id, 0, 0, kind, started, time.time(), outcome,
                                       None, 2 * self.timeout_s + 8.0, expected, detail[:300]))


def _nan(shapes: dict) -> dict[str, np.ndarray]:
    grads = {n: np.zeros(s, np.float32) for n, s in shapes.items()}
    first = sorted(grads)[0]
    grads[first].reshape(-1)[0] = np.nan
    return grads

