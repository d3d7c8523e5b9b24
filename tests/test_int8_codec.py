"""The int8 codec (protos/int8_codec.py) against a straightforward whole-tensor formulation of the
same blockwise absmax quantization: the codec works in cache-sized pieces, in place, with
scratch buffers; every int8 value, scale, residual and dequantized float32 must come out bit for
bit the same, on sizes that are not whole blocks or whole pieces, all-zero blocks, negative
zeros and subnormal blocks (too tiny to invert: they quantize to zeros)."""

from __future__ import annotations

import numpy as np
import pytest

from optserve.client import _wire
from optserve.protos import chunk_codec, contract, int8_codec, tensor_chunks

BLOCK = contract.INT8_BLOCK
SIZES = [0, 1, 4095, 4096, 4097, 3 * BLOCK + 5, (2 * int8_codec.INT8_PIECE_BLOCKS + 1) * BLOCK + 7]


def reference_quantize(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Whole tensor at once: (int8 values, scales, the rounded values times their scales)."""
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and inf values in some cases
        return _reference_quantize(values)


def _reference_quantize(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    blocks = -(-flat.size // BLOCK)
    grid = np.zeros(blocks * BLOCK, np.float32)
    grid[: flat.size] = flat
    grid = grid.reshape(blocks, BLOCK)
    absmax = np.maximum(grid.max(axis=1, initial=-np.inf), -grid.min(axis=1, initial=np.inf))
    scales = (np.abs(absmax) / np.float32(127)).astype(np.float32)
    inverse = np.divide(np.float32(1), scales, out=np.zeros_like(scales), where=scales > int8_codec.INT8_MIN_SCALE)
    rounded = np.clip(np.rint(grid * inverse[:, None]), -127, 127)
    quantized = rounded.astype(np.int8).reshape(-1)[: flat.size]
    return quantized, scales, (rounded * scales[:, None]).reshape(-1)[: flat.size]


def reference_dequantize(quantized: np.ndarray, scales: np.ndarray) -> np.ndarray:
    return np.multiply(quantized, np.repeat(scales, BLOCK)[: quantized.size], dtype=np.float32)


def awkward_values(size: int, seed: int) -> np.ndarray:
    """Random magnitudes per block, every third block all zeros (some -0.0), one subnormal block."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(size).astype(np.float32)
    values *= np.repeat(10.0 ** rng.integers(-8, 8, -(-size // BLOCK)), BLOCK)[:size].astype(np.float32)
    for start in range(0, size, 3 * BLOCK):
        values[start : start + BLOCK] = 0.0
        values[start : start + BLOCK : 5] = -0.0
    if size > 2 * BLOCK:
        values[BLOCK : 2 * BLOCK] = rng.standard_normal(BLOCK).astype(np.float32) * np.float32(1e-43)
    return values


def assert_same_bits(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert actual.tobytes() == expected.tobytes()


@pytest.mark.parametrize("size", SIZES)
def test_chunked_int8_quantizer_matches_the_whole_tensor_formulation_bit_for_bit(size):
    values = awkward_values(size, seed=size)
    with np.errstate(invalid="ignore", over="ignore"):
        quantized, scales = int8_codec.quantize_int8(values.reshape(1, -1))
    expected_q, expected_scales, _ = reference_quantize(values)
    assert_same_bits(quantized, expected_q)
    assert_same_bits(scales, expected_scales)


@pytest.mark.parametrize("size", SIZES)
def test_error_feedback_residuals_match_the_whole_tensor_formulation_bit_for_bit(size):
    feedback, residual = _wire.ErrorFeedback(), None
    for step in range(3):
        grad = awkward_values(size, seed=100 * step + size).reshape(-1, 1)
        corrected = grad.copy() if residual is None else grad + residual
        expected_q, expected_scales, applied = reference_quantize(corrected)
        residual = corrected - applied.reshape(grad.shape)
        pushed = feedback.quantize({"g": grad})["g"]
        assert pushed.shape == grad.shape
        assert_same_bits(pushed.quantized, expected_q)
        assert_same_bits(pushed.scales, expected_scales)
        assert_same_bits(feedback.residuals["g"], residual)


@pytest.mark.parametrize("size", SIZES)
def test_int8_chunks_carry_values_then_scales_and_dequantize_bit_for_bit(size):
    quantized, scales, _ = reference_quantize(awkward_values(size, seed=size))
    chunk_bytes = 2 * (BLOCK + 4) + 100  # two blocks per chunk: several chunks, a short last one
    decoded = np.full(size, np.nan, np.float32)
    messages = tensor_chunks.int8_chunk_messages("g", tensor_chunks.Int8Gradient(quantized, scales, (size,)), chunk_bytes)
    for (start, data), message in zip(int8_codec.int8_slices(quantized, scales, chunk_bytes), messages, strict=True):
        count = int8_codec.int8_count(len(data))
        first, last = start // BLOCK, -(-(start + count) // BLOCK)
        assert data == quantized[start : start + count].tobytes() + scales[first:last].tobytes()
        assert message == chunk_codec.encode_chunk_message("g", contract.INT8, (size,), start, data)
        int8_codec.write_int8_values(decoded[start : start + count], memoryview(b"." + data)[1:])  # unaligned
    assert_same_bits(decoded, reference_dequantize(quantized, scales))


def test_non_finite_values_quantize_as_the_whole_tensor_formulation():
    values = awkward_values(5 * BLOCK + 3, seed=7)
    values[[10, BLOCK + 1, 2 * BLOCK + 9, 5 * BLOCK + 1]] = [np.nan, np.inf, -np.inf, np.nan]
    feedback = _wire.ErrorFeedback()
    expected_q, expected_scales, applied = reference_quantize(values)
    pushed = feedback.quantize({"g": values})["g"]
    np.testing.assert_array_equal(pushed.quantized, expected_q)
    np.testing.assert_array_equal(pushed.scales, expected_scales)  # NaN where NaN
    np.testing.assert_array_equal(feedback.residuals["g"], values - applied)


def test_a_block_too_tiny_to_invert_quantizes_to_zeros_and_its_residual_stays_finite():
    """A block whose largest value is below ~3.7e-37 (its scale's reciprocal would overflow) used
    to turn its exact zeros into NaN (0 * inf) in the residual, poisoning every later push."""
    grad = np.zeros(2 * BLOCK, np.float32)
    grad[:BLOCK:7] = np.float32(1e-38)  # tiny values and exact zeros in one block
    grad[BLOCK:] = 1.0
    feedback, applied = _wire.ErrorFeedback(), np.zeros_like(grad)
    for _ in range(4):
        pushed = feedback.quantize({"g": grad})["g"]
        applied += int8_codec.dequantize_int8(pushed.quantized, pushed.scales)
        assert np.isfinite(feedback.residuals["g"]).all() and np.isfinite(pushed.scales).all()
    assert not pushed.quantized[:BLOCK].any()  # the tiny block is sent as zeros ...
    np.testing.assert_array_equal(feedback.residuals["g"][:BLOCK], 4 * grad[:BLOCK])  # ... and kept
    np.testing.assert_allclose(applied[BLOCK:], 4.0, rtol=1e-6)
