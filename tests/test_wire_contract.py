"""optserve.protos.contract: the one definition of chunk sizes, wire dtypes and conversions, metadata
keys, reject reasons and gRPC options that the client and the server both use (no server here)."""

from __future__ import annotations

import itertools
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from optserve.protos import chunk_codec, contract
from optserve.protos.optserve.v1 import control_pb2

BF16 = np.dtype(ml_dtypes.bfloat16)
NUMPY = {contract.FLOAT32: np.dtype(np.float32), contract.BFLOAT16: BF16, contract.FLOAT16: np.dtype(np.float16)}
WIRES = [contract.FLOAT32, contract.BFLOAT16, contract.FLOAT16]
_UINT = {2: np.uint16, 4: np.uint32}


def _values() -> np.ndarray:
    """float32 values that exercise every conversion: rounding ties, overflow, subnormals, signs, NaN."""
    rng = np.random.default_rng(0)
    special = np.array([0.0, -0.0, 1.0, -2.5, np.inf, -np.inf, np.nan, -np.nan, 65504.0, 65520.0, 70000.0,
                        3.0e38, -3.4e38, 1e-8, 6e-8, 1e-40, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-11], np.float32)
    ties = (np.arange(32, dtype=np.uint32) << 16 | 0x3F808000).view(np.float32)  # bf16 ties to even
    return np.concatenate([special, ties, rng.standard_normal(2000).astype(np.float32) * 100])


def _assert_same(ours: np.ndarray, expected: np.ndarray) -> None:
    """Same bits, except that NaNs need only be NaN in the same places."""
    assert ours.dtype == expected.dtype and ours.shape == expected.shape
    nan = np.isnan(expected.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(ours.astype(np.float32)), nan)
    bits = _UINT[ours.dtype.itemsize]
    np.testing.assert_array_equal(ours[~nan].view(bits), expected[~nan].view(bits))


# --- wire dtypes -------------------------------------------------------------------------------


@pytest.mark.parametrize("source, wire, target", list(itertools.product(WIRES, WIRES, WIRES)))
def test_every_dtype_pair_round_trips_like_ml_dtypes_casts(source, wire, target):
    """source array -> wire bytes (wire_bytes) -> target slice (write_wire_values) equals
    ml_dtypes' source.astype(wire).astype(target), bit for bit (overflow to float16 gives inf)."""
    with np.errstate(over="ignore"):
        array = _values().astype(NUMPY[source]).reshape(-1, 1)
        expected_wire = array.reshape(-1).astype(NUMPY[wire])
        expected = expected_wire.astype(NUMPY[target])
    raw = contract.wire_bytes(array, wire)
    assert raw.format == "B" and len(raw) == array.size * contract.ITEMSIZE[wire]
    _assert_same(np.frombuffer(raw, NUMPY[wire]), expected_wire)
    out = np.empty(array.size, NUMPY[target])
    contract.write_wire_values(out, raw, wire)
    _assert_same(out, expected)


def test_bf16_narrowing_rounds_to_nearest_even_and_keeps_nan():
    def narrow(bits: int) -> int:
        return int(contract.f32_to_bf16_bits(np.array([bits], np.uint32).view(np.float32))[0])

    assert narrow(0x3F808000) == 0x3F80  # tie, kept part even: down
    assert narrow(0x3F818000) == 0x3F82  # tie, kept part odd: up to even
    assert narrow(0x3F808001) == 0x3F81  # just above the tie: up
    assert narrow(0x3F807FFF) == 0x3F80  # just below: down
    assert narrow(0x7F7FFFFF) == 0x7F80  # largest float32 rounds to +inf
    assert narrow(0xFF800000) == 0xFF80  # -inf stays -inf
    for nan in (0x7FC00000, 0x7FFFFFFF, 0x7F800001, 0xFFFFFFFF):  # quiet, max payload, signalling, negative
        out = narrow(nan)
        assert out & 0x7F80 == 0x7F80 and out & 0x007F, hex(out)  # exponent all ones, mantissa non-zero
        assert out >> 15 == nan >> 31  # sign kept
    x = _values()[:2048]
    np.testing.assert_array_equal(contract.f32_to_bf16_bits(x.reshape(32, -1)).reshape(-1),
                                  contract.f32_to_bf16_bits(x))  # shape kept, values independent of it


