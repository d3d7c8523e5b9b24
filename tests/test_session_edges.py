"""Session edges: a sync step some worker never joins, staged pushes never committed, refusal logs.

The service cases run against their own server (2 shards, every session on both) with short
timeouts, sharing the run's Ray: ``step_timeout_s`` far below the client's deadline, and a short
``staged_push_ttl_s``. A server gone (its call named by the address the user gave):
tests/test_durability_restart.py.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc
import numpy as np
import pytest

from _service_helpers import make_grads, make_params, max_abs_diff
from optserve.client import Client, DeadlineExceededError
from optserve.protos.optserve.v1 import data_pb2, data_pb2_grpc, tensor_pb2

SGD = {"name": "sgd", "args": {"learning_rate": 0.5}}
STEP_TIMEOUT_S = 3.0
STAGED_TTL_S = 1.0
CLIENT_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def impatient_server(ray_local):
    """A server whose sync steps give up after 3 s and whose staged pushes expire after 1 s."""
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig

    running = start_server(ServerConfig(host="127.0.0.1", port=0, shards=2, min_shard_bytes=0,
                                        step_timeout_s=STEP_TIMEOUT_S, vote_timeout_s=STEP_TIMEOUT_S,
                                        staged_push_ttl_s=STAGED_TTL_S))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(impatient_server):
    with Client(impatient_server.address, timeout=CLIENT_TIMEOUT_S) as c:
        yield c


def test_sync_push_whose_partner_never_pushes_times_out_naming_session_count_and_clients(client, unique_name):
    params = make_params()
    session = client.create_session(unique_name, params, optimizer=SGD, mode="sync", num_workers=2)
    started = time.monotonic()
    with pytest.raises(DeadlineExceededError) as info:
        session.push(make_grads(params, 0))
    waited = time.monotonic() - started
    message = str(info.value)
    assert repr(unique_name) in message
    assert "1 of num_workers=2" in message
    assert repr(session.client_id) in message
    assert waited < STEP_TIMEOUT_S + 5.0 < CLIENT_TIMEOUT_S  # the server's timeout, not the client's deadline
    session.close()


def test_sync_push_gets_the_named_timeout_before_a_shorter_client_deadline(server, unique_name):
    # The shared server waits 300 s for a step; a client with a 5 s deadline still hears the shard's
    # named Timeout (the shard stops waiting just before the call's deadline), not a bare deadline.
    with Client(server.address, timeout=5.0) as short:
        params = make_params()
        session = short.create_session(unique_name, params, optimizer=SGD, mode="sync", num_workers=2)
        with pytest.raises(DeadlineExceededError) as info:
            session.push(make_grads(params, 0))
        assert repr(unique_name) in str(info.value) and "1 of num_workers=2" in str(info.value)
        assert repr(session.client_id) in str(info.value)
        session.close()


# ------------------------------------------------------------------ staged pushes that expire
def _raw_shard(session, tensor_name):
    """(stub, tensor names) of the shard holding ``tensor_name``."""
    for shard in session.info.shards:
        if tensor_name in shard.tensor_names:
            return data_pb2_grpc.ShardDataStub(grpc.insecure_channel(shard.address)), list(shard.tensor_names)
    raise AssertionError(tensor_name)


def _chunk(name, array):
    return tensor_pb2.TensorChunk(name=name, dtype=tensor_pb2.DTYPE_FLOAT32, shape=list(array.shape),
                                  data=np.ascontiguousarray(array, np.float32).tobytes())


def test_staged_push_never_committed_expires_and_its_commit_is_not_found_naming_it(client, unique_name):
    params = make_params()
    victim = client.create_session(unique_name + "-v", params, optimizer=SGD)
    twin = client.create_session(unique_name + "-t", params, optimizer=SGD)
    stub, names = _raw_shard(victim, "dense/w")
    grads = make_grads(params, 7)
    header = data_pb2.PushHeader(session=victim.name, client_id="raw-stager", sequence=1,
                                 base_version=victim.version, auto_commit=False)
    staged = stub.Push(iter([data_pb2.PushRequest(header=header)] +
                            [data_pb2.PushRequest(chunk=_chunk(n, grads[n])) for n in names]), timeout=30)
    assert not staged.committed
    time.sleep(STAGED_TTL_S + 0.5)
    with pytest.raises(grpc.RpcError) as info:
        stub.Commit(data_pb2.CommitRequest(session=victim.name, client_id="raw-stager", sequence=1), timeout=30)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "staged push 1 from client 'raw-stager'" in info.value.details()
    assert "expired" in info.value.details() and "staged_push_ttl_s" in info.value.details()
    assert victim.status().rejected["aborted"] >= 1
    step = make_grads(params, 1)
    assert max_abs_diff(victim.push_pull(step), twin.push_pull(step)) == 0.0
    assert victim.version == twin.version == 1
    victim.close()
    twin.close()


# ------------------------------------------------------------------ in process: one shard session
def _local_session(name="edge", ttl_s=60.0, num_workers=1, limits=None, step_timeout_s=5.0):
    """A one-shard session as the shard actor builds it: HomeClock, Updater, SGD; initialized to ones."""
    from optserve.server.compute.root_offload import build_shard_optimizer
    from optserve.server.compute.updater import Updater
    from optserve.server.domain.clock.home_clock import HomeClock
    from optserve.server.domain.config import DType, SessionConfig, TensorSpec
    from optserve.server.domain.shard.shard_session import ShardSession

    config = SessionConfig(name=name, tensors=(TensorSpec("w", DType.FLOAT32, (4,)),), optimizer_name="sgd",
                           optimizer_args={"learning_rate": 0.5}, num_workers=num_workers)
    optimizer, preconditioners = build_shard_optimizer("sgd", config.optimizer_args, {"w": (4,)}, None)
    session = ShardSession(config, ["w"], 0, HomeClock(config), Updater(optimizer, preconditioners),
                           step_timeout_s=step_timeout_s, vote_timeout_s=5.0, staged_push_ttl_s=ttl_s,
                           limits=limits)
    session.initialize([_chunk("w", np.ones(4, np.float32))])
    return session


def _header(client_id, sequence, base_version, auto_commit=True):
    from optserve.server.domain.shard.shard_session import PushHeader

    return PushHeader(client_id=client_id, sequence=sequence, base_version=base_version, auto_commit=auto_commit)


def test_refused_push_is_logged_once_as_key_values_without_tensor_values(caplog):
    from optserve.server.domain.shard import shard_session
    from optserve.server.domain.errors import Stale

    session = _local_session("logged session")
    session.push(_header("worker-a", 1, 0), [_chunk("w", np.full(4, 0.125, np.float32))])
    caplog.set_level(logging.INFO, logger=shard_session.__name__)
    with pytest.raises(Stale):
        session.push(_header("worker-a", 2, 0), [_chunk("w", np.full(4, 0.375, np.float32))])
    refused = [r for r in caplog.records if r.name == shard_session.__name__ and "event=push_refused" in r.getMessage()]
    assert len(refused) == 1 and refused[0].levelno == logging.INFO
    assert refused[0].getMessage() == ('event=push_refused session="logged session" shard=0 client=worker-a '
                                       'sequence=2 reason=STALE')
    assert "0.375" not in refused[0].getMessage()


def test_a_sync_step_missing_a_worker_says_so_after_a_few_seconds_naming_who_pushed(caplog):
    from optserve.server.domain.shard import apply_queue, step_runner

    session = _local_session("waiting", num_workers=2, step_timeout_s=60.0)
    caplog.set_level(logging.WARNING, logger=apply_queue.__name__)
    pushed = []
    first = threading.Thread(target=lambda: pushed.append(
        session.push(_header("worker-a", 1, 0), [_chunk("w", np.full(4, 0.5, np.float32))])))
    first.start()
    deadline = time.monotonic() + step_runner.WAITING_NOTICE_S + 10

    def notices():
        return [r.getMessage() for r in caplog.records if "event=sync_step_waiting" in r.getMessage()]

    while not notices() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert first.is_alive() and not pushed  # the step still waits for worker-b, long before its timeout
    (notice,) = notices()
    assert "session=waiting shard=0 version=1" in notice and "arrived=1 num_workers=2 clients=worker-a" in notice
    assert float(notice.split("waited_s=")[1].split()[0]) >= step_runner.WAITING_NOTICE_S
    session.push(_header("worker-b", 1, 0), [_chunk("w", np.full(4, 0.5, np.float32))])
    first.join(timeout=30)
    assert pushed and pushed[0].version == 1 and len(notices()) == 1  # said once per step


def test_expired_staged_push_is_dropped_counted_aborted_and_logged(caplog):
    from optserve.server.domain.shard import shard_session
    from optserve.server.domain.errors import NotFound, RejectReason

    session = _local_session(ttl_s=0.05)
    caplog.set_level(logging.INFO, logger=shard_session.__name__)
    session.push(_header("stager", 1, 0, auto_commit=False), [_chunk("w", np.full(4, 9.0, np.float32))])
    time.sleep(0.1)
    receipt = session.push(_header("worker", 1, 0), [_chunk("w", np.full(4, 0.5, np.float32))])  # expires it
    assert receipt.committed and receipt.version == 1

    def dropped() -> bool:  # the staging area's own sweep may have dropped it, from its thread
        return (session.status().rejected.get(RejectReason.ABORTED) == 1
                and any("client=stager sequence=1 reason=ABORTED" in r.getMessage() for r in caplog.records))

    deadline = time.monotonic() + 5
    while not dropped() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dropped()
    with pytest.raises(NotFound, match="staged push 1 from client 'stager' expired"):
        session.commit("stager", 1)
    np.testing.assert_array_equal(session.snapshot()[1]["w"], np.full(4, 0.75, np.float32))  # 1 - 0.5 * 0.5


def test_staged_push_committed_within_its_ttl_applies(caplog):
    session = _local_session(ttl_s=30.0)
    session.push(_header("stager", 1, 0, auto_commit=False), [_chunk("w", np.full(4, 2.0, np.float32))])
    assert session.commit("stager", 1).version == 1
    np.testing.assert_array_equal(session.snapshot()[1]["w"], np.zeros(4, np.float32))


def test_staged_push_ttl_must_be_positive():
    from optserve.server.domain.config import ServerConfig
    from optserve.server.domain.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="--staged-push-ttl-s must be > 0"):
        ServerConfig(staged_push_ttl_s=0)


def test_staged_pushes_past_max_staged_bytes_are_refused_before_allocating_naming_the_limit():
    from optserve.server.domain.config import Limits
    from optserve.server.domain.errors import RejectReason, ResourceExhausted

    session = _local_session(limits=Limits(max_staged_bytes=2 * 16))  # two pushes of one float32[4] each
    for sequence in (1, 2):
        session.push(_header("stager", sequence, 0, auto_commit=False), [_chunk("w", np.full(4, 1.0, np.float32))])
    with pytest.raises(ResourceExhausted, match=r"max_staged_bytes=32 \(server flag --max-staged-bytes\)"):
        session.push(_header("stager", 3, 0, auto_commit=False), [_chunk("w", np.full(4, 1.0, np.float32))])
    assert session.status().rejected[RejectReason.ABORTED] == 1
    assert session.abort("stager", 1)  # room again
    session.push(_header("stager", 3, 0, auto_commit=False), [_chunk("w", np.full(4, 1.0, np.float32))])
    assert session.commit("stager", 3).version == 1


def test_pushes_still_arriving_count_against_max_staged_bytes():
    # A push waiting for its next chunk holds its buffers but no thread: two such pushes fill a
    # room of two, and a third is refused before taking buffers; once they end there is room.
    from concurrent.futures import Future

    from optserve.server.domain.config import Limits
    from optserve.server.domain.errors import ResourceExhausted
    from optserve.server.domain.waits import Wait

    session = _local_session(limits=Limits(max_staged_bytes=2 * 16))  # two pushes of one float32[4] each
    arriving = [session.push_steps(_header("slow", sequence, 0), iter([Wait(Future(), None)])) for sequence in (1, 2)]
    for push in arriving:
        assert isinstance(next(push), Wait)  # received up to its next chunk, which is on its way
    with pytest.raises(ResourceExhausted, match=r"2 pushes staged or arriving.*max_staged_bytes=32"):
        session.push(_header("stager", 3, 0, auto_commit=False), [_chunk("w", np.full(4, 1.0, np.float32))])
    for push in arriving:
        push.close()  # the calls ended: their buffers go back
    session.push(_header("stager", 3, 0, auto_commit=False), [_chunk("w", np.full(4, 1.0, np.float32))])
    assert session.commit("stager", 3).version == 1


def test_float64_params_and_gradients_are_kept_as_float32(server, unique_name):
    params = {"w": np.arange(6, dtype=np.float64).reshape(2, 3)}  # NumPy's default dtype
    with Client(server.address) as client:
        session = client.create_session(unique_name, params, {"name": "sgd", "args": {"learning_rate": 0.5}})
        try:
            assert session.specs["w"][1] == (2, 3)
            got = session.push_pull({"w": np.ones((2, 3))})  # float64 gradient
            assert got["w"].dtype == np.float32
            np.testing.assert_allclose(got["w"], params["w"] - 0.5)
        finally:
            session.close()


def test_a_non_optserve_port_says_so():
    from concurrent import futures

    from optserve.client.errors import OptservError

    other = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = other.add_insecure_port("127.0.0.1:0")
    other.start()
    try:
        with Client(f"127.0.0.1:{port}", timeout=5) as client:
            with pytest.raises(OptservError, match="is it the address `optserve serve` printed"):
                client.list_sessions()
    finally:
        other.stop(None)


def test_expired_staged_pushes_give_their_memory_back_without_further_calls():
    """Two-phase pushes nobody commits expire on their own (no call needs to come) and the freed
    buffers' pages go back to the kernel (the heap would otherwise keep up to 1 GiB of them).
    In a process of its own: resident memory is only meaningful where nothing else allocates."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import os, sys, time
        import numpy as np
        from optserve.protos.optserve.v1 import tensor_pb2
        from optserve.server.compute.heap import keep_large_buffers_on_heap
        from optserve.server.compute.root_offload import build_shard_optimizer
        from optserve.server.compute.updater import Updater
        from optserve.server.domain.clock.home_clock import HomeClock
        from optserve.server.domain.config import DType, SessionConfig, TensorSpec
        from optserve.server.domain.errors import RejectReason
        from optserve.server.domain.shard.shard_session import PushHeader, ShardSession

        def rss_mib():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

        def chunk(values):
            return tensor_pb2.TensorChunk(name="w", dtype=tensor_pb2.DTYPE_FLOAT32, shape=list(values.shape),
                                          data=values.tobytes())

        if not keep_large_buffers_on_heap():  # as the shard processes run
            sys.exit(3)
        n = 4 << 20  # 16 MiB of float32 per push
        config = SessionConfig(name="expiring", tensors=(TensorSpec("w", DType.FLOAT32, (n,)),),
                               optimizer_name="sgd", optimizer_args={"learning_rate": 0.5})
        optimizer, preconditioners = build_shard_optimizer("sgd", config.optimizer_args, {"w": (n,)}, None)
        session = ShardSession(config, ["w"], 0, HomeClock(config), Updater(optimizer, preconditioners),
                               staged_push_ttl_s=1.0)
        session.initialize([chunk(np.ones(n, np.float32))])
        before = rss_mib()
        for sequence in range(1, 13):  # in batches of 5, 4 and 3, so they expire sweep by sweep
            if sequence in (6, 10):
                time.sleep(0.4)
            session.push(PushHeader("stager", sequence, 0, False), [chunk(np.full(n, 1.0, np.float32))])
        staged = rss_mib()
        time.sleep(2.5)  # no call: the staging area's own sweep expires them
        assert session._staging.count == 0
        assert session._refusals.counts[RejectReason.ABORTED] == 12
        print(f"{before:.0f} {staged:.0f} {rss_mib():.0f}")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    if done.returncode == 3:
        pytest.skip("glibc's mallopt is needed")
    assert done.returncode == 0, done.stderr[-3000:]
    before, staged, after = map(float, done.stdout.split())
    assert staged - before > 100
    # 8 of the 12 sets freed (the pool keeps 4), the last sweep's 3 too: the staging area emptied
    assert staged - after > 0.5 * (staged - before), (before, staged, after)
