"""A servicer method whose client went away before it answered ends quietly: no response to
serialize (gRPC logged "Exception serializing message!" with a traceback for every such call, e.g.
each oversize push a shard refused after its client had given up), and the server serves on.

A real gRPC server on loopback serving a method through the servicers' own decorator."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time

import grpc
import pytest

from optserve.server.domain.errors import InvalidArgument
from optserve.server.wire.errors import grpc_errors

_METHOD = "/optserve.test.Slow/Call"


class _Slow:
    def __init__(self):
        self.refused = threading.Event()

    @grpc_errors
    def Call(self, request, context):  # noqa: N802 - gRPC's method name
        deadline = time.monotonic() + 10
        while context.is_active() and time.monotonic() < deadline:  # until the client gave up
            time.sleep(0.01)
        self.refused.set()
        raise InvalidArgument("refused after the client left")


def test_a_refusal_after_the_client_left_serializes_nothing_and_the_server_serves_on(caplog):
    servicer = _Slow()
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
    handler = grpc.unary_unary_rpc_method_handler(servicer.Call, request_deserializer=bytes,
                                                  response_serializer=lambda message: message.SerializeToString())
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("optserve.test.Slow", {"Call": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with caplog.at_level(logging.ERROR, logger="grpc"), grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(_METHOD, request_serializer=bytes, response_deserializer=bytes)
            with pytest.raises(grpc.RpcError) as gone:
                call(b"x", timeout=0.3)
            assert gone.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            assert servicer.refused.wait(10)
            time.sleep(0.3)  # the handler's end is processed
            servicer.refused.clear()
            with pytest.raises(grpc.RpcError) as again:  # the server still answers
                call(b"y", timeout=0.3)
            assert again.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            assert servicer.refused.wait(10)
            time.sleep(0.3)
        serializing = [r for r in caplog.records if "serializing" in r.getMessage()]
        assert not serializing, serializing[0].getMessage()
    finally:
        server.stop(0)