def test_bf16_widening_is_exact_and_writes_into_out():
    bits = np.arange(1 << 16, dtype=np.uint16)
    widened = contract.bf16_bits_to_f32(bits)
    assert widened.dtype == np.float32
    np.testing.assert_array_equal(widened.view(np.uint32), bits.astype(np.uint32) << 16)
    out = np.full(4, 7.0, np.float32)
    assert contract.bf16_bits_to_f32(np.array([0x3F80, 0xC000, 0x0000, 0x8000], np.uint16), out=out) is out
    np.testing.assert_array_equal(out, [1.0, -2.0, 0.0, -0.0])


@pytest.mark.parametrize("given, expected", [
    ("float32", contract.FLOAT32), ("f32", contract.FLOAT32), ("BF16", contract.BFLOAT16),
    ("bfloat16", contract.BFLOAT16), ("f16", contract.FLOAT16), (np.float16, contract.FLOAT16),
    (np.dtype(np.float32), contract.FLOAT32), (ml_dtypes.bfloat16, contract.BFLOAT16), (BF16, contract.BFLOAT16),
    (contract.FLOAT16, contract.FLOAT16), (np.int64(2), contract.BFLOAT16), (None, None),
])
def test_dtype_enum_parses_names_numpy_dtypes_and_enum_values(given, expected):
    assert contract.dtype_enum(given) == expected


@pytest.mark.parametrize("given", ["int8", "float64", np.int32, np.float64, 0, 7, True, object(), [1]])
def test_dtype_enum_refuses_other_dtypes_with_value_error(given):
    with pytest.raises(ValueError, match="unsupported dtype"):
        contract.dtype_enum(given)


def test_encoding_refuses_other_array_dtypes_and_decoding_checks_sizes():
    with pytest.raises(ValueError, match="float64"):
        contract.wire_bytes(np.zeros(3), contract.FLOAT32)
    with pytest.raises(ValueError, match="wire dtype"):
        contract.wire_bytes(np.zeros(3, np.float32), 0)
    with pytest.raises(ValueError, match="do not fill 3 elements"):
        contract.write_wire_values(np.zeros(3, np.float32), b"\0" * 8, contract.FLOAT32)
    with pytest.raises(ValueError, match="int32"):
        contract.write_wire_values(np.zeros(2, np.int32), b"\0" * 8, contract.FLOAT32)


def test_encoding_in_the_wire_dtype_is_a_view_and_decoding_it_a_plain_copy():
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    raw = contract.wire_bytes(array, contract.FLOAT32)
    assert np.shares_memory(np.frombuffer(raw, np.uint8), array)
    out = np.empty(12, np.float32)
    contract.write_wire_values(out, raw, contract.FLOAT32)
    np.testing.assert_array_equal(out, array.reshape(-1))
    transposed = contract.wire_bytes(array.T, contract.FLOAT32)  # not C-contiguous: copied in C order
    np.testing.assert_array_equal(np.frombuffer(transposed, np.float32), array.T.reshape(-1))


# --- chunks -------------------------------------------------------------------------------------


@pytest.mark.parametrize("wire", WIRES)
def test_empty_tensors_are_one_empty_piece_and_decode_to_nothing(wire):
    raw = contract.wire_bytes(np.zeros((0, 3), np.float32), wire)
    assert len(raw) == 0
    pieces = list(contract.slices(raw, contract.ITEMSIZE[wire], 1 << 20))
    assert [(offset, len(data)) for offset, data in pieces] == [(0, 0)]
    target = np.zeros(0, np.float32)
    contract.write_wire_values(target, pieces[0][1], wire)


@pytest.mark.parametrize("elements, itemsize, chunk_bytes, sizes", [
    (8, 4, 16, [16, 16]),          # an exact multiple: no empty tail
    (9, 4, 16, [16, 16, 4]),       # one element more: a one-element tail
    (5, 4, 7, [4] * 5),            # rounded down to whole elements
    (3, 4, 1, [4, 4, 4]),          # below one element: one element per piece
    (5, 2, 1 << 20, [10]),         # smaller than a chunk: one piece
])
def test_slices_cover_the_bytes_in_order_in_whole_elements(elements, itemsize, chunk_bytes, sizes):
    raw = memoryview(bytes(range(elements * itemsize)))
    pieces = list(contract.slices(raw, itemsize, chunk_bytes))
    assert [len(data) for _, data in pieces] == sizes
    assert [offset for offset, _ in pieces] == list(np.cumsum([0] + sizes[:-1]))
    assert b"".join(bytes(data) for _, data in pieces) == bytes(raw)


