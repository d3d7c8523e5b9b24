"""Edges of the server: statuses for bad requests, and limits checked before anything is allocated.

One server for the module, with small limits (a 4 MiB memory budget per shard, 40,000 tensors, 4
sessions per tenant, ...), speaking raw gRPC where the SDK would refuse the request itself.
Every case checks that nothing was left behind: no session listed, the budget whole again.
"""

from __future__ import annotations

import gc
import time

import grpc
import pytest

from _service_helpers import make_grads, make_params
from optserve.client import Client, ResourceExhaustedError
from optserve.protos.optserve.v1 import control_pb2, control_pb2_grpc, tensor_pb2

SGD = control_pb2.OptimizerSpec(name="sgd", args_json='{"learning_rate": 0.1}')
ADAM = control_pb2.OptimizerSpec(name="adam", args_json='{"learning_rate": 0.1}')
ADAFACTOR = control_pb2.OptimizerSpec(name="adafactor", args_json='{"learning_rate": 0.1}')
F32 = tensor_pb2.DTYPE_FLOAT32
BUDGET = 4 << 20  # bytes per shard; a float32 element of Adam is estimated at 16 bytes (param, 2 state, 1 grad)
MAX_TENSORS = 40_000
MAX_SESSIONS = 4


@pytest.fixture(scope="module")
def limited_server(ray_local):
    from optserve.server.app import start_server
    from optserve.server.domain.config import Limits, ServerConfig

    limits = Limits(max_session_bytes=64 << 20, shard_memory_bytes=BUDGET, max_tensors=MAX_TENSORS,
                    max_tensor_name_bytes=100, max_tensor_rank=8, max_metadata_bytes=8 << 10, max_json_depth=16,
                    max_sessions_per_tenant=MAX_SESSIONS)
    running = start_server(ServerConfig(host="127.0.0.1", port=0, shards=2, min_shard_bytes=0, vote_timeout_s=3.0,
                                        limits=limits))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def control_with_workers(ray_local):
    """A server like ``limited_server`` with a preconditioner worker (roots exchanged with it)."""
    from optserve.server.app import start_server
    from optserve.server.domain.config import Limits, ServerConfig

    running = start_server(ServerConfig(host="127.0.0.1", port=0, shards=1, min_shard_bytes=0, precond_workers=1,
                                        limits=Limits(shard_memory_bytes=BUDGET)))
    with grpc.insecure_channel(running.address) as ch:
        yield control_pb2_grpc.ControlStub(ch)
    running.stop()


@pytest.fixture(scope="module")
def channel(limited_server):
    with grpc.insecure_channel(limited_server.address) as ch:
        yield ch


@pytest.fixture(scope="module")
def control(channel):
    return control_pb2_grpc.ControlStub(channel)


def _config(name, shapes, optimizer=SGD, names=None):
    names = names or [f"t{i}" for i in range(len(shapes))]
    return control_pb2.SessionConfig(
        name=name, optimizer=optimizer, mode=control_pb2.MODE_SYNC, num_workers=1,
        tensors=[tensor_pb2.TensorSpec(name=n, dtype=F32, shape=list(s)) for n, s in zip(names, shapes)])


def _create(control, config) -> grpc.RpcError | None:
    try:
        control.CreateSession(control_pb2.CreateSessionRequest(config=config, client_id="limits-test"), timeout=60)
    except grpc.RpcError as error:
        return error
    return None


def _listed(control) -> list[str]:
    return list(control.ListSessions(control_pb2.ListSessionsRequest(), timeout=30).names)


def _refused(control, config, code, *fragments):
    """Creating ``config`` is refused with ``code`` naming ``fragments``, and leaves nothing behind."""
    error = _create(control, config)
    assert error is not None, f"{config.name} was created"
    assert error.code() == code, error.details()
    for fragment in fragments:
        assert fragment in error.details()
    assert config.name not in _listed(control)
    return error


# ----------------------------------------------------------------------------- statuses

