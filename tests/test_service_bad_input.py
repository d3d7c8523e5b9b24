"""Bad input: a clear status naming the culprit, and the session's state intact.

Each state-touching case drives two sessions created identically: ``victim`` receives the bad
request, ``twin`` does not; afterwards both get the same good push and must return the same
parameters at the same version ("the next result equals the result without the bad request").
Tensor-level cases speak raw gRPC to a shard, bypassing the SDK's own checks.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from _service_helpers import make_grads, make_params, max_abs_diff
from optserve.client import (
    AlreadyExistsError,
    Client,
    InvalidArgumentError,
    NotFoundError,
    StaleError,
)
from optserve.protos import contract, sparse_codec
from optserve.protos.optserve.v1 import data_pb2, data_pb2_grpc, tensor_pb2

ADAM = {"name": "adam", "args": {"learning_rate": 0.01}}
F32 = tensor_pb2.DTYPE_FLOAT32


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address, timeout=60) as c:
        yield c


@pytest.fixture
def twins(client, unique_name):
    """(victim, twin): two sessions with the same params and optimizer, one good step applied."""
    params = make_params()
    victim = client.create_session(unique_name + "-v", params, optimizer=ADAM)
    twin = client.create_session(unique_name + "-t", params, optimizer=ADAM)
    grads = make_grads(params, 0)
    victim.push(grads)
    twin.push(grads)
    yield victim, twin, params
    victim.close()
    twin.close()


def assert_state_intact(victim, twin, params, step=1):
    """The next good push gives bit-identical parameters and versions on both sessions."""
    grads = make_grads(params, step)
    got, expected = victim.push_pull(grads), twin.push_pull(grads)
    assert max_abs_diff(got, expected) == 0.0
    assert victim.version == twin.version
    status = victim.status()
    assert [s.version for s in status.shards] == [twin.version] * len(status.shards)


def _raw_shard(session, tensor_name):
    """(stub, shard names) of the shard holding ``tensor_name``."""
    for shard in session.info.shards:
        if tensor_name in shard.tensor_names:
            return data_pb2_grpc.ShardDataStub(grpc.insecure_channel(shard.address)), list(shard.tensor_names)
    raise AssertionError(tensor_name)


def _chunk(name, array, offset=0, dtype=F32, shape=None):
    return tensor_pb2.TensorChunk(name=name, dtype=dtype, shape=list(array.shape if shape is None else shape),
                                  offset=offset, data=np.ascontiguousarray(array, np.float32).tobytes())


def _header(session, sequence=1, auto_commit=False):
    return data_pb2.PushHeader(session=session.name, client_id="raw-client", sequence=sequence,
                               base_version=session.version, auto_commit=auto_commit)


# Each case: (description, function(session, names, grads) -> chunks, expected fragment of the message).
def _unknown_tensor(names, grads):
    return [_chunk(n, grads[n]) for n in names] + [_chunk("ghost", np.zeros(3))]


def _wrong_shape(names, grads):
    return [_chunk(n, grads[n], shape=(99,) if i == 0 else None) for i, n in enumerate(names)]


def _wrong_dtype(names, grads):
    return [_chunk(n, grads[n], dtype=7 if i == 0 else F32) for i, n in enumerate(names)]


def _missing_tensor(names, grads):
    return [_chunk(n, grads[n]) for n in names[1:]] + ([] if len(names) > 1 else [])


def _overlapping_chunks(names, grads):
    flat = grads[names[0]].reshape(-1)
    first = _chunk(names[0], flat[:4], shape=grads[names[0]].shape)
    second = _chunk(names[0], flat[2:], offset=8, shape=grads[names[0]].shape)
    return [first, second] + [_chunk(n, grads[n]) for n in names[1:]]


def _out_of_range_chunk(names, grads):
    g = grads[names[0]]
    return [_chunk(names[0], g), _chunk(names[0], g.reshape(-1)[:2], offset=g.nbytes, shape=g.shape)] + [
        _chunk(n, grads[n]) for n in names[1:]]


def _sparse_chunk(name, array, data=None, offset=0):
    """A SparseLoCo chunk of ``array`` (2 of each 4x4 tile, float32 values), or ``data`` instead."""
    [(first, payload)] = list(sparse_codec.encode(array, 4, 2, 32).payloads(1 << 20))
    return tensor_pb2.TensorChunk(name=name, dtype=contract.SPARSE, shape=list(array.shape), offset=offset + first,
                                  data=payload if data is None else data)


def _sparse_with(names, grads, corrupt):
    payload = bytearray(_sparse_chunk(names[0], grads[names[0]]).data)
    corrupt(payload)
    return [_sparse_chunk(names[0], grads[names[0]], bytes(payload))] + [_chunk(n, grads[n]) for n in names[1:]]


def _sparse_short(names, grads):
    return _sparse_with(names, grads, lambda p: p.pop())


def _sparse_index_outside(names, grads):  # (8, 6): the second tile column is 2 wide; cell 3 of row 0 is past the edge
    def corrupt(p):
        index_at = sparse_codec.HEADER.size
        entries = sparse_codec.unpack_bits(bytes(p[index_at:]), 8, 4)  # tile 0's two indices, tile 1's two, ...
        entries[2], entries[3] = 2, 3
        p[index_at:index_at + 4] = sparse_codec.pack_bits(entries, 4)
    return _sparse_with(names, grads, corrupt)


def _sparse_repeated_index(names, grads):
    def corrupt(p):
        index_at = sparse_codec.HEADER.size
        entries = sparse_codec.unpack_bits(bytes(p[index_at:]), 8, 4)
        entries[1] = entries[0]
        p[index_at:index_at + 4] = sparse_codec.pack_bits(entries, 4)
    return _sparse_with(names, grads, corrupt)


def _sparse_bad_header(names, grads):
    return _sparse_with(names, grads, lambda p: p.__setitem__(4, 3))  # bits=3 with a 32-bit body: length wrong


def _sparse_mixed_with_values(names, grads):  # (8, 6) in bands of 4 rows: the first as values, the second sparse
    g = grads[names[0]]
    [_, (second, data)] = list(sparse_codec.encode(g, 4, 2, 32).payloads(1))
    sparse = tensor_pb2.TensorChunk(name=names[0], dtype=contract.SPARSE, shape=list(g.shape), offset=second, data=data)
    return [_chunk(names[0], g.reshape(-1)[:second], shape=g.shape), sparse] + [_chunk(n, grads[n]) for n in names[1:]]


def _sparse_mid_band(names, grads):
    return [_sparse_chunk(names[0], grads[names[0]], offset=1)] + [_chunk(n, grads[n]) for n in names[1:]]


BAD_CHUNKS = [
    ("unknown tensor", _unknown_tensor, "'ghost'"),
    ("wrong shape", _wrong_shape, "shape [99]"),
    ("wrong dtype", _wrong_dtype, "unsupported dtype 7"),
    ("missing tensor", _missing_tensor, "missing tensor"),
    ("overlapping chunks", _overlapping_chunks, "overlap"),
    ("out-of-range chunk", _out_of_range_chunk, "out of range"),
    ("sparse chunk one byte short", _sparse_short, "bytes; its header and the tensor's shape make"),
    ("sparse index past the tile's edge", _sparse_index_outside, "outside its chunk"),
    ("sparse index repeated", _sparse_repeated_index, "repeats or is out of ascending order"),
    ("sparse header's bits against its length", _sparse_bad_header, "sparse chunk of"),
    ("sparse chunk starting mid-band", _sparse_mid_band, "not whole bands"),
    ("sparse chunks mixed with values", _sparse_mixed_with_values, "sparse chunks and chunks of values mixed"),
]


@pytest.mark.parametrize("case,make_chunks,fragment", BAD_CHUNKS, ids=[c[0] for c in BAD_CHUNKS])
def test_raw_push_with_bad_tensor_chunks_is_rejected_naming_the_tensor_and_state_kept(twins, case, make_chunks, fragment):
    victim, twin, params = twins
    stub, names = _raw_shard(victim, "dense/w")
    grads = make_grads(params, 5)
    requests = [data_pb2.PushRequest(header=_header(victim))] + [
        data_pb2.PushRequest(chunk=c) for c in make_chunks(names, grads)]
    with pytest.raises(grpc.RpcError) as info:
        stub.Push(iter(requests), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in info.value.details()
    if case != "unknown tensor":
        assert repr(names[0]) in info.value.details() or case == "missing tensor"
    with pytest.raises(grpc.RpcError) as commit:  # nothing was staged
        stub.Commit(data_pb2.CommitRequest(session=victim.name, client_id="raw-client", sequence=1), timeout=30)
    assert commit.value.code() == grpc.StatusCode.NOT_FOUND
    assert victim.status().rejected["invalid"] >= 1
    assert_state_intact(victim, twin, params)


def test_sdk_checks_names_and_shapes_before_sending(twins):
    victim, twin, params = twins
    grads = make_grads(params, 5)
    with pytest.raises(InvalidArgumentError, match="'nope'"):
        victim.push({**grads, "nope": np.zeros(2, np.float32)})
    with pytest.raises(InvalidArgumentError, match="missing tensor 'dense/b'"):
        victim.push({k: v for k, v in grads.items() if k != "dense/b"})
    with pytest.raises(InvalidArgumentError, match="'out/w': shape \\[4, 6\\]"):
        victim.push({**grads, "out/w": grads["out/w"].T})
    assert_state_intact(victim, twin, params)


def test_nan_gradient_on_one_shard_applies_on_no_shard(twins):
    victim, twin, params = twins
    grads = make_grads(params, 5)
    grads["out/b"][1] = np.nan
    with pytest.raises(InvalidArgumentError, match="tensor 'out/b': NaN or Inf") as info:
        victim.push_pull(grads)
    assert info.value.code == "INVALID_ARGUMENT"
    grads["out/b"][1] = np.inf
    with pytest.raises(InvalidArgumentError, match="'out/b'"):
        victim.push(grads)
    status = victim.status()
    assert status.rejected["nonfinite"] == 2
    assert status.rejected["aborted"] >= 1  # the other shard's staged half was dropped
    assert_state_intact(victim, twin, params)


def test_nan_gradient_reaches_the_optimizer_when_the_session_allows_it(client, unique_name):
    params = make_params()
    session = client.create_session(unique_name, params, optimizer={"name": "sgd", "args": {"learning_rate": 0.1}},
                                    allow_nonfinite=True)
    try:
        grads = make_grads(params, 0)
        grads["dense/b"][0] = np.nan
        out = session.push_pull(grads)
        assert np.isnan(out["dense/b"][0]) and np.isfinite(out["dense/b"][1:]).all()
    finally:
        session.close()


def test_unknown_session_is_not_found(client, twins):
    victim, twin, params = twins
    with pytest.raises(NotFoundError, match="'no-such-session'"):
        client.session("no-such-session")
    stub, names = _raw_shard(victim, "dense/w")
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Pull(data_pb2.PullRequest(session="no-such-session"), timeout=30))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "'no-such-session'" in info.value.details()
    assert_state_intact(victim, twin, params)


def test_duplicate_session_name_is_already_exists_names_the_way_on_and_keeps_the_first(client, twins):
    victim, twin, params = twins
    with pytest.raises(AlreadyExistsError, match=repr(victim.name)) as refused:
        client.create_session(victim.name, {"other": np.zeros(3, np.float32)}, optimizer=ADAM)
    message = str(refused.value)  # a rerun of a script: how to go on
    assert f"client.session({victim.name!r})" in message and f"client.close_session({victim.name!r})" in message
    assert_state_intact(victim, twin, params)


@pytest.mark.parametrize(
    "optimizer,fragment",
    [
        ({"name": "no_such_optimizer", "args": {}}, "'no_such_optimizer'"),
        ({"name": "adam", "args": {"learning_rate": 0.1, "bogus_option": 1}}, "'bogus_option'"),
        ({"name": "adafactor_hf", "args": {"lr": 0.01, "relative_step": False, "eps": "bad"}}, "eps"),
        # refused at creation, not at the first push (which used to wedge the session)
        ({"name": "adam", "args": {"learning_rate": "fast"}}, "learning_rate"),
        ({"name": "shampoo", "args": {"learning_rate": 0.1, "block_size": "big"}}, "block_size"),
    ],
    ids=["unknown optimizer", "unknown argument", "bad value", "wrong-typed value", "wrong-typed int"],
)
def test_bad_optimizer_spec_is_invalid_argument_naming_it(client, unique_name, optimizer, fragment):
    with pytest.raises(InvalidArgumentError, match=fragment):
        client.create_session(unique_name, make_params(), optimizer=optimizer)
    assert unique_name not in client.list_sessions()


def test_stale_async_push_is_aborted_with_the_current_version_and_not_applied(client, server, unique_name):
    params = make_params()
    options = dict(optimizer=ADAM, mode="async", max_staleness=0)
    victim = client.create_session(unique_name + "-v", params, **options)
    twin = client.create_session(unique_name + "-t", params, **options)
    late = Client(server.address, timeout=60).session(victim.name)  # base version 0
    try:
        for session in (victim, twin):
            session.push(make_grads(params, 0))
        with pytest.raises(StaleError, match="staleness 1 > max_staleness 0") as info:
            late.push(make_grads(params, 9))
        assert info.value.current_version == 1 and info.value.code == "ABORTED"
        assert victim.status().rejected["stale"] == 1
        assert_state_intact(victim, twin, params)
    finally:
        victim.close()
        twin.close()


def test_sync_push_against_an_old_version_is_aborted(twins, client):
    victim, twin, params = twins
    old = client.session(victim.name)
    old._set_version(0)
    with pytest.raises(StaleError, match="computed from version 0; current version is 1"):
        old.push(make_grads(params, 9))
    assert_state_intact(victim, twin, params)


def test_client_disconnecting_mid_push_applies_nothing(twins):
    victim, twin, params = twins
    stub, names = _raw_shard(victim, "dense/w")
    grads = make_grads(params, 5)
    import threading

    sent_half = threading.Event()

    first = grads[names[0]]
    first_half = first.reshape(-1)[: first.size // 2]

    def half_then_hang():
        yield data_pb2.PushRequest(header=_header(victim, sequence=7))
        yield data_pb2.PushRequest(chunk=_chunk(names[0], first_half, shape=first.shape))
        sent_half.set()
        threading.Event().wait(30)  # never finishes: the call is cancelled meanwhile

    call = stub.Push.future(half_then_hang(), timeout=30)
    assert sent_half.wait(10)
    call.cancel()
    # The same via PushPull: header, all chunks, seal, then the client vanishes before deciding.
    pp_requests = [data_pb2.PushPullRequest(header=_header(victim, sequence=8))]
    pp_requests += [data_pb2.PushPullRequest(chunk=_chunk(n, grads[n])) for n in names]
    pp_requests += [data_pb2.PushPullRequest(seal=True)]
    responses = stub.PushPull(iter(pp_requests), timeout=30)
    assert next(responses).WhichOneof("item") == "staged"
    for item in responses:  # the request stream ended without a decision: the shard aborts
        pass
    for sequence in (7, 8):
        with pytest.raises(grpc.RpcError) as info:
            stub.Commit(data_pb2.CommitRequest(session=victim.name, client_id="raw-client", sequence=sequence), timeout=30)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert_state_intact(victim, twin, params)


def test_auto_commit_push_that_reaches_only_one_shard_applies_on_none(twins, server):
    """A client that vanishes after pushing to one shard: the peer never stages, nothing applies."""
    victim, twin, params = twins
    stub, names = _raw_shard(victim, "dense/w")
    grads = make_grads(params, 5)
    requests = [data_pb2.PushRequest(header=_header(victim, sequence=3, auto_commit=True))]
    requests += [data_pb2.PushRequest(chunk=_chunk(n, grads[n])) for n in names]
    with pytest.raises(grpc.RpcError) as info:
        stub.Push(iter(requests), timeout=60)
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert "not staged on every shard" in info.value.details()
    assert server.config.vote_timeout_s <= 10
    assert victim.status().rejected["aborted"] >= 1
    assert_state_intact(victim, twin, params)


@pytest.mark.parametrize("sequence", [-1, 0, 7])
def test_commit_of_a_push_never_staged_is_not_found_and_applies_nothing(twins, sequence):
    # A Commit naming a push that was never staged (a never-seen client, any sequence) is refused
    # before the clock hears of it: no ticket, so no push counted and no later step wedged.
    victim, twin, params = twins
    stub, _ = _raw_shard(victim, "dense/w")
    accepted = victim.status().pushes_accepted
    with pytest.raises(grpc.RpcError) as info:
        stub.Commit(data_pb2.CommitRequest(session=victim.name, client_id="never-pushed", sequence=sequence),
                    timeout=30)
    assert info.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)
    assert victim.status().pushes_accepted == accepted
    assert_state_intact(victim, twin, params)


def test_a_refusal_on_a_non_home_shard_reaches_the_home_shard_at_once(client, server, unique_name):
    # The refusing shard tells the session clock without waiting; that call must not be dropped
    # (an unreferenced gRPC future is cancelled when collected), else the home shard waits for the
    # vote timeout before it refuses the push too.
    import time

    params = make_params()
    session = client.create_session(unique_name, params, optimizer=ADAM)
    try:
        other = session.info.shards[1]  # not the home shard (the first of the shard map)
        for attempt in range(3):
            bad = make_grads(params, attempt)
            bad[other.tensor_names[0]].reshape(-1)[0] = np.nan
            start = time.monotonic()
            with pytest.raises(InvalidArgumentError):
                session.push(bad)
            assert time.monotonic() - start < server.config.vote_timeout_s / 2
        assert session.status().pushes_accepted == 0
    finally:
        session.close()


def _raw_step_on_every_shard(session, grads, sequence, pull, framing):
    """One auto-commit push of ``grads`` as client "raw-client", sent to every shard at once in
    ``framing`` ("step": one message; "streamed": header, pull, chunks, seal) with reply options
    ``pull``; returns each shard's outcome: ("ok", StepDone) or (status code, details)."""
    import concurrent.futures

    header = _header(session, sequence=sequence, auto_commit=True)

    def one_shard(shard):
        stub = data_pb2_grpc.ShardDataStub(grpc.insecure_channel(shard.address))
        chunks = [_chunk(n, grads[n]) for n in shard.tensor_names]
        if framing == "step":
            requests = [data_pb2.PushPullRequest(step=data_pb2.PushPullStep(header=header, pull=pull, chunks=chunks))]
        else:
            requests = ([data_pb2.PushPullRequest(header=header), data_pb2.PushPullRequest(pull=pull)]
                        + [data_pb2.PushPullRequest(chunk=c) for c in chunks] + [data_pb2.PushPullRequest(seal=True)])
        try:
            responses = list(stub.PushPull(iter(requests), timeout=30))
        except grpc.RpcError as error:
            return error.code(), error.details()
        last = responses[-1]
        return "ok", (last.step_result.done if last.WhichOneof("item") == "step_result" else last.done)

    with concurrent.futures.ThreadPoolExecutor(len(session.info.shards)) as pool:
        return list(pool.map(one_shard, session.info.shards))