def test_pieces_are_views_of_the_encoded_array():
    array = np.arange(1000, dtype=np.float32)
    for _, data in contract.slices(contract.wire_bytes(array, contract.FLOAT32), 4, 1000):
        assert np.shares_memory(np.frombuffer(data, np.uint8), array)


def test_sliced_pieces_written_at_their_offsets_rebuild_the_tensor():
    array = np.random.default_rng(3).standard_normal(1001).astype(np.float32)
    out = np.empty(array.size, BF16)
    for offset, data in contract.slices(contract.wire_bytes(array, contract.BFLOAT16), 2, 300):
        start = offset // 2
        contract.write_wire_values(out[start : start + len(data) // 2], data, contract.BFLOAT16)
    _assert_same(out, array.astype(BF16))


@pytest.mark.parametrize("requested, expected", [
    (None, 1 << 20), (0, 1 << 20), (1, 64 << 10), (-5, 64 << 10), (64 << 10, 64 << 10), (100_000, 100_000),
    (1 << 20, 1 << 20), (4 << 20, 4 << 20), ((4 << 20) + 1, 4 << 20), (1 << 40, 4 << 20),
])
def test_chunk_sizes_are_clamped_to_one_range_with_1_mib_default(requested, expected):
    assert contract.clamp_chunk_bytes(requested) == expected


def test_the_chunk_range_fits_the_grpc_limits():
    assert contract.MIN_CHUNK_BYTES <= contract.DEFAULT_CHUNK_BYTES == 1 << 20 <= contract.MAX_CHUNK_BYTES
    assert contract.MAX_CHUNK_BYTES <= contract.LOOKAHEAD_BYTES // 4  # several chunks in flight per stream
    largest = chunk_codec.encode_chunk_message("x" * 1000, contract.FLOAT32, [1 << 20] * 8, 1 << 40,
                                               memoryview(bytes(contract.MAX_CHUNK_BYTES)))
    assert len(largest) < contract.MAX_MESSAGE_BYTES // 8


# --- metadata, reasons, options ------------------------------------------------------------------


def test_metadata_keys_and_reject_reason_names_are_fixed():
    assert contract.CURRENT_VERSION_KEY == "optserve-current-version"
    assert contract.PEER_REFUSED_KEY == "optserve-peer-refused"
    reasons = {v for v in control_pb2.RejectReason.values() if v != control_pb2.REJECT_REASON_UNSPECIFIED}
    assert set(contract.REJECT_REASON_NAMES) == reasons
    assert contract.REJECT_REASON_NAMES[control_pb2.REJECT_REASON_STALE] == "stale"
    assert sorted(contract.REJECT_REASON_NAMES.values()) == ["aborted", "invalid", "nonfinite", "stale"]
    assert {contract.REJECT_REASONS_BY_NAME[n]: n for n in contract.REJECT_REASONS_BY_NAME} == contract.REJECT_REASON_NAMES


def test_grpc_options_for_channels_and_servers():
    channel = dict(contract.CHANNEL_OPTIONS)
    assert channel == {"grpc.max_receive_message_length": 64 << 20, "grpc.max_send_message_length": 64 << 20,
                       "grpc.http2.lookahead_bytes": 16 << 20}
    # servers accept the keepalive pings of clients on other machines (contract.KEEPALIVE_OPTIONS)
    assert dict(contract.SERVER_OPTIONS) == {**channel, "grpc.so_reuseport": 0,
                                             "grpc.http2.min_ping_interval_without_data_ms": 1000}
    assert contract.KEEPALIVE_TIME_MS // 2 == 1000


def test_the_contract_imports_neither_grpc_nor_jax_nor_ml_dtypes():
    code = ("import sys, optserve.protos.contract; "
            "print(sorted(m for m in ('grpc', 'jax', 'ml_dtypes', 'ray') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_channels_to_other_machines_keep_alive_and_loopback_ones_do_not():
    for address in ("127.0.0.1:5", "localhost:5", "[::1]:5", "unix:/tmp/s"):
        assert contract.keepalive_options(address) == (), address
    for address in ("10.213.0.2:5", "[fd00::2]:5", "shard-3.example:5"):
        assert contract.keepalive_options(address) == contract.KEEPALIVE_OPTIONS, address
