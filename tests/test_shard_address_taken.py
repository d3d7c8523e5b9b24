"""A restarted server's shards serve at new ports, and another service may have taken a shard's
old port meanwhile: a session object that still has the old address meets that service
(UNIMPLEMENTED), reads the shard map again and goes on, instead of failing with an internal error.
Real processes: a durable server SIGKILLed and started again on the same port and directory, and a
real gRPC server (health checking only) listening on the old shard port."""

from __future__ import annotations

import functools
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from optserve.client import Client, UnavailableError
from optserve.client._fanout import Shard, ShardCalls, call_shard
from tests._server_process import ServerProcess, free_port
from tests._service_helpers import InProcess, make_grads, make_params, max_abs_diff

OPTIMIZER = {"name": "adam", "args": {"learning_rate": 0.01}}


def _server(port: int, checkpoint_dir: str) -> ServerProcess:
    return ServerProcess("--checkpoint-dir", checkpoint_dir, "--checkpoint-every-steps", "100",
                         port=port).wait_listening()


def _squat(address: str, timeout_s: float = 30.0) -> grpc.Server:
    """A health-checking gRPC server on ``address``, once the killed shard's process has let it go."""
    deadline = time.monotonic() + timeout_s
    while True:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
        try:
            server.add_insecure_port(address)
        except RuntimeError:
            server.stop(0)
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            continue
        server.start()
        return server


def test_a_shard_address_served_by_another_service_after_a_restart_is_read_again(tmp_path):
    root, port = str(tmp_path / "ckpt"), free_port()
    params = make_params(5)
    reference = InProcess(OPTIMIZER["name"], OPTIMIZER["args"], params)
    first = _server(port, root)
    client = Client(f"127.0.0.1:{port}", timeout=60.0)
    squatter = second = None
    try:
        session = client.create_session("moved", params, optimizer=OPTIMIZER)
        for step in range(2):
            assert max_abs_diff(session.push_pull(make_grads(params, step)), reference.step(make_grads(params, step))) <= 1e-6
        old = [s.address for s in session.info.shards]
        first.kill_group()
        squatter = _squat(old[0])
        second = _server(port, root)
        got = session.push_pull(make_grads(params, 2))
        assert max_abs_diff(got, reference.step(make_grads(params, 2))) <= 1e-6
        assert session.version == 3
    finally:
        client.close()
        first.kill_group()
        if second is not None:
            second.kill_group()
        if squatter is not None:
            squatter.stop(0)


def test_a_step_stream_another_service_ends_while_it_is_written_is_a_moved_shard_whatever_status_grpc_reports():
    """grpc.aio reports INTERNAL ("Internal error from Core") instead of the server's UNIMPLEMENTED
    when a write fails because the server already ended the stream (grpc/grpc#36066: about a
    quarter of these calls here): both are taken for a moved shard, so the shard map is read again
    (test above) instead of the step failing with an internal error. Where the map did not change,
    UNIMPLEMENTED is raised and the lost status retried (a shard restarted at its address ends a
    stream being written so too)."""
    address = f"127.0.0.1:{free_port()}"
    squatter = _squat(address)
    try:
        with Client(address, timeout=10.0) as client:
            calls = ShardCalls(client.channel(address), functools.partial(client.loop_channel, address))
            shard = Shard(0, address, ("w",), calls, None)
            messages = [bytes(1024)] * 64  # a step's chunks, still being written when the service answers
            statuses = set()
            for _ in range(30):
                with pytest.raises(UnavailableError) as caught:
                    call_shard(lambda s: list(s.calls.push_pull(iter(messages), timeout=10.0)), shard)
                unmoved = getattr(caught.value, "unmoved", None)  # raised if the shard map did not change
                statuses.add(None if unmoved is None else unmoved.code)
                assert (unmoved is None) == ("status lost by grpc.aio" in str(caught.value)), caught.value
            assert statuses <= {"UNIMPLEMENTED", None}, statuses
    finally:
        squatter.stop(0)
