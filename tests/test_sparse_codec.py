"""The SparseLoCo codec (protos/sparse_codec.py) and the worker's error feedback
(client/_sparseloco.py) on known inputs: chunks with ragged edges, the quantiser, the wire
format's round trip and its checks."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from optserve.client._sparseloco import ErrorFedSparsifier, SparseLoCo
from optserve.client.errors import InvalidArgumentError
from optserve.protos import sparse_codec


def _reference_topk(values: np.ndarray, chunk: int, topk: int) -> np.ndarray:
    """Written apart from the codec: per tile (matrix) or piece (anything else), the ``topk``
    entries of largest magnitude kept, the rest zero."""
    out = np.zeros_like(values)
    if values.ndim == 2:
        for r in range(0, values.shape[0], chunk):
            for c in range(0, values.shape[1], chunk):
                tile = values[r:r + chunk, c:c + chunk]
                keep = np.argsort(-np.abs(tile), axis=None, kind="stable")[:topk]
                rows, cols = np.unravel_index(keep, tile.shape)
                out[r + rows, c + cols] = tile[rows, cols]
        return out
    flat, kept = values.reshape(-1), out.reshape(-1)
    for start in range(0, flat.size, chunk):
        piece = flat[start:start + chunk]
        keep = np.argsort(-np.abs(piece), kind="stable")[:topk]
        kept[start + keep] = piece[keep]
    return out


@pytest.mark.parametrize("shape", [(130, 70), (64, 64), (8, 6), (200,), (3, 4, 5), (), (1, 1)])
@pytest.mark.parametrize("topk", [1, 5, 64])
def test_float32_selection_keeps_each_chunks_largest_entries_ragged_edges_included(shape, topk):
    values = np.random.default_rng(7).standard_normal(shape).astype(np.float32)
    chunk = 8
    selection = sparse_codec.encode(values, chunk, topk, 32)
    np.testing.assert_array_equal(selection.dense(), _reference_topk(values, chunk, topk))


def test_the_two_bit_quantiser_decodes_each_value_to_the_mean_of_its_level():
    values = np.array([-3.0, -2.9, -1.0, 0.0, 0.1, 1.0, 3.0, 3.2], np.float32)
    codes, table = sparse_codec.quantize(values, 2)
    shift = values.mean()
    scale = 6.0 * np.std(values - shift, ddof=1) / 4
    want = np.clip(np.rint((values - shift) / np.float32(scale) + 2), 0, 3)
    np.testing.assert_array_equal(codes, want)
    for code in range(4):  # each level decodes to the mean of the values that got it
        got = values[codes == code]
        if got.size:
            assert table[code] == pytest.approx(float(got.mean()), abs=1e-6)
    assert sparse_codec.quantize(np.full(5, 2.5, np.float32), 2)[1][2] == np.float32(2.5)  # no spread: exact


@pytest.mark.parametrize("bits", [1, 2, 3, 8, 32])
def test_payloads_round_trip_through_the_receivers_decoder_in_bands(bits):
    values = np.random.default_rng(bits).standard_normal((150, 90)).astype(np.float32)
    selection = sparse_codec.encode(values, 64, 64, bits)
    out = np.full(values.size, 9.0, np.float32)
    payloads = list(selection.payloads(600))
    assert len(payloads) >= 2  # whole tile rows, as many as fit in 600 bytes
    assert sum(sparse_codec.decode_into(out, values.shape, first, data) for first, data in payloads) == values.size
    np.testing.assert_array_equal(out.reshape(values.shape), selection.dense())
    band = 64 * 90
    firsts = [first for first, _ in payloads] + [values.size]
    assert all(len(data) <= 600 or stop - first <= band for (first, data), stop in zip(payloads, firsts[1:]))


def test_two_bits_at_64_of_each_64x64_tile_take_under_a_quarter_bit_per_parameter():
    values = np.random.default_rng(1).standard_normal((512, 512)).astype(np.float32)
    sent = sum(len(data) for _, data in sparse_codec.encode(values, 64, 64, 2).payloads(1 << 20))
    assert sent * 8 / values.size < 0.25


def test_bit_packing_round_trips_every_width():
    rng = np.random.default_rng(3)
    for bits in range(1, 17):
        values = rng.integers(0, 1 << bits, 101)
        packed = sparse_codec.pack_bits(values, bits)
        assert len(packed) == (101 * bits + 7) // 8
        np.testing.assert_array_equal(sparse_codec.unpack_bits(packed, 101, bits), values)


def test_decoder_refuses_what_does_not_fit_the_tensor():
    values = np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32)
    [(first, data)] = list(sparse_codec.encode(values, 4, 2, 2).payloads(1 << 20))
    out = np.zeros(values.size, np.float32)
    with pytest.raises(ValueError, match="shorter than its"):
        sparse_codec.decode_into(out, values.shape, 0, data[:5])
    with pytest.raises(ValueError, match="its header and the tensor's shape make"):
        sparse_codec.decode_into(out, (12, 4), 0, data)  # 48 elements too, in 3 tiles: 6 entries, not 8
    with pytest.raises(ValueError, match="chunk=0"):
        sparse_codec.decode_into(out, values.shape, 0, sparse_codec.HEADER.pack(0, 2, 2, 48) + data[16:])
    with pytest.raises(ValueError, match="not whole bands"):
        sparse_codec.decode_into(out, values.shape, 6, data)


def test_error_feedback_keeps_what_was_not_sent_and_decays_it():
    sparsifier = ErrorFedSparsifier(SparseLoCo(topk=1, chunk=4, bits=32, error_decay=0.5))
    first = np.array([4.0, 1.0, -2.0, 0.5], np.float32)
    sent = sparsifier.compress({"b": first})["b"]
    np.testing.assert_array_equal(sent.dense(), [4.0, 0, 0, 0])
    np.testing.assert_array_equal(sparsifier.errors["b"], [0, 1.0, -2.0, 0.5])
    sent = sparsifier.compress({"b": np.array([0, 0, 0, 1.0], np.float32)})["b"]  # e = 0.5 e + delta
    np.testing.assert_array_equal(sent.dense(), [0, 0, 0, 1.25])
    np.testing.assert_array_equal(sparsifier.errors["b"], [0, 0.5, -1.0, 0])


def test_a_selection_never_applied_goes_back_into_the_error_buffer_as_it_was():
    sparsifier = ErrorFedSparsifier(SparseLoCo(topk=2, chunk=4, bits=2, error_decay=0.5))
    delta = np.random.default_rng(2).standard_normal((6, 5)).astype(np.float32)
    sparsifier.compress({"w": delta})
    sparsifier.unsend(["w"])
    np.testing.assert_array_equal(sparsifier.errors["w"], delta)  # the first buffer is the delta itself


def test_error_feedback_subtracts_the_quantised_values_the_server_decodes():
    sparsifier = ErrorFedSparsifier(SparseLoCo(topk=3, chunk=4, bits=2))
    delta = np.random.default_rng(5).standard_normal((8, 8)).astype(np.float32)
    sent = sparsifier.compress({"w": delta})["w"]
    np.testing.assert_array_equal(sparsifier.errors["w"] + sent.dense(), delta)


@pytest.mark.parametrize("spec,fragment", [
    ({"name": "sparseloco", "topk": 0}, "topk must be an int from 1 to 4096"),
    ({"name": "sparseloco", "chunk": 300}, "chunk must be an int from 1 to 256"),
    ({"name": "sparseloco", "bits": 9}, "bits must be one of"),
    ({"name": "sparseloco", "error_decay": 1.5}, "error_decay must be a number in [0, 1]"),
    ({"name": "sparseloco", "top_k": 64}, "unknown option 'top_k'"),
    ({"name": "sparseloco", "aggregation": "some"}, "aggregation must be one of 'senders', 'all'"),
    ({"name": "dense"}, "compression must be None or a dict with name 'sparseloco'"),
])
def test_bad_compression_options_are_refused_naming_the_option(spec, fragment):
    with pytest.raises(InvalidArgumentError) as info:
        SparseLoCo.from_spec(spec)
    assert fragment in str(info.value)


def test_the_documented_defaults():
    assert SparseLoCo.from_spec({"name": "sparseloco"}) == SparseLoCo(topk=64, chunk=64, bits=2, error_decay=0.95,
                                                                      aggregation="senders")


def test_a_large_pseudo_gradient_compressed_a_tensor_per_thread_equals_each_tensor_compressed_alone():
    """Over the parallel threshold the tensors go to threads (seen by the threads' names); each
    selection and error buffer equals the one a sparsifier holding only that tensor makes."""
    rng = np.random.default_rng(5)
    grads = {f"t{i}": rng.standard_normal((1024, 640 + 64 * i)).astype(np.float32) for i in range(3)}
    assert sum(g.size for g in grads.values()) > sparse_codec.PARALLEL_ELEMENTS
    together = ErrorFedSparsifier(SparseLoCo())
    for _ in range(2):  # the second round carries the error buffers
        selections = together.compress(grads)
    for name, grad in grads.items():
        alone = ErrorFedSparsifier(SparseLoCo())
        for _ in range(2):
            (selection,) = alone.compress({name: grad}).values()
        assert list(selection.payloads(1 << 20)) == list(selections[name].payloads(1 << 20))
        np.testing.assert_array_equal(alone.errors[name], together.errors[name])
    threads = sparse_codec.tensor_map(lambda _: threading.current_thread().name, list(grads),
                                      [g.size for g in grads.values()])
    assert all(name.startswith("sparse-codec") for name in threads) or (os.cpu_count() or 1) < 2, threads
    # tensors too large to hold two at once go one after the other, on the calling thread
    huge = sparse_codec.PARALLEL_IN_FLIGHT // 2 + 1
    assert sparse_codec.tensor_map(lambda _: threading.current_thread().name, [0, 1], [huge, huge]) == \
        [threading.current_thread().name] * 2
