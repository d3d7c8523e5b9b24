"""One-message PushPull steps (`step` -> `step_result`): the same result as a streamed step,
a streamed answer when the parameters exceed one chunk, and refusals that leave state intact.

Raw-gRPC cases use one-tensor sessions, which sit on one shard, so a single `step` message is a
whole auto_commit push (no peer shard waits for a vote).
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from optserve.client import Client
from optserve.protos.optserve.v1 import data_pb2, data_pb2_grpc, tensor_pb2

from _service_helpers import InProcess, make_grads, make_params, max_abs_diff

SGD = {"name": "sgd", "args": {"learning_rate": 0.1}}
F32 = tensor_pb2.DTYPE_FLOAT32


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address, timeout=60) as c:
        yield c


@pytest.fixture
def one_shard_twins(client, unique_name):
    """Factory: (victim, twin) one-tensor sessions with equal params and optimizer."""
    made = []

    def make(shape=(8, 6)):
        params = make_params(shapes={"w": shape})
        pair = tuple(client.create_session(f"{unique_name}-{len(made)}{side}", params, optimizer=SGD) for side in "vt")
        made.extend(pair)
        assert [len(s.info.shards) for s in pair] == [1, 1]
        return (*pair, params)

    yield make
    for session in made:
        session.close()


def _stub(session):
    return data_pb2_grpc.ShardDataStub(grpc.insecure_channel(session.info.shards[0].address))


def _header(session, sequence, auto_commit=True):
    return data_pb2.PushHeader(session=session.name, client_id="raw-one-message", sequence=sequence,
                               base_version=session.version, auto_commit=auto_commit)


def _chunk(name, array, shape=None):
    return tensor_pb2.TensorChunk(name=name, dtype=F32, shape=list(array.shape if shape is None else shape),
                                  offset=0, data=np.ascontiguousarray(array, np.float32).tobytes())


def _values(chunks, shape):
    out = np.empty(int(np.prod(shape)), np.float32)
    for chunk in chunks:
        start = chunk.offset // 4
        out[start:start + len(chunk.data) // 4] = np.frombuffer(chunk.data, np.float32)
    return out.reshape(shape)


def _one_message_step(session, grads, sequence, pull=None, auto_commit=True):
    step = data_pb2.PushPullStep(header=_header(session, sequence, auto_commit),
                                 chunks=[_chunk(n, g) for n, g in grads.items()])
    if pull is not None:
        step.pull.CopyFrom(pull)
    return list(_stub(session).PushPull(iter([data_pb2.PushPullRequest(step=step)]), timeout=30))


def _streamed_step(session, grads, sequence):
    requests = [data_pb2.PushPullRequest(header=_header(session, sequence))]
    requests += [data_pb2.PushPullRequest(chunk=_chunk(n, g)) for n, g in grads.items()]
    requests += [data_pb2.PushPullRequest(seal=True)]
    return list(_stub(session).PushPull(iter(requests), timeout=30))


def test_one_message_step_answers_one_step_result_equal_to_the_streamed_step(one_shard_twins):
    victim, twin, params = one_shard_twins()
    grads = make_grads(params, 0)
    one = _one_message_step(victim, grads, sequence=1)
    streamed = _streamed_step(twin, grads, sequence=1)
    assert [r.WhichOneof("item") for r in one] == ["step_result"]
    assert [r.WhichOneof("item") for r in streamed] == ["chunk", "done"]
    result = one[0].step_result
    assert result.done.committed and result.done.version == streamed[-1].done.version == 1
    got = _values(result.chunks, params["w"].shape)
    np.testing.assert_array_equal(got, _values([streamed[0].chunk], params["w"].shape))
    np.testing.assert_allclose(got, params["w"] - 0.1 * grads["w"], rtol=1e-6)


def test_one_message_step_retried_with_its_sequence_applies_once(one_shard_twins):
    victim, twin, params = one_shard_twins()
    grads = make_grads(params, 0)
    first = _one_message_step(victim, grads, sequence=1)[0].step_result
    again = _one_message_step(victim, grads, sequence=1)[0].step_result
    assert first.done.version == again.done.version == 1
    np.testing.assert_array_equal(_values(again.chunks, params["w"].shape), _values(first.chunks, params["w"].shape))
    twin.push(grads)
    victim._set_version(1)
    assert max_abs_diff(victim.push_pull(make_grads(params, 1)), twin.push_pull(make_grads(params, 1))) == 0.0


def test_one_message_step_whose_parameters_exceed_one_chunk_streams_chunks_then_done(one_shard_twins):
    victim, twin, params = one_shard_twins(shape=(128, 160))  # 80 KB > the 64 KB smallest chunk
    grads = make_grads(params, 0)
    responses = _one_message_step(victim, grads, sequence=1, pull=data_pb2.PullRequest(max_chunk_bytes=64 << 10))
    assert [r.WhichOneof("item") for r in responses] == ["chunk", "chunk", "done"]
    expected = twin.push_pull(grads)["w"]
    np.testing.assert_array_equal(_values([r.chunk for r in responses[:2]], params["w"].shape), expected)


@pytest.mark.parametrize("case, fragment", [
    ("no auto_commit", "auto_commit must be true"),
    ("wrong shape", "tensor 'w': shape [99]"),
    ("unknown tensor", "unknown tensor 'ghost'"),
])
def test_refused_one_message_step_names_the_problem_and_applies_nothing(one_shard_twins, case, fragment):
    victim, twin, params = one_shard_twins()
    grads = make_grads(params, 0)
    victim.push(grads)
    twin.push(grads)
    bad = make_grads(params, 5)
    step = data_pb2.PushPullStep(header=_header(victim, 1, auto_commit=case != "no auto_commit"),
                                 chunks=[_chunk("w", bad["w"], shape=(99,) if case == "wrong shape" else None)])
    if case == "unknown tensor":
        step.chunks.append(_chunk("ghost", np.zeros(3, np.float32)))
    with pytest.raises(grpc.RpcError) as info:
        list(_stub(victim).PushPull(iter([data_pb2.PushPullRequest(step=step)]), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in info.value.details()
    after = make_grads(params, 1)
    assert max_abs_diff(victim.push_pull(after), twin.push_pull(after)) == 0.0
    assert victim.version == twin.version == 2


@pytest.mark.parametrize("shapes", [
    {"w": (8, 6), "b": (6,)},  # below the SDK's small-session size: one `step` message per shard
    {"w": (300, 250), "b": (250,)},  # above it: header, chunks, seal and streamed parameters
], ids=["one-message", "streamed"])
def test_sdk_push_pull_matches_in_process_on_either_side_of_the_one_message_size(client, unique_name, shapes):
    params = make_params(shapes=shapes)
    optimizer = {"name": "adafactor", "args": {"learning_rate": 1e-2}}
    session = client.create_session(unique_name, params, optimizer=optimizer)
    reference = InProcess(optimizer["name"], optimizer["args"], params)
    try:
        for step in range(3):
            got = session.push_pull(make_grads(params, step))
            assert max_abs_diff(got, reference.step(make_grads(params, step))) <= 1e-6
    finally:
        session.close()
