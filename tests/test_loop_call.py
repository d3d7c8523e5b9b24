"""The SDK's grpc.aio stream calls used from threads (client/_loop_call.py) behave as gRPC's
synchronous calls do where the step code relies on it: responses in order, the status and its
trailing metadata, a local cancel's CANCELLED, done callbacks, and a request iterator that blocks
without holding up other calls of the process."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time

import grpc
import pytest

from optserve.client import _loop
from optserve.client._loop_call import WRITES_AHEAD, LoopStreamCall, LoopStreamStream
from optserve.client._step_stream import _LOCAL_CANCELS

_METHOD = "/test.Echo/Chat"


def _chat(requests, context):
    """Answers each request with its upper case; ``fail`` ends the call with a status of its own."""
    for request in requests:
        if request == b"fail":
            context.set_trailing_metadata((("why", "asked"),))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "asked to fail")
        yield request.upper()


@pytest.fixture(scope="module")
def echo_address():
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=8))
    handler = grpc.method_handlers_generic_handler("test.Echo", {"Chat": grpc.stream_stream_rpc_method_handler(_chat)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


@pytest.fixture(scope="module")
def echo_channel(echo_address):
    """``() -> grpc.aio.Channel`` to the echo server, opened on the loop's thread at first use."""
    loop = _loop.shared()
    channels = []

    def channel():
        if not channels:
            channels.append(grpc.aio.insecure_channel(echo_address))
        return channels[0]

    yield channel
    if channels:
        loop.run(channels[0].close())


@pytest.fixture(scope="module")
def chat(echo_channel):
    return LoopStreamStream(echo_channel, _METHOD, request_serializer=None, response_deserializer=None, fallback=None)


def _ended(call) -> threading.Event:
    seen = threading.Event()
    call.add_done_callback(lambda c: seen.set())
    return seen


def test_responses_arrive_in_order_and_the_done_callback_sees_ok(chat):
    call = chat(iter([b"a", b"b", b"c"]), timeout=10.0)
    ended = _ended(call)
    assert list(call) == [b"A", b"B", b"C"]
    assert ended.wait(5.0) and call.done() and call.code() == grpc.StatusCode.OK
    late = threading.Event()
    call.add_done_callback(lambda c: late.set())  # after the end: at once, in this thread
    assert late.is_set()


def test_a_failed_call_raises_its_status_with_the_trailing_metadata(chat):
    call = chat(iter([b"x", b"fail"]), timeout=10.0)
    assert next(call) == b"X"
    with pytest.raises(grpc.RpcError) as raised:
        next(call)
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert raised.value.details() == "asked to fail"
    assert ("why", "asked") in tuple(raised.value.trailing_metadata())
    assert call.code() == grpc.StatusCode.FAILED_PRECONDITION and ("why", "asked") in call.trailing_metadata()


def test_a_cancel_from_another_thread_ends_a_waiting_read_with_a_local_cancelled(chat):
    requests: queue.SimpleQueue = queue.SimpleQueue()
    call = chat(iter(requests.get, None), timeout=30.0)
    requests.put(b"hello")
    assert next(call) == b"HELLO"
    timer = threading.Timer(0.3, call.cancel)
    timer.start()
    with pytest.raises(grpc.RpcError) as raised:
        next(call)  # nothing comes: it waits until the cancel
    assert raised.value.code() == grpc.StatusCode.CANCELLED and raised.value.details() in _LOCAL_CANCELS
    assert call.code() == grpc.StatusCode.CANCELLED and call.details() in _LOCAL_CANCELS
    requests.put(None)  # the request thread ends


def test_a_request_iterator_that_blocks_holds_up_no_other_call(chat):
    requests: queue.SimpleQueue = queue.SimpleQueue()
    waiting = chat(iter(requests.get, None), timeout=30.0)  # its request thread blocks on the queue
    other = chat(iter([b"q"]), timeout=10.0)
    assert list(other) == [b"Q"]
    requests.put(b"late")
    requests.put(None)
    assert list(waiting) == [b"LATE"]


def test_a_call_past_its_deadline_raises_deadline_exceeded(chat):
    requests: queue.SimpleQueue = queue.SimpleQueue()
    call = chat(iter(requests.get, None), timeout=0.3)
    with pytest.raises(grpc.RpcError) as raised:
        next(call)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    requests.put(None)


@pytest.mark.parametrize("error", [ValueError, RuntimeError])
def test_requests_that_raise_cancel_the_call(chat, error):
    def requests():
        yield b"one"
        raise error("a request could not be made")

    call = chat(requests(), timeout=10.0)
    with pytest.raises(grpc.RpcError) as raised:
        list(call)
    assert raised.value.code() == grpc.StatusCode.CANCELLED


def test_a_call_over_before_it_is_handed_back_still_runs_its_done_callbacks(echo_channel):
    """A call can end on the loop (refused, past its deadline) before the thread that made it is
    handed it back; its end must still be seen: status set, done callbacks run."""

    async def open_ended(timeout):
        call = echo_channel().stream_stream(_METHOD)(timeout=timeout)
        await call.done_writing()
        await call.code()  # over before LoopStreamCall has it
        return call

    def senders() -> int:
        return sum(1 for t in threading.enumerate() if t.name == "optserve-send")

    before = senders()
    for _ in range(10):  # more requests than the writer takes ahead: the request thread must see the end
        call = LoopStreamCall(_loop.shared(), open_ended, iter([b"x"] * (2 * WRITES_AHEAD)), 10.0)
        assert _ended(call).wait(5.0) and call.done()
        assert call.code() == grpc.StatusCode.OK
    deadline = time.monotonic() + 5.0
    while senders() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert senders() <= before  # no request thread left waiting for room in a call that ended