CONTROL_METHODS = [m.name for m in control_pb2.DESCRIPTOR.services_by_name["Control"].methods]
DATA_UNARY = ["Commit", "Abort"]
DATA_CLIENT_STREAMS = ["InitTensors", "Push"]
GARBAGE = [b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x12\x80\x80\x80\x80\x10", b"\x32\x03\x0a\x01"]


@pytest.fixture(scope="module")
def anchor(limited_server):
    """An initialized session (on both shards) the data-plane cases address."""
    with Client(limited_server.address, timeout=60) as client:
        session = client.create_session("statuses-anchor", make_params(),
                                         optimizer={"name": "sgd", "args": {"learning_rate": 0.1}})
        yield session
        session.close()


@pytest.fixture(scope="module")
def shard_channel(anchor):
    with grpc.insecure_channel(anchor.info.shards[0].address) as ch:
        yield ch


@pytest.mark.parametrize("garbage", GARBAGE, ids=["ff", "truncated-string", "huge-length", "bad-nested"])
def test_undecodable_requests_are_invalid_argument_on_every_rpc(channel, shard_channel, garbage):
    def code_of(call):
        try:
            result = call()
            if hasattr(result, "__iter__") and not isinstance(result, bytes):
                list(result)
        except grpc.RpcError as error:
            return error.code(), error.details()
        return grpc.StatusCode.OK, ""

    outcomes = {}
    for method in CONTROL_METHODS:
        rpc = channel.unary_unary(f"/optserve.v1.Control/{method}")
        outcomes[f"Control/{method}"] = code_of(lambda: rpc(garbage, timeout=10))
    for method in DATA_UNARY:
        rpc = shard_channel.unary_unary(f"/optserve.v1.ShardData/{method}")
        outcomes[method] = code_of(lambda: rpc(garbage, timeout=10))
    pull = shard_channel.unary_stream("/optserve.v1.ShardData/Pull")
    outcomes["Pull"] = code_of(lambda: pull(garbage, timeout=10))
    for method in DATA_CLIENT_STREAMS:
        rpc = shard_channel.stream_unary(f"/optserve.v1.ShardData/{method}")
        outcomes[method] = code_of(lambda: rpc(iter([garbage]), timeout=10))
    push_pull = shard_channel.stream_stream("/optserve.v1.ShardData/PushPull")
    outcomes["PushPull"] = code_of(lambda: push_pull(iter([garbage]), timeout=10))
    wrong = {m: o for m, o in outcomes.items() if o[0] is not grpc.StatusCode.INVALID_ARGUMENT}
    # Some garbage decodes into a valid (empty or unknown-field) message: then the request itself
    # is refused by the servicer, never with UNKNOWN or INTERNAL.
    assert all(code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.OK)
               for code, _ in wrong.values()), wrong
    if garbage == b"\xff\xff\xff\xff":
        assert not wrong, wrong
        assert all("could not be parsed" in details for _, details in outcomes.values())


