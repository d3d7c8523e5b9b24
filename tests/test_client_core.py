"""The NumPy client core: imports, bfloat16 conversion, chunking and reassembly (no server)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from optserve.client import _wire
from optserve.client.errors import InvalidArgumentError


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
    ours = _wire.f32_to_bf16_bits(x)
    theirs = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(_wire.bf16_bits_to_f32(ours), x.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert np.isnan(_wire.bf16_bits_to_f32(_wire.f32_to_bf16_bits(np.array([np.nan], np.float32))))[0]


@pytest.mark.parametrize("wire", [_wire.FLOAT32, _wire.BFLOAT16, _wire.FLOAT16])
def test_chunks_cover_the_tensor_in_order_and_reassemble(wire):
    array = np.random.default_rng(1).standard_normal((700, 1000)).astype(np.float32)  # 2.8 MB
    chunks = list(_wire.iter_chunks("w", array, wire, _wire.chunk_size(1 << 20)))
    assert len(chunks) == -(-array.size * _wire.ITEMSIZE[wire] // (1 << 20))
    assert all(len(c.data) <= 1 << 20 for c in chunks)
    assert [c.offset for c in chunks] == sorted(c.offset for c in chunks)
    assembler = _wire.Reassembler({"w": (_wire.FLOAT32, array.shape)})
    for chunk in chunks:
        assembler.add(chunk)
    out = assembler.finish()["w"]
    expected = {
        _wire.FLOAT32: array,
        _wire.BFLOAT16: _wire.bf16_bits_to_f32(_wire.f32_to_bf16_bits(array)),
        _wire.FLOAT16: array.astype(np.float16).astype(np.float32),
    }[wire]
    np.testing.assert_array_equal(out, expected)


def test_chunk_size_is_clamped_to_1_to_4_mb():
    assert _wire.chunk_size(10) == 1 << 20
    assert _wire.chunk_size(1 << 30) == 4 << 20
    assert _wire.chunk_size(None) == _wire.DEFAULT_CHUNK_BYTES


def test_incomplete_pull_is_an_error_naming_the_tensor():
    assembler = _wire.Reassembler({"w": (_wire.FLOAT32, (4,))})
    assembler.add(next(_wire.iter_chunks("w", np.zeros(2, np.float32), _wire.FLOAT32, 1 << 20)))
    with pytest.raises(InvalidArgumentError, match="2 of 4 elements of tensor 'w'"):
        assembler.finish()


def test_unsupported_dtype_is_rejected_by_name():
    with pytest.raises(InvalidArgumentError, match="tensor 'x': unsupported dtype"):
        _wire.array_dtype_enum(np.zeros(2, np.int32), name="x")



def test_reassembler_writes_into_given_arrays_when_they_fit():
    reuse = np.zeros((3, 4), np.float32)
    wrong = np.zeros((2,), np.float32)
    assembler = _wire.Reassembler({"w": (_wire.FLOAT32, (3, 4)), "b": (_wire.FLOAT32, (3,))}, {"w": reuse, "b": wrong})
    for name, value in {"w": np.ones((3, 4), np.float32), "b": np.ones(3, np.float32)}.items():
        for chunk in _wire.iter_chunks(name, value, _wire.FLOAT32, 1 << 20):
            assembler.add(chunk)
    out = assembler.finish()
    assert out["w"] is reuse and (reuse == 1).all()
    assert out["b"] is not wrong and out["b"].shape == (3,)


def test_hand_encoded_chunk_messages_match_the_generated_classes():
    from optserve.protos import chunk_codec
    from optserve.protos.optserve.v1 import data_pb2, tensor_pb2

    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    for message in _wire.iter_chunk_messages("layer/w", array, _wire.FLOAT32, 1 << 20):
        for request_type in (data_pb2.PushRequest, data_pb2.PushPullRequest, data_pb2.InitTensorsRequest):
            parsed = request_type.FromString(message).chunk
            assert (parsed.name, parsed.dtype, list(parsed.shape), parsed.offset) == ("layer/w", _wire.FLOAT32, [3, 4], 0)
            assert parsed.data == array.tobytes()
    decode = chunk_codec.chunk_or_message(data_pb2.PushPullResponse)
    chunk = tensor_pb2.TensorChunk(name="b", dtype=_wire.FLOAT16, shape=[5, 1], offset=-3, data=b"\x01\x02")
    kind, view = decode(data_pb2.PushPullResponse(chunk=chunk).SerializeToString())
    assert kind == "chunk" and (view.name, view.dtype, view.shape, view.offset, bytes(view.data)) == (
        "b", _wire.FLOAT16, (5, 1), -3, b"\x01\x02")
    assert decode(data_pb2.PushPullResponse(done=data_pb2.StepDone(version=7)).SerializeToString())[1].version == 7
    assert decode(data_pb2.PushPullResponse(chunk=tensor_pb2.TensorChunk(name="e")).SerializeToString())[1].data.nbytes == 0
