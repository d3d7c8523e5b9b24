"""Long-lived PushPull calls: reuse across steps, idle ends, and shards that end calls when crowded."""

from __future__ import annotations

import concurrent.futures
import time

import numpy as np
import pytest

from optserve.client import Client
from optserve.protos.optserve.v1 import data_pb2, data_pb2_grpc

from _service_helpers import InProcess, make_grads, make_params

OPTIMIZER = {"name": "adafactor_hf", "args": {"lr": 1e-2, "scale_parameter": False, "relative_step": False}}


def test_push_pull_steps_match_in_process_across_an_idle_end_of_the_stream(server, unique_name):
    client = Client(server.address, stream_idle_s=0.2)
    params = make_params()
    session = client.create_session(unique_name, params, optimizer=OPTIMIZER)
    reference = InProcess(OPTIMIZER["name"], OPTIMIZER["args"], params)
    try:
        for step in range(6):
            if step == 3:
                time.sleep(0.8)  # the open calls end while idle; the next step opens new ones
            result = session.push_pull(make_grads(params, step))
            expected = reference.step(make_grads(params, step))
            for name in params:
                np.testing.assert_allclose(result[name], expected[name], rtol=0, atol=1e-6, err_msg=name)
        assert session.status().steps_applied == 6
    finally:
        session.close()
        client.close()


def test_stream_idle_time_must_be_positive(server):
    with pytest.raises(ValueError, match="stream_idle_s"):
        Client(server.address, stream_idle_s=0)


@pytest.fixture(scope="module")
def few_thread_server(ray_local):
    """One shard whose data plane has 4 threads and holds at most 2 PushPull calls open."""
    from optserve.server.app import start_server
    from optserve.server.domain.config import Limits, ServerConfig

    running = start_server(ServerConfig(host="127.0.0.1", port=0, shards=1, grpc_threads=4,
                                        limits=Limits(max_open_streams=2)))
    yield running
    running.stop()


def test_more_clients_than_open_calls_allowed_all_step_because_crowded_streams_end(few_thread_server, unique_name):
    # Six clients keep stepping on a shard that holds 2 PushPull calls open. Their calls would
    # stay open 600 s idle; the shard ends the calls past 2 after each step (and idle ones), so
    # every client steps in turn, each step applied once.
    workers, steps = 6, 5
    params = make_params()
    owner = Client(few_thread_server.address)
    owner.create_session(unique_name, params, optimizer=OPTIMIZER, mode="async")
    _step_together(few_thread_server.address, unique_name, owner, params, workers, steps,
                   timeout=5.0, stream_idle_s=600.0)
    status = owner.session(unique_name).status()
    assert status.steps_applied == workers * steps
    assert status.rejected.get("aborted", 0) == 0
    owner.close_session(unique_name)
    owner.close()


def _step_together(address: str, name: str, owner: Client, params: dict, workers: int, steps: int,
                   **client_args) -> list[float]:
    """``workers`` clients (each its own Client) step session ``name`` ``steps`` times at once;
    returns every step's time. Each client detaches and closes at the end (the owner too, on failure)."""
    clients = [Client(address, **client_args) for _ in range(workers)]
    sessions = [c.session(name) for c in clients]

    def train(index: int) -> list[float]:
        took = []
        for step in range(steps):
            started = time.monotonic()
            sessions[index].push_pull(make_grads(params, step, seed=index + 2))
            took.append(time.monotonic() - started)
        return took

    try:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            return [t for times in pool.map(train, range(workers)) for t in times]
    except BaseException:
        owner.close_session(name)
        owner.close()
        raise
    finally:
        for session in sessions:
            session.detach()
        for c in clients:
            c.close()