def test_undecodable_chunk_after_a_good_header_is_invalid_argument_and_applies_nothing(shard_channel, anchor):
    from optserve.protos.optserve.v1 import data_pb2

    header = data_pb2.PushRequest(header=data_pb2.PushHeader(session="statuses-anchor", client_id="c", sequence=1,
                                                             base_version=0)).SerializeToString()
    truncated_chunk = b"\x12\x10\x0a\x02t0\x10\x01"  # a chunk field claiming 16 bytes, holding 6
    push = shard_channel.stream_unary("/optserve.v1.ShardData/Push")
    with pytest.raises(grpc.RpcError) as info:
        push(iter([header, truncated_chunk]), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert "could not be parsed" in info.value.details()
    assert anchor.status().steps_applied == 0


@pytest.mark.parametrize("depth", [100, 900, 100_000])
def test_deeply_nested_optimizer_args_are_invalid_argument_naming_the_limit(control, depth):
    nested = '{"learning_rate": 0.1, "momentum": ' + "[" * depth + "]" * depth + "}"
    config = _config(f"deep-json-{depth}", [(4,)], control_pb2.OptimizerSpec(name="sgd", args_json=nested))
    _refused(control, config, grpc.StatusCode.INVALID_ARGUMENT, "max_json_depth=16", "--max-json-depth")
    expect = control_pb2.GetSessionRequest(name="statuses-anchor", expect_optimizer=config.optimizer)
    with pytest.raises(grpc.RpcError) as info:
        control.GetSession(expect, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_shape_of_2_62_elements_is_invalid_argument_and_leaves_no_ghost_session(control):
    config = _config("ghost-2-62", [(1 << 31, 1 << 31), (4,)])
    _refused(control, config, grpc.StatusCode.INVALID_ARGUMENT, "'t0'", "int64")
    assert _create(control, _config("ghost-2-62", [(4,)])) is None  # the name is free
    control.CloseSession(control_pb2.CloseSessionRequest(name="ghost-2-62"), timeout=30)


# ----------------------------------------------------------------------------- limits

def test_a_4_tib_tensor_session_is_refused_at_create_naming_the_limit(control):
    config = _config("four-tib", [(1 << 20, 1 << 20)])
    _refused(control, config, grpc.StatusCode.RESOURCE_EXHAUSTED, "max_session_bytes", "--max-session-bytes",
             str(4 << 40))


def test_a_session_past_a_shards_memory_budget_is_refused_until_memory_is_freed(control):
    per_shard = (BUDGET // 16) * 6 // 10  # float32 elements: 60% of a shard's budget each
    first = _config("budget-first", [(per_shard,), (per_shard,)], ADAM)  # one tensor on each shard
    assert _create(control, first) is None
    try:
        second = _config("budget-second", [(per_shard,), (per_shard,)], ADAM)
        _refused(control, second, grpc.StatusCode.RESOURCE_EXHAUSTED, "shard_memory_bytes", "--shard-memory-bytes")
    finally:
        control.CloseSession(control_pb2.CloseSessionRequest(name="budget-first"), timeout=30)
    assert _create(control, second) is None  # the first session's budget came back when it closed
    control.CloseSession(control_pb2.CloseSessionRequest(name="budget-second"), timeout=30)


def test_the_shard_budget_counts_each_optimizers_own_state_and_a_refusal_names_the_figure(control):
    # A 512 x 768 matrix: 1.5 MiB of parameters and 1.5 MiB of gradient buffer, 75% of a shard's
    # budget. Factored Adafactor keeps a row and a column statistic (5 KiB): it fits, where three
    # float32 copies of state (the former estimate for every optimizer) would not.
    shape = (512, 768)
    factored = _config("budget-adafactor", [shape], ADAFACTOR)
    assert _create(control, factored) is None
    control.CloseSession(control_pb2.CloseSessionRequest(name="budget-adafactor"), timeout=30)
    # Adam's two moments (3 MiB, and its int32 step count) do not: the refusal says what the
    # session needs, part by part.
    params, state = 512 * 768 * 4, 2 * 512 * 768 * 4 + 4
    _refused(control, _config("budget-adam", [shape], ADAM), grpc.StatusCode.RESOURCE_EXHAUSTED,
             f"needs an estimated {2 * params + state} bytes ({params} of parameters, {state} of optimizer state, "
             f"{params} of gradient buffer)", f"shard_memory_bytes={BUDGET}", "--shard-memory-bytes")


def test_the_shard_budget_counts_shampoos_roots_in_flight_when_workers_compute_them(control_with_workers):
    # 256 x 384 with blocks of 128: parameters, state and gradient buffer (3.1 MB) fit the 4 MiB
    # budget, but a shard also holds the exported statistics, the roots coming back and their
    # copy while roots are exchanged (3 x 8 bytes per parameter here), and that does not fit.
    control = control_with_workers
    shampoo = control_pb2.OptimizerSpec(name="shampoo", args_json='{"learning_rate": 0.1, "block_size": 128}')
    roots = 3 * 8 * 256 * 384
    _refused(control, _config("budget-shampoo", [(256, 384)], shampoo), grpc.StatusCode.RESOURCE_EXHAUSTED,
             f"{roots} of preconditioner roots in flight", "--shard-memory-bytes")
    assert _create(control, _config("budget-shampoo-small", [(128, 128)], shampoo)) is None
    control.CloseSession(control_pb2.CloseSessionRequest(name="budget-shampoo-small"), timeout=30)


def test_a_session_whose_step_needs_more_working_memory_than_the_budget_leaves_is_refused_naming_it(control):
    # Muon on a 384 x 384 matrix: the estimate (parameters, momentum, gradient buffer: 1.8 MB)
    # fits the 4 MiB budget, but XLA's temporaries for its Newton-Schulz iterations (about 5.3 MB,
    # measured by compiling the step at create) do not fit what is left: refused before any step
    # could run out of memory.
    muon = control_pb2.OptimizerSpec(name="muon", args_json='{"learning_rate": 0.1}')
    error = _refused(control, _config("budget-working", [(384, 384)], muon), grpc.StatusCode.RESOURCE_EXHAUSTED,
                     "bytes of working memory (XLA temporaries) on shard", f"shard_memory_bytes={BUDGET}",
                     "--shard-memory-bytes")
    working = int(error.details().split("its step needs ")[1].split()[0])
    left = int(error.details().split("budget leaves ")[1].split()[0])
    assert working > left > 0, error.details()
    assert _create(control, _config("budget-working", [(128, 128)], muon)) is None  # the name is free
    control.CloseSession(control_pb2.CloseSessionRequest(name="budget-working"), timeout=30)


def test_the_shard_budget_counts_a_blocked_steps_compiled_code_and_a_refusal_names_it(control, control_with_workers):
    # Shampoo's update is unrolled per block, and its compiled step keeps host memory per tensor
    # and per block (XLA on the CPU reports no size: the figures are measured, bench/code_size.py).
    # 128 x 384 in blocks of 128 with the roots computed inside the step: 1.6 MB of parameters,
    # state and gradient buffer fit the 4 MiB budget; with its compiled step (one tensor, three
    # blocks) they do not. Nothing is counted for roots in flight: none are exchanged.
    from optserve.optim_kernels.registry import optimizer_entry

    shampoo = control_pb2.OptimizerSpec(name="shampoo", args_json='{"learning_rate": 0.1, "block_size": 128}')
    in_step = optimizer_entry("shampoo").root_offload.code_cost[True]
    error = _refused(control, _config("budget-code", [(128, 384)], shampoo), grpc.StatusCode.RESOURCE_EXHAUSTED,
                     f"{in_step.per_tensor + 3 * in_step.per_block} of compiled step", f"shard_memory_bytes={BUDGET}")
    assert "roots in flight" not in error.details(), error.details()
    # With the roots on a worker the step is smaller, but a 128 x 128 matrix in 64 blocks of 16
    # (0.2 MB of parameters and state) still needs 64 blocks of it.
    offloaded = optimizer_entry("shampoo").root_offload.code_cost[False]
    tiny_blocks = control_pb2.OptimizerSpec(name="shampoo", args_json='{"learning_rate": 0.1, "block_size": 16}')
    _refused(control_with_workers, _config("budget-code-blocks", [(128, 128)], tiny_blocks),
             grpc.StatusCode.RESOURCE_EXHAUSTED, f"{offloaded.per_tensor + 64 * offloaded.per_block} of compiled step")


def test_tensor_count_name_and_rank_past_their_limits_are_resource_exhausted(control):
    _refused(control, _config("many-tensors", [(2,)] * (MAX_TENSORS + 1)), grpc.StatusCode.RESOURCE_EXHAUSTED,
             f"max_tensors={MAX_TENSORS}", "--max-tensors")
    _refused(control, _config("long-name", [(2,)], names=["n" * 101]), grpc.StatusCode.RESOURCE_EXHAUSTED,
             "max_tensor_name_bytes=100", "--max-tensor-name-bytes")
    _refused(control, _config("high-rank", [(1,) * 9]), grpc.StatusCode.RESOURCE_EXHAUSTED,
             "max_tensor_rank=8", "--max-tensor-rank")
    assert _create(control, _config("just-enough", [(1,) * 8] * 3, names=["n" * 100, "m" * 100, "o" * 100])) is None
    control.CloseSession(control_pb2.CloseSessionRequest(name="just-enough"), timeout=30)


def test_a_session_of_40000_tensors_is_created_while_listing_answers_at_once(control):
    # The coordinator held its lock while the shards opened a session, so listing waited for
    # every create (and the duplicate-name check was quadratic: 33 s for 40,000 tensors).
    import threading

    config = _config("wide", [(2,)] * MAX_TENSORS)
    outcome = {}

    def create():
        started = time.perf_counter()
        outcome["error"] = _create(control, config)
        outcome["seconds"] = time.perf_counter() - started

    creating = threading.Thread(target=create)
    creating.start()
    waits = []
    while creating.is_alive():
        started = time.perf_counter()
        _listed(control)
        waits.append(time.perf_counter() - started)
        time.sleep(0.05)
    creating.join()
    assert outcome["error"] is None, outcome["error"].details()
    # Listing never waited for the create: relative to the create's own time, so a loaded machine
    # (CI took 13 s to create) reads the same. How long the create takes is bench.scale's (its
    # tensors sweep prints the create time per tensor count), not a timed assertion here.
    assert len(waits) >= 2 and max(waits) < max(1.0, outcome["seconds"] / 2), (waits, outcome)
    assert "wide" in _listed(control)
    control.CloseSession(control_pb2.CloseSessionRequest(name="wide"), timeout=30)


def test_small_sessions_are_created_while_a_large_one_opens_on_the_shards(control):
    # The coordinator held its lock while the shards opened a session (tracing and compiling its
    # step: a minute for a large Shampoo model), so every other create waited for the largest.
    import threading

    outcome, waits = {}, []
    assert _create(control, _config("small-warm", [(2, 2)])) is None  # its compilation out of the timed creates
    control.CloseSession(control_pb2.CloseSessionRequest(name="small-warm"), timeout=30)

    def create_large():
        started = time.perf_counter()
        outcome["error"] = _create(control, _config("wide-opening", [(3,)] * MAX_TENSORS))
        outcome["seconds"] = time.perf_counter() - started

    creating = threading.Thread(target=create_large)
    creating.start()
    small = 0
    while creating.is_alive():
        started = time.perf_counter()
        error = _create(control, _config(f"small-{small}", [(2, 2)]))
        waits.append(time.perf_counter() - started)
        assert error is None, error.details()
        control.CloseSession(control_pb2.CloseSessionRequest(name=f"small-{small}"), timeout=30)
        small += 1
    creating.join()
    assert outcome["error"] is None, outcome["error"].details()
    assert "wide-opening" in _listed(control)
    control.CloseSession(control_pb2.CloseSessionRequest(name="wide-opening"), timeout=30)
    assert max(waits) < max(1.0, outcome["seconds"] / 2), (waits, outcome)


def test_sessions_past_the_tenants_limit_are_resource_exhausted_and_the_sdk_names_it(limited_server, control):
    existing = len(_listed(control))  # the anchor
    names = [f"tenant-{i}" for i in range(MAX_SESSIONS - existing)]
    with Client(limited_server.address, timeout=60) as client:
        sessions = [client.create_session(n, make_params(), optimizer={"name": "sgd", "args": {"learning_rate": 0.1}})
                    for n in names]
        try:
            with pytest.raises(ResourceExhaustedError, match="max_sessions_per_tenant"):
                client.create_session("tenant-extra", make_params(), optimizer={"name": "sgd",
                                                                                "args": {"learning_rate": 0.1}})
            assert "tenant-extra" not in client.list_sessions()
            out = sessions[0].push_pull(make_grads(make_params(), 0))  # the others are unaffected
            assert set(out) == set(make_params())
        finally:
            for session in sessions:
                session.close()


def test_oversized_request_metadata_is_resource_exhausted_and_the_server_keeps_serving(control):
    with pytest.raises(grpc.RpcError) as info:
        control.ListSessions(control_pb2.ListSessionsRequest(), metadata=(("x-filler", "a" * (64 << 10)),),
                             timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert isinstance(_listed(control), list)


def test_a_session_of_40000_tensors_is_validated_and_placed_in_near_linear_time():
    from optserve.server.domain.config import DType, Limits, SessionConfig, TensorSpec
    from optserve.server.domain.sessions.placement import place_tensors

    def once(n):
        started = time.perf_counter()
        tensors = tuple(TensorSpec(f"layer{i}/w", DType.FLOAT32, (3,)) for i in range(n))
        config = SessionConfig(f"wide-{n}", tensors, "sgd", {"learning_rate": 0.1})
        place_tensors(config.tensors, 2)
        return time.perf_counter() - started

    def build(n):  # the least of three, with the collector off: a full collection of the test
        gc.collect()  # process's heap (or a busy neighbour) is not what this measures
        gc.disable()
        try:
            return min(once(n) for _ in range(3))
        finally:
            gc.enable()

    build(1000)  # warm
    small, large = build(10_000), build(40_000)
    assert large < 3.0, large  # was 14 s: the duplicate-name check counted every name in the list
    assert large < 4 * small * 3 + 0.2, (small, large)  # 4x the tensors, well under 16x the time
    assert Limits().max_tensors >= 40_000


# ----------------------------------------------------------------------------- configuration

def test_limit_defaults_come_from_the_machines_memory_and_bad_values_name_the_flag():
    from optserve.server.domain.config import Limits, ServerConfig
    from optserve.server.domain.limits import machine_memory_bytes
    from optserve.server.domain.errors import InvalidArgument

    memory = machine_memory_bytes()
    assert memory > 1 << 30
    limits = ServerConfig().limits
    assert limits.max_session_bytes == memory // 2
    assert limits.shard_budget(2) == memory // 4 and limits.shard_budget(4) == memory // 8
    assert Limits(shard_memory_bytes=123).shard_budget(2) == 123
    for flag, field in (("--max-tensors", "max_tensors"), ("--max-json-depth", "max_json_depth"),
                        ("--shard-memory-bytes", "shard_memory_bytes")):
        with pytest.raises(InvalidArgument, match=flag):
            Limits(**{field: 0})


def test_serve_with_a_bad_limit_flag_is_one_line_and_status_2(capsys):
    from optserve.server.cli import main

    assert main(["serve", "--port", "0", "--max-sessions-per-tenant", "0"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["optserve serve: --max-sessions-per-tenant must be a positive integer, got 0"]


def test_an_error_naming_a_huge_name_keeps_its_status_with_the_message_cut(control, shard_channel):
    # The message echoes the name; past 16 KiB of status details the client used to see a
    # transport RESOURCE_EXHAUSTED ("Stream removed") instead of NOT_FOUND.
    from optserve.protos.optserve.v1 import data_pb2, data_pb2_grpc

    name = "x" * 200_000
    calls = {"GetStatus": lambda: control.GetStatus(control_pb2.GetStatusRequest(name=name), timeout=30),
             "Pull": lambda: list(data_pb2_grpc.ShardDataStub(shard_channel).Pull(
                 data_pb2.PullRequest(session=name), timeout=30))}
    for rpc, call in calls.items():
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.NOT_FOUND, (rpc, info.value.details()[:200])
        assert "characters cut" in info.value.details() and len(info.value.details()) <= 2048
