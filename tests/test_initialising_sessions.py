"""Calls on a session whose initial values have not arrived wait a moment, then answer UNAVAILABLE
(the SDK retries): they never hold a shard's threads, and control calls are not queued behind them."""

from __future__ import annotations

import concurrent.futures
import json
import time

import grpc
import pytest

from optserve.client import Client
from optserve.client.errors import UnavailableError
from optserve.protos.optserve.v1 import control_pb2, control_pb2_grpc, tensor_pb2
from tests._service_helpers import make_params

OPTIMIZER = {"name": "adam", "args": {"learning_rate": 0.01}}


@pytest.fixture(scope="module")
def server(ray_local):
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig

    running = start_server(ServerConfig(host="127.0.0.1", port=0, shards=2, min_shard_bytes=0, vote_timeout_s=30.0,
                                        grpc_threads=4))
    yield running
    running.stop()


def _create_without_initial_values(address: str, name: str) -> None:
    """CreateSession alone, as a client that dies before sending InitTensors would leave it."""
    config = control_pb2.SessionConfig(
        name=name, optimizer=control_pb2.OptimizerSpec(name="adam", args_json=json.dumps(OPTIMIZER["args"])),
        mode=control_pb2.MODE_SYNC, num_workers=1,
        tensors=[tensor_pb2.TensorSpec(name=n, dtype=tensor_pb2.DTYPE_FLOAT32, shape=list(v.shape))
                 for n, v in make_params(1).items()])
    with grpc.insecure_channel(address) as channel:
        control_pb2_grpc.ControlStub(channel).CreateSession(
            control_pb2.CreateSessionRequest(config=config, client_id="gone-creator"), timeout=60)


def test_pulls_of_an_initialising_session_answer_unavailable_quickly_and_creates_go_on(server, unique_name):
    _create_without_initial_values(server.address, unique_name)

    def pull() -> float:
        started = time.monotonic()
        with Client(server.address, timeout=3.0) as client:
            with pytest.raises(UnavailableError, match="initial values"):
                client.session(unique_name).pull()
        return time.monotonic() - started

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        pulls = [pool.submit(pull) for _ in range(8)]  # more than the shards' threads
        time.sleep(0.5)
        started = time.monotonic()
        with Client(server.address, timeout=60.0) as client:  # a create and a step behind them
            other = client.create_session(f"{unique_name}-other", make_params(2), optimizer=OPTIMIZER)
            other.push_pull({k: v * 0 for k, v in make_params(2).items()})
            other.close()
        create_s = time.monotonic() - started
        waits = [p.result(timeout=60) for p in pulls]
    assert max(waits) < 10, waits  # the client's 3 s of retries, not the shard's 30 s vote timeout
    assert create_s < 15, create_s