def test_idle_open_streams_never_stop_a_new_client_from_stepping(few_thread_server, unique_name):
    # The shard holds 2 PushPull calls open. Three SDK clients step once and keep their calls
    # open (idle 600 s), and six raw calls open and never send a thing: together they would hold
    # the open calls until their deadlines (minutes). The shard ends idle calls past 2,
    # so a new client creates and steps its own session within seconds, and the idle clients step
    # again on new calls, each step applied once.
    import threading

    import grpc


    params = make_params()
    idle_clients = [Client(few_thread_server.address, timeout=30.0, stream_idle_s=600.0) for _ in range(3)]
    owner = idle_clients[0]
    owner.create_session(unique_name, params, optimizer=OPTIMIZER, mode="async")
    sessions = [c.session(unique_name) for c in idle_clients]
    for index, session in enumerate(sessions):
        session.push_pull(make_grads(params, 0, seed=index + 2))
    never = threading.Event()
    channel = grpc.insecure_channel(few_thread_server.shard_addresses[0])
    raw_calls = _silent_calls(channel, 6, never, timeout_s=300)
    newcomer = Client(few_thread_server.address, timeout=15.0)
    try:
        time.sleep(1.0)  # every open call is idle by now
        started = time.monotonic()
        session = newcomer.create_session(f"{unique_name}-new", params, optimizer=OPTIMIZER)
        reference = InProcess(OPTIMIZER["name"], OPTIMIZER["args"], params)
        for step in range(3):
            result = session.push_pull(make_grads(params, step))
            np.testing.assert_allclose(result["dense/w"], reference.step(make_grads(params, step))["dense/w"],
                                       rtol=0, atol=1e-6)
        assert time.monotonic() - started < 10.0
        session.close()
        for index, idle in enumerate(sessions):  # their calls were ended while idle: they reopen
            idle.push_pull(make_grads(params, 1, seed=index + 2))
        status = sessions[0].status()
        assert status.steps_applied == 6 and status.pushes_accepted == 6
    finally:
        never.set()
        for call in raw_calls:
            call.cancel()
        channel.close()
        for session in sessions[1:]:
            session.detach()
        owner.close_session(unique_name)
        for c in idle_clients + [newcomer]:
            c.close()


def test_a_tenant_past_max_streams_per_tenant_is_refused_a_new_stream_naming_the_limit(ray_local, unique_name):
    import threading

    import grpc

    from optserve.client import ResourceExhaustedError
    from optserve.server.app import start_server
    from optserve.server.domain.config import Limits, ServerConfig

    server = start_server(ServerConfig(host="127.0.0.1", port=0, shards=1, min_shard_bytes=0,
                                       limits=Limits(max_streams_per_tenant=2)))
    never = threading.Event()
    channel = grpc.insecure_channel(server.shard_addresses[0])
    held = _silent_calls(channel, 2, never, timeout_s=60)
    client = Client(server.address, timeout=30.0)
    try:
        time.sleep(0.5)  # both calls are open on the shard
        params = make_params()
        session = client.create_session(unique_name, params, optimizer=OPTIMIZER)
        with pytest.raises(ResourceExhaustedError, match=r"max_streams_per_tenant=2 \(server flag "
                                                         r"--max-streams-per-tenant\)"):
            session.push_pull(make_grads(params, 0))
        never.set()
        for call in held:
            call.cancel()
        time.sleep(0.5)
        session.push_pull(make_grads(params, 0))  # the tenant's calls ended: room again
        assert session.status().steps_applied == 1
        session.close()
    finally:
        never.set()
        channel.close()
        client.close()
        server.stop()


def _silent_calls(channel, count: int, never, timeout_s: float) -> list:
    """``count`` raw PushPull calls on ``channel`` that open and send nothing until ``never`` is set."""
    from optserve.protos.optserve.v1 import data_pb2_grpc

    def silent():
        never.wait()
        yield from ()

    return [data_pb2_grpc.ShardDataStub(channel).PushPull(silent(), timeout=timeout_s) for _ in range(count)]


@pytest.fixture(scope="module")
def crowded_pair(ray_local):
    """Two shards whose data planes have 4 threads and 2 open PushPull calls each, and the
    default 30 s vote timeout: a step stuck on one shard's vote would show as a 30 s stall."""
    from optserve.server.app import start_server
    from optserve.server.domain.config import Limits, ServerConfig

    running = start_server(ServerConfig(host="127.0.0.1", port=0, shards=2, grpc_threads=4, min_shard_bytes=0,
                                        limits=Limits(max_open_streams=2)))
    yield running
    running.stop()


def test_a_step_whose_idle_call_a_crowded_shard_ended_does_not_wait_for_the_vote_timeout(crowded_pair, unique_name):
    # The client's open calls idle on both shards; a crowd on shard 0 makes it end the client's
    # call there. The next step finds that call ended (the step never started on shard 0) while
    # shard 1 staged its part and waits for shard 0's vote: the SDK sends shard 0's part again at
    # once instead of retrying the whole step after shard 1's vote timed out (30 s).
    import threading

    import grpc

    params = make_params()
    client = Client(crowded_pair.address, timeout=60.0, stream_idle_s=600.0)
    session = client.create_session(unique_name, params, optimizer=OPTIMIZER, mode="async")
    assert len(session.status().shards) == 2
    session.push_pull(make_grads(params, 0))  # both calls open, then idle
    never = threading.Event()
    channel = grpc.insecure_channel(crowded_pair.shard_addresses[0])
    raw_calls = _silent_calls(channel, 2, never, timeout_s=120)
    try:
        time.sleep(1.5)  # shard 0 is crowded: it ends the client's idle call (served, idle > 0.5 s)
        started = time.monotonic()
        session.push_pull(make_grads(params, 1))
        assert time.monotonic() - started < 10.0
        assert session.status().steps_applied == 2
    finally:
        never.set()
        for call in raw_calls:
            call.cancel()
        channel.close()
        session.close()
        client.close()


