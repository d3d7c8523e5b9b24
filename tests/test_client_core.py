"""The NumPy client core: imports, bfloat16 conversion, chunking, reassembly, options and status
records (no server). The contract itself (every dtype pair, slicing, clamping) is tests/test_wire_contract.py."""

from __future__ import annotations

import collections
import dataclasses
import subprocess
import sys

import grpc
import numpy as np
import pytest

from optserve.client import _wire
from optserve.client.errors import InvalidArgumentError
from optserve.protos import contract, tensor_chunks
from optserve.protos.optserve.v1 import data_pb2
from tests._grpc_fakes import FailedCall


def test_client_imports_neither_jax_nor_ray_nor_ml_dtypes():
    code = (
        "import sys, optserve.client, optserve.client.core, optserve.client.errors; "
        "bad = [m for m in ('jax', 'ray', 'ml_dtypes', 'optax') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_bf16_conversion_rounds_to_nearest_even_like_ml_dtypes():
    import ml_dtypes

    rng = np.random.default_rng(0)
    x = np.concatenate([
        rng.standard_normal(10_000).astype(np.float32) * 1e3,
        np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, 3.4e38, 1.0 + 2**-8, 1.0 + 3 * 2**-8], np.float32),
        # exact ties: the 16 dropped bits are 0x8000, so rounding goes to the even neighbour
        (np.arange(64, dtype=np.uint32) << 16 | 0x3F808000).view(np.float32),
    ])
    ours = contract.f32_to_bf16_bits(x)
    theirs = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(contract.bf16_bits_to_f32(ours), x.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert np.isnan(contract.bf16_bits_to_f32(contract.f32_to_bf16_bits(np.array([np.nan], np.float32))))[0]


@pytest.mark.parametrize("wire", [contract.FLOAT32, contract.BFLOAT16, contract.FLOAT16])
def test_chunks_cover_the_tensor_in_order_and_reassemble(wire):
    array = np.random.default_rng(1).standard_normal((700, 1000)).astype(np.float32)  # 2.8 MB
    chunks = list(tensor_chunks.float_tensor_chunks("w", array, wire, contract.clamp_chunk_bytes(1 << 20)))
    assert len(chunks) == -(-array.size * contract.ITEMSIZE[wire] // (1 << 20))
    assert all(len(c.data) <= 1 << 20 for c in chunks)
    assert [c.offset for c in chunks] == sorted(c.offset for c in chunks)
    assembler = _wire.Reassembler({"w": (contract.FLOAT32, array.shape)})
    for chunk in chunks:
        assembler.add(chunk)
    out = assembler.finish()["w"]
    expected = {
        contract.FLOAT32: array,
        contract.BFLOAT16: contract.bf16_bits_to_f32(contract.f32_to_bf16_bits(array)),
        contract.FLOAT16: array.astype(np.float16).astype(np.float32),
    }[wire]
    np.testing.assert_array_equal(out, expected)


def test_chunk_size_is_clamped_to_the_contract_range_64_kib_to_4_mib():
    # One range for the client and the server (was 1-4 MiB on the client, 64 KiB-64 MiB on the server).
    assert contract.clamp_chunk_bytes(10) == 64 << 10
    assert contract.clamp_chunk_bytes(1 << 30) == 4 << 20
    assert contract.clamp_chunk_bytes(None) == contract.DEFAULT_CHUNK_BYTES == 1 << 20


def test_incomplete_pull_is_an_error_naming_the_tensor():
    assembler = _wire.Reassembler({"w": (contract.FLOAT32, (4,))})
    assembler.add(next(tensor_chunks.float_tensor_chunks("w", np.zeros(2, np.float32), contract.FLOAT32, 1 << 20)))
    with pytest.raises(InvalidArgumentError, match="2 of 4 elements of tensor 'w'"):
        assembler.finish()


def test_unsupported_dtype_is_rejected_by_name():
    with pytest.raises(InvalidArgumentError, match="tensor 'x': unsupported dtype"):
        _wire.array_dtype_enum(np.zeros(2, np.int32), name="x")



def test_reassembler_writes_into_given_arrays_when_they_fit():
    reuse = np.zeros((3, 4), np.float32)
    wrong = np.zeros((2,), np.float32)
    assembler = _wire.Reassembler({"w": (contract.FLOAT32, (3, 4)), "b": (contract.FLOAT32, (3,))}, {"w": reuse, "b": wrong})
    for name, value in {"w": np.ones((3, 4), np.float32), "b": np.ones(3, np.float32)}.items():
        for chunk in tensor_chunks.float_tensor_chunks(name, value, contract.FLOAT32, 1 << 20):
            assembler.add(chunk)
    out = assembler.finish()
    assert out["w"] is reuse and (reuse == 1).all()
    assert out["b"] is not wrong and out["b"].shape == (3,)


def test_hand_encoded_chunk_messages_match_the_generated_classes():
    from optserve.protos import chunk_codec
    from optserve.protos.optserve.v1 import data_pb2, tensor_pb2

    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    for message in tensor_chunks.float_chunk_messages("layer/w", array, contract.FLOAT32, 1 << 20):
        for request_type in (data_pb2.PushRequest, data_pb2.PushPullRequest, data_pb2.InitTensorsRequest):
            parsed = request_type.FromString(message).chunk
            assert (parsed.name, parsed.dtype, list(parsed.shape), parsed.offset) == ("layer/w", contract.FLOAT32, [3, 4], 0)
            assert parsed.data == array.tobytes()
    decode = chunk_codec.chunk_or_message(data_pb2.PushPullResponse)
    chunk = tensor_pb2.TensorChunk(name="b", dtype=contract.FLOAT16, shape=[5, 1], offset=-3, data=b"\x01\x02")
    kind, view = decode(data_pb2.PushPullResponse(chunk=chunk).SerializeToString())
    assert kind == "chunk" and (view.name, view.dtype, view.shape, view.offset, bytes(view.data)) == (
        "b", contract.FLOAT16, (5, 1), -3, b"\x01\x02")
    assert decode(data_pb2.PushPullResponse(done=data_pb2.StepDone(version=7)).SerializeToString())[1].version == 7
    assert decode(data_pb2.PushPullResponse(chunk=tensor_pb2.TensorChunk(name="e")).SerializeToString())[1].data.nbytes == 0


def test_reassembler_accepts_an_empty_tensor_and_refuses_misaligned_chunks():
    from optserve.protos.optserve.v1 import tensor_pb2

    assembler = _wire.Reassembler({"e": (contract.FLOAT32, (0, 3)), "w": (contract.BFLOAT16, (2,))})
    for chunk in tensor_chunks.float_tensor_chunks("e", np.zeros((0, 3), np.float32), contract.FLOAT32, 1 << 20):
        assembler.add(chunk)
    with pytest.raises(InvalidArgumentError, match="tensor 'w' chunk not aligned"):
        assembler.add(tensor_pb2.TensorChunk(name="w", dtype=contract.BFLOAT16, shape=[2], offset=1, data=b"\0\0"))
    assembler.add(next(tensor_chunks.float_tensor_chunks("w", np.array([1.0, -2.0], np.float32), contract.BFLOAT16, 1 << 20)))
    out = assembler.finish()
    assert out["e"].shape == (0, 3) and out["w"].tolist() == [1.0, -2.0]


# --- SessionOptions ------------------------------------------------------------------------------


def test_session_options_from_the_spec_dict_build_the_session_config():
    from optserve.client import PreconditionerOptions, SessionOptions
    from optserve.protos.optserve.v1 import control_pb2, tensor_pb2

    spec = {"name": "shampoo", "args": {"learning_rate": 0.1}, "preconditioners": {"in_process": True, "max_age": 3}}
    options = SessionOptions.from_spec(spec, mode="async", max_staleness=2, staleness_policy="scale", wire_dtype="bf16")
    assert options.preconditioners == PreconditionerOptions(in_process=True, max_age=3)
    assert options.wire_dtype == "bfloat16" and options.spec == spec
    config = options.to_config("run", {"w": np.zeros((2, 3), np.float32), "h": np.zeros(4, np.float16)})
    assert config.name == "run" and [(t.name, t.dtype, list(t.shape)) for t in config.tensors] == [
        ("w", contract.FLOAT32, [2, 3]), ("h", contract.FLOAT16, [4])]
    assert config.optimizer.name == "shampoo" and config.optimizer.args_json == '{"learning_rate": 0.1}'
    assert config.optimizer.preconditioners.in_process and config.optimizer.preconditioners.max_age == 3
    assert (config.mode, config.max_staleness, config.staleness_policy, config.wire_dtype) == (
        control_pb2.MODE_ASYNC, 2, control_pb2.STALENESS_POLICY_SCALE, tensor_pb2.DTYPE_BFLOAT16)
    assert SessionOptions.from_config(config) == options
    plain = SessionOptions("adam").to_config("run", {"w": np.zeros(2, np.float32)})
    assert not plain.optimizer.HasField("preconditioners") and plain.max_staleness == -1
    assert plain.wire_dtype == tensor_pb2.DTYPE_UNSPECIFIED and plain.optimizer.args_json == "{}"


def test_session_options_are_declared_once_and_every_entry_point_takes_them_as_keywords():
    from optserve.client import SessionOptions
    from optserve.client.torch import RemoteOptimizerConfig

    given = SessionOptions("adam", mode="async", max_staleness=3)
    assert SessionOptions.from_spec(given) is given  # a SessionOptions keeps its own fields
    assert SessionOptions.from_spec(given, num_workers=2) == dataclasses.replace(given, num_workers=2)
    config = RemoteOptimizerConfig({"name": "adam"}, "run", mode="async", max_staleness=3, wire_dtype="bf16")
    assert config.options == dataclasses.replace(given, wire_dtype="bfloat16")
    assert (config.mode, config.max_staleness, config.wire_dtype) == ("async", 3, "bfloat16")
    with pytest.raises(TypeError):
        RemoteOptimizerConfig({"name": "adam"}, "run", not_an_option=1)


@pytest.mark.parametrize("kwargs, option", [
    ({"optimizer": ""}, "optimizer"),
    ({"optimizer": "adam", "optimizer_args": ["lr", 1]}, "optimizer_args"),
    ({"optimizer": "adam", "optimizer_args": {"lr": object()}}, "optimizer_args"),
    ({"optimizer": "adam", "preconditioners": {"max_age": -1}}, "max_age"),
    ({"optimizer": "adam", "preconditioners": {"max_age": 1.5}}, "max_age"),
    ({"optimizer": "adam", "preconditioners": {"in_process": "yes"}}, "in_process"),
    ({"optimizer": "adam", "preconditioners": {"inline": True}}, "preconditioners: unknown option 'inline'"),
    ({"optimizer": "adam", "preconditioners": 3}, "preconditioners"),
    ({"optimizer": "adam", "mode": "bulk"}, "mode"),
    ({"optimizer": "adam", "num_workers": 0}, "num_workers"),
    ({"optimizer": "adam", "num_workers": True}, "num_workers"),
    ({"optimizer": "adam", "max_staleness": -1}, "max_staleness"),
    ({"optimizer": "adam", "staleness_policy": "drop"}, "staleness_policy"),
    ({"optimizer": "adam", "wire_dtype": "int4"}, "wire_dtype"),
    ({"optimizer": "adam", "allow_nonfinite": 1}, "allow_nonfinite"),
])
def test_session_options_refuse_bad_values_naming_the_option(kwargs, option):
    from optserve.client import SessionOptions

    with pytest.raises(InvalidArgumentError, match=option):
        SessionOptions(**kwargs)


@pytest.mark.parametrize("spec, message", [
    ("adam", "optimizer must be"),
    ({"args": {}}, "optimizer must be"),
    ({"name": "adam", "arg": {}}, "unknown key 'arg'"),
])
def test_session_options_refuse_a_bad_optimizer_spec(spec, message):
    from optserve.client import SessionOptions

    with pytest.raises(InvalidArgumentError, match=message):
        SessionOptions.from_spec(spec)


def test_create_session_refuses_bad_options_before_contacting_a_server():
    from optserve.client import Client

    client = Client("127.0.0.1:1", timeout=1, retain_freed_memory=False)  # nothing listens there
    params = {"w": np.zeros(2, np.float32)}
    with pytest.raises(InvalidArgumentError, match="max_age"):
        client.create_session("s", params, optimizer={"name": "shampoo", "preconditioners": {"max_age": -1}})
    with pytest.raises(InvalidArgumentError, match="staleness_policy"):
        client.create_session("s", params, optimizer={"name": "adam"}, staleness_policy="later")
    with pytest.raises(InvalidArgumentError, match="tensor 'w': unsupported dtype"):
        client.create_session("s", {"w": np.zeros(2, np.int32)}, optimizer={"name": "adam"})
    client.close()


# --- status records ------------------------------------------------------------------------------


def test_status_is_decoded_once_into_typed_records():
    from optserve.client import PreconditionerBlockStatus, RootOffloadStatus, SessionStatus, ShardStatus
    from optserve.protos.optserve.v1 import control_pb2

    def shard(index, **extra):
        return control_pb2.ShardStatus(
            assignment=control_pb2.ShardAssignment(shard_index=index, address=f"h:{index}", tensor_names=["a", "b"],
                                                   param_bytes=64),
            version=5, initialized=True, node_id="n", device="cpu", **extra)

    response = control_pb2.GetStatusResponse(
        name="s", version=6, steps_applied=5, pushes_accepted=7,
        rejected=[control_pb2.RejectCount(reason=control_pb2.REJECT_REASON_STALE, count=2),
                  control_pb2.RejectCount(reason=control_pb2.REJECT_REASON_NONFINITE, count=1)],
        shards=[shard(0), shard(1, preconditioners=[control_pb2.PreconditionerStatus(
                    tensor="a", block=1, dim=0, size=8, age=-1, error=float("inf"), failures=2, fallback_steps=3)],
                root_offload=control_pb2.RootOffloadStatus(offloaded=True, max_age=-1, roots_installed=4, waits=1))])
    status = SessionStatus.from_proto(response)
    assert (status.name, status.version, status.steps_applied, status.pushes_accepted) == ("s", 6, 5, 7)
    assert status.rejected == {"stale": 2, "nonfinite": 1}
    plain, shampoo = status.shards
    assert plain == ShardStatus(index=0, address="h:0", tensors=("a", "b"), param_bytes=64, version=5,
                                initialized=True, node_id="n", device="cpu")
    assert plain.preconditioners == () and plain.root_offload is None
    assert shampoo.preconditioners == (PreconditionerBlockStatus("a", 1, 0, 8, -1, float("inf"), 2, 3),)
    assert shampoo.root_offload == RootOffloadStatus(offloaded=True, max_age=None, roots_installed=4, waits=1,
                                                     resubmits=0)


# --- errors and the token interceptor ------------------------------------------------------------


@pytest.mark.parametrize("code, cls_name", [(grpc.StatusCode.UNAUTHENTICATED, "UnauthenticatedError"),
                                            (grpc.StatusCode.PERMISSION_DENIED, "PermissionDeniedError")])
def test_auth_status_codes_map_to_their_own_error_classes(code, cls_name):
    import optserve.client as oc
    from optserve.client.errors import from_rpc_error

    error = from_rpc_error(FailedCall(code, "refused"))
    assert type(error) is getattr(oc, cls_name) and isinstance(error, oc.OptservError)
    assert (error.code, str(error)) == (code.name, "refused")


def test_token_interceptor_appends_authorization_to_the_calls_metadata_and_hides_the_token():
    from optserve.client._transport import BearerTokenInterceptor

    interceptor = BearerTokenInterceptor("tok-123")
    seen = []
    details = collections.namedtuple("D", "method timeout metadata credentials wait_for_ready compression")(
        "/optserve.v1.Control/ListSessions", 5.0, (("x-trace", "1"),), None, None, None)
    for intercept in (interceptor.intercept_unary_unary, interceptor.intercept_unary_stream,
                      interceptor.intercept_stream_unary, interceptor.intercept_stream_stream):
        intercept(lambda d, request: seen.append((d, request)), details, "request")
    assert all(d.metadata == (("x-trace", "1"), ("authorization", "Bearer tok-123")) and request == "request"
               and (d.method, d.timeout) == (details.method, 5.0) for d, request in seen)
    assert len(seen) == 4 and "tok-123" not in repr(interceptor)


class _EndedCall:
    """What gRPC hands back for a call that ended with ``error`` before any response."""

    def __init__(self, error):
        self._error = error

    def __iter__(self):
        raise self._error


def _step_on_a_fresh_call_ending(error):
    from optserve.client._step_stream import StepStream

    stream = StepStream(lambda requests, timeout: _EndedCall(error), timeout=None)
    return stream.start([data_pb2.PushPullRequest()]).finish(lambda kind, value: True)


def test_a_fresh_call_the_crowded_shard_cancelled_before_answering_is_resent_as_never_started():
    from optserve.client._step_stream import StreamBroken

    # the shard's sweeper ends a new call whose first message has not come (a loaded client)
    with pytest.raises(StreamBroken):
        _step_on_a_fresh_call_ending(FailedCall(grpc.StatusCode.CANCELLED, "Cancelled"))
    # a fresh call's UNAVAILABLE is the retry policy's (the shard may be down), not resent at once
    with pytest.raises(grpc.RpcError):
        _step_on_a_fresh_call_ending(FailedCall(grpc.StatusCode.UNAVAILABLE, "connection refused"))
    # a call this process ended itself (its Client closed mid-step) may have been taken: not resent
    with pytest.raises(grpc.RpcError):
        _step_on_a_fresh_call_ending(FailedCall(grpc.StatusCode.CANCELLED, "Channel closed!"))
    # nor one the shard answered with its own Cancelled
    with pytest.raises(grpc.RpcError):
        _step_on_a_fresh_call_ending(FailedCall(grpc.StatusCode.CANCELLED, "the push's stream ended early",
                                                trailing=((contract.ANSWERED_KEY, "1"),)))
