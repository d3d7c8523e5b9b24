"""The gRPC servers' thread pool grows with a burst of calls and gives its threads back after it,
and loses no work while threads come and go."""

from __future__ import annotations

import random
import threading
import time
from concurrent import futures

import grpc

from optserve.server.wire.thread_pool import ShrinkingThreadPool


def _wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_a_burst_of_concurrent_calls_grows_the_pool_and_its_threads_end_after_idling():
    pool = ShrinkingThreadPool(max_workers=32, keep=2, idle_s=0.3, thread_name_prefix="test-pool")
    burst = 16
    together = threading.Barrier(burst, timeout=10)

    def handler(request, context):
        together.wait()  # every call of the burst holds a thread at once
        return request

    server = grpc.server(pool)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", {
        "Echo": grpc.unary_unary_rpc_method_handler(handler)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            echo = channel.unary_unary("/test.Echo/Echo")
            for _ in range(2):  # the pool grows again after it shrank
                with futures.ThreadPoolExecutor(burst) as callers:
                    answers = list(callers.map(lambda i: echo(bytes([i]), timeout=20), range(burst)))
                assert answers == [bytes([i]) for i in range(burst)]
                assert len(pool.threads()) >= burst
                assert _wait_until(lambda: len(pool.threads()) <= 2, 5.0), len(pool.threads())
                assert sum(t.name.startswith("test-pool") for t in threading.enumerate()) <= 2
    finally:
        server.stop(grace=None)


def test_no_work_is_lost_while_threads_end_and_start_all_the_time():
    pool = ShrinkingThreadPool(max_workers=6, keep=0, idle_s=0.005)
    done = []
    lock = threading.Lock()

    def task(i):
        time.sleep(random.random() * 0.002)
        with lock:
            done.append(i)
        return i

    def submitter(offset):
        rng = random.Random(offset)
        results = []
        for i in range(250):
            if rng.random() < 0.1:
                time.sleep(rng.random() * 0.02)  # long enough for idle threads to end
            results.append(pool.submit(task, offset + i))
        return [f.result(timeout=30) for f in results]

    with futures.ThreadPoolExecutor(8) as submitters:
        got = sorted(x for chunk in submitters.map(submitter, range(0, 8000, 1000)) for x in chunk)
    assert got == sorted(o + i for o in range(0, 8000, 1000) for i in range(250))
    assert len(done) == 2000
    pool.shutdown(wait=True)
    assert not pool.threads() or all(not t.is_alive() for t in pool.threads())
