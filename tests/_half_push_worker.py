"""A pusher of an elastic session that dies in the middle of a step (tests/test_elastic_processes.py).

    python -m tests._half_push_worker SHARD_ADDRESS SESSION TENSOR ROWS COLS

Speaks raw gRPC to the session's only shard, as worker ``half``: on one PushPull call, a whole
one-message step (its push joins the session; prints ``acked <version>`` once answered), then the
header and half the bytes of a streamed step; prints ``half`` and waits to be killed.
"""

from __future__ import annotations

import sys
import threading

import grpc
import numpy as np

from optserve.protos.optserve.v1 import data_pb2, data_pb2_grpc, tensor_pb2

F32 = tensor_pb2.DTYPE_FLOAT32


def main(address: str, session: str, tensor: str, rows: int, cols: int) -> None:
    grad = np.full((rows, cols), 0.5, np.float32)
    answered = threading.Event()

    def header(sequence: int, base_version: int) -> data_pb2.PushHeader:
        return data_pb2.PushHeader(session=session, client_id="half", sequence=sequence, base_version=base_version,
                                   auto_commit=True)

    def chunk(values: np.ndarray) -> tensor_pb2.TensorChunk:
        return tensor_pb2.TensorChunk(name=tensor, dtype=F32, shape=[rows, cols], offset=0, data=values.tobytes())

    versions: list[int] = []

    def requests():
        yield data_pb2.PushPullRequest(step=data_pb2.PushPullStep(header=header(1, 0), chunks=[chunk(grad)]))
        answered.wait()
        yield data_pb2.PushPullRequest(header=header(2, versions[0]))
        yield data_pb2.PushPullRequest(chunk=chunk(grad.reshape(-1)[: grad.size // 2]))
        print("half", flush=True)
        threading.Event().wait()  # the rest never comes: this process is killed first

    stub = data_pb2_grpc.ShardDataStub(grpc.insecure_channel(address))
    for response in stub.PushPull(requests()):
        versions.append(response.step_result.done.version)
        print(f"acked {versions[0]}", flush=True)
        answered.set()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