@pytest.fixture(scope="module")
def four_thread_pair(ray_local):
    """Two shards whose data planes and clocks have 4 threads each, votes refused after 10 s."""
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig

    running = start_server(ServerConfig(host="127.0.0.1", port=0, shards=2, grpc_threads=4, min_shard_bytes=0,
                                        vote_timeout_s=10.0))
    yield running
    running.stop()


def test_a_sync_step_of_sixteen_workers_completes_on_shards_of_four_threads(four_thread_pair, unique_name):
    # Every worker's part waits on both shards for its vote and then for the step's other 15
    # pushes. A part that held a thread while it waits would leave the fifth worker's parts
    # queued behind four waiting ones: its vote refused after 10 s, the step never complete.
    # The waits hold no thread, so each step completes in well under the vote timeout.
    workers, steps = 16, 3
    params = make_params()
    owner = Client(four_thread_pair.address)
    owner.create_session(unique_name, params, optimizer=OPTIMIZER, mode="sync", num_workers=workers)
    took = _step_together(four_thread_pair.address, unique_name, owner, params, workers, steps, timeout=60.0)
    status = owner.session(unique_name).status()
    assert status.version == steps
    assert sum(status.rejected.values()) == 0, status.rejected
    assert max(took) < 10.0, f"a step waited {max(took):.1f} s: as long as a vote timeout"
    owner.close_session(unique_name)
    owner.close()


def _stalled(stub_call, session: str, count: int, never, one_message) -> list:
    """``count`` raw calls (``stub_call``: a ShardData stub's Push or PushPull) that each send a
    push's header and then nothing until ``never`` is set."""
    def stalled(index: int):
        yield one_message(data_pb2.PushHeader(session=session, client_id=f"stalled-{index}/0", sequence=1,
                                              auto_commit=True))
        never.wait()

    return [stub_call(stalled(index), timeout=120) for index in range(count)]


def _steps_go_on(four_thread_pair, unique_name, stall) -> None:
    """A client's three steps on an async session finish within seconds while ``stall(channel,
    session, never)`` holds raw calls open on shard 0."""
    import threading

    import grpc

    params = make_params()
    client = Client(four_thread_pair.address, timeout=30.0, shared_memory=False)
    session = client.create_session(unique_name, params, optimizer=OPTIMIZER, mode="async")
    assert len(session.status().shards) == 2
    session.push_pull(make_grads(params, 0))
    never = threading.Event()
    channel = grpc.insecure_channel(four_thread_pair.shard_addresses[0])
    calls = stall(channel, unique_name, never)
    try:
        time.sleep(1.0)  # every stalled call waits for its chunks on shard 0
        started = time.monotonic()
        for step in range(1, 4):
            session.push_pull(make_grads(params, step))
        assert time.monotonic() - started < 10.0
        assert session.status().steps_applied == 4
    finally:
        never.set()
        for call in calls:
            call.cancel()
        channel.close()
        session.close()
        client.close()


def test_streamed_pushes_waiting_for_their_chunks_hold_no_step_thread(four_thread_pair, unique_name):
    # Eight raw PushPull calls each start a streamed push and send no chunk: twice as many as
    # shard 0's 4 step threads. A step waiting for its next message holds no thread, so a
    # client's steps go on (were each stalled step to hold a thread while it reads, the client's
    # steps would queue behind them until those calls end, 120 s).
    stall = lambda channel, session, never: _stalled(  # noqa: E731
        data_pb2_grpc.ShardDataStub(channel).PushPull, session, 8, never,
        lambda header: data_pb2.PushPullRequest(header=header))
    _steps_go_on(four_thread_pair, unique_name, stall)


def test_steps_go_on_while_every_unary_thread_waits_for_a_streamed_push(four_thread_pair, unique_name):
    # Four raw unary Push calls each send a header and no chunk: a unary handler reads its
    # messages in its thread, so they hold shard 0's 4 threads for unary calls. PushPull's steps
    # run in a pool of their own and go on (in one shared pool they would wait for a thread).
    stall = lambda channel, session, never: _stalled(  # noqa: E731
        data_pb2_grpc.ShardDataStub(channel).Push.future, session, 4, never,
        lambda header: data_pb2.PushRequest(header=header))
    _steps_go_on(four_thread_pair, unique_name, stall)