@pytest.mark.parametrize("framing", ["step", "streamed"])
def test_push_with_a_bad_reply_wire_dtype_is_refused_unapplied_and_a_retry_applies_once(twins, framing):
    # The reply's options used to be read after the push was applied: the push was answered
    # INVALID_ARGUMENT although applied, and the client's retry applied it a second time.
    victim, twin, params = twins
    grads = make_grads(params, 5)
    refused = _raw_step_on_every_shard(victim, grads, 1, data_pb2.PullRequest(wire_dtype=7), framing)
    assert all(code == grpc.StatusCode.INVALID_ARGUMENT and "pull wire_dtype" in details
               for code, details in refused), refused
    assert victim.status().steps_applied == 1  # nothing applied anywhere
    good = data_pb2.PullRequest(wire_dtype=F32)
    applied = _raw_step_on_every_shard(victim, grads, 1, good, framing)
    assert [(outcome, done.version, done.committed) for outcome, done in applied] == [("ok", 2, True)] * len(applied)
    again = _raw_step_on_every_shard(victim, grads, 1, good, framing)  # a retry of an applied push
    assert [(outcome, done.version) for outcome, done in again] == [("ok", 2)] * len(again)
    assert victim.status().steps_applied == 2 and victim.status().pushes_accepted == 2
    twin.push(grads)
    assert max_abs_diff(victim.pull(), twin.pull()) == 0.0
    assert_state_intact(victim, twin, params, step=6)


