"""int8 gradients (wire_dtype="int8"): blockwise absmax quantization defined once in
protos/int8_codec.py, error feedback per tensor on the client, dequantized by the shard before the
float32 update. Real server on loopback (the session-scoped `server` fixture, 2 shards)."""

from __future__ import annotations

import numpy as np
import pytest

from optserve.client import Client
from optserve.protos import chunk_codec, contract, int8_codec
from optserve.server.domain.config import DType, TensorSpec
from optserve.server.domain.errors import InvalidArgument
from optserve.server.domain.shard.assembly import TensorAssembler
from test_overlap_and_compression import _bytes_for_steps, byte_counter  # noqa: F401 - a fixture

SGD1 = {"name": "sgd", "args": {"learning_rate": 1.0}}


def test_int8_blocks_round_trip_within_half_a_step_and_sizes_invert():
    values = np.random.default_rng(0).standard_normal(3 * contract.INT8_BLOCK + 17).astype(np.float32) * 5
    quantized, scales = int8_codec.quantize_int8(values)
    assert quantized.dtype == np.int8 and scales.shape == (4,)
    decoded = np.empty_like(values)
    for start, data in int8_codec.int8_slices(quantized, scales, 2 * contract.INT8_BLOCK + 100):
        count = int8_codec.int8_count(len(data))
        assert start % contract.INT8_BLOCK == 0 and len(data) == int8_codec.int8_payload_bytes(count)
        int8_codec.write_int8_values(decoded[start:start + count], data)
    steps = np.repeat(scales, contract.INT8_BLOCK)[: values.size]
    assert np.all(np.abs(decoded - values) <= steps / 2 + 1e-6)


def test_the_shard_refuses_int8_chunks_that_are_not_whole_blocks():
    spec = TensorSpec("g", DType.FLOAT32, (2 * contract.INT8_BLOCK,))
    quantized, scales = int8_codec.quantize_int8(np.ones(spec.shape, np.float32))
    (_, data), = int8_codec.int8_slices(quantized, scales, 1 << 20)
    assembler = TensorAssembler({"g": spec}, {"g": np.empty(spec.shape, np.float32)}, check_finite=True)
    with pytest.raises(InvalidArgument, match="int8"):
        assembler.add(chunk_codec.ChunkView("g", contract.INT8, spec.shape, 8, memoryview(data)))


def test_int8_gradients_cost_a_quarter_of_the_float32_bytes(server, unique_name, byte_counter):
    sent32, received32 = _bytes_for_steps(byte_counter, server.address, unique_name + "-f32", 3)
    sent8, received8 = _bytes_for_steps(byte_counter, server.address, unique_name + "-i8", 3, wire_dtype="int8")
    payload = 3 * (256 * 256 + 4096) * 4
    assert payload <= sent32 < 1.05 * payload
    assert 0.24 < sent8 / sent32 < 0.27, (sent8, sent32)  # a quarter, plus one float32 scale per 4096 values
    assert 0.95 < received8 / received32 < 1.05  # parameters come back as float32
    per_call, _ = _bytes_for_steps(byte_counter, server.address, unique_name + "-call", 3,
                                   call_kwargs={"wire_dtype": "int8"})
    assert 0.24 < per_call / sent32 < 0.27


def test_error_feedback_keeps_the_applied_sum_tracking_the_true_sum(server, unique_name):
    # SGD with lr 1 from zero: the parameters are minus the sum of what the shards applied. One
    # column is far below a quantization step (absmax/127 ~ 0.03 here): quantized alone it would
    # round to zero every step and never move; error feedback carries it.
    rng = np.random.default_rng(3)
    params = {"w": np.zeros((64, 96), np.float32), "b": np.zeros((300,), np.float32)}
    client = Client(server.address, timeout=60, shared_memory=False)
    session = client.create_session(unique_name, params, optimizer=SGD1, wire_dtype="int8")
    try:
        true_sum = {k: np.zeros_like(v) for k, v in params.items()}
        for _ in range(40):
            grads = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}
            grads["w"][:, 0] = 2e-3
            for k in grads:
                true_sum[k] += grads[k]
            applied = {k: -v for k, v in session.push_pull(grads).items()}
        for name in params:
            residual = session._feedback.residuals[name]
            np.testing.assert_allclose(applied[name] + residual, true_sum[name], rtol=0, atol=1e-4)
            assert np.abs(applied[name] - true_sum[name]).max() < 0.03  # bounded: half a step, not growing
        np.testing.assert_allclose(applied["w"][:, 0], 0.08, atol=0.03)
    finally:
        session.close()
        client.close()