def test_push_with_an_overlong_client_id_is_rejected_and_nothing_is_staged(twins):
    # Shards remember client ids (applied sequences, expired pushes): megabyte ids would grow them.
    from optserve.protos import contract

    victim, twin, params = twins
    stub, names = _raw_shard(victim, "dense/w")
    grads = make_grads(params, 5)
    long_id = "c" * (contract.MAX_CLIENT_ID_CHARS + 1)
    header = data_pb2.PushHeader(session=victim.name, client_id=long_id, sequence=1, base_version=victim.version)
    requests = [data_pb2.PushRequest(header=header)] + [data_pb2.PushRequest(chunk=_chunk(n, grads[n])) for n in names]
    with pytest.raises(grpc.RpcError) as info:
        stub.Push(iter(requests), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "client_id" in info.value.details()
    for call, request in ((stub.Commit, data_pb2.CommitRequest), (stub.Abort, data_pb2.AbortRequest)):
        with pytest.raises(grpc.RpcError) as info:
            call(request(session=victim.name, client_id=long_id, sequence=1), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_state_intact(victim, twin, params)


def test_push_with_a_negative_base_version_is_rejected_naming_it_and_nothing_is_applied(twins):
    # Its staleness would be past any version the clock keeps (and past int64 from -2**63).
    victim, twin, params = twins
    stub, names = _raw_shard(victim, "dense/w")
    grads = make_grads(params, 5)
    header = data_pb2.PushHeader(session=victim.name, client_id="raw-client", sequence=1, base_version=-2**63,
                                 auto_commit=True)
    requests = [data_pb2.PushRequest(header=header)] + [data_pb2.PushRequest(chunk=_chunk(n, grads[n])) for n in names]
    with pytest.raises(grpc.RpcError) as info:
        stub.Push(iter(requests), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "base_version must be >= 0" in info.value.details()
    assert_state_intact(victim, twin, params)


def test_a_message_other_than_the_decision_after_staged_is_invalid_argument_and_drops_the_push(twins):
    # After `staged` a two-phase step takes its decision; a chunk there is refused (the call ends),
    # the staged push dropped, the session intact.
    victim, twin, params = twins
    stub, names = _raw_shard(victim, "dense/w")
    grads = make_grads(params, 5)
    requests = [data_pb2.PushPullRequest(header=_header(victim, sequence=9))]
    requests += [data_pb2.PushPullRequest(chunk=_chunk(n, grads[n])) for n in names]
    requests += [data_pb2.PushPullRequest(seal=True), data_pb2.PushPullRequest(chunk=_chunk(names[0], grads[names[0]]))]
    responses = stub.PushPull(iter(requests), timeout=30)
    assert next(responses).WhichOneof("item") == "staged"
    with pytest.raises(grpc.RpcError) as info:
        list(responses)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "takes its `decision`, got `chunk`" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stub.Commit(data_pb2.CommitRequest(session=victim.name, client_id="raw-client", sequence=9), timeout=30)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert_state_intact(victim, twin, params)
