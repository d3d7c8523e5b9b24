"""What int8 gradients cost in CPU: the codec's three steps on ~100M float32 values, the reference
whole-tensor formulation against the current code, same run.

    .venv/bin/python -m bench.int8_codec            # 6 x 4096 x 4096 float32 gradients (~100M values)
    .venv/bin/python -m bench.int8_codec --small    # 6 x 512 x 512, a quick smoke run

Rows, each the median over rounds in which every variant takes its turn (after one warm-up round),
the ratio the median of the per-round ratios (reference / current):

- error feedback: ``ErrorFeedback.quantize`` of the six tensors (each gradient plus its residual
  quantized blockwise, the residual updated), the client's work before an int8 push;
- chunk messages: every serialized chunk message of the six tensors (``tensor_chunks.int8_chunk_messages``,
  ``--chunk-bytes``), each dropped once built, as a stream consumes them;
- dequantize: every chunk's data decoded into a preallocated float32 array
  (``write_int8_values``), a shard's work per received chunk.

The reference is the formulation the codec replaced, kept here: full-size temporaries per pass,
a padded copy for sizes that are not whole blocks, ``np.repeat``-ed scales, chunk data built
with ``tobytes()`` and concatenation. Both sides are checked to agree bit for bit before the
timing. The process keeps freed message memory as the client does (:mod:`optserve.client._heap`).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Iterator, Optional

import numpy as np

from bench._timing import print_table
from bench.service import interleaved_seconds
from optserve.client import _heap, _wire
from optserve.protos import chunk_codec, contract, int8_codec, tensor_chunks

BLOCK = contract.INT8_BLOCK


# --- the reference formulation ---------------------------------------------------------------


def reference_quantize(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(int8 values, scales, rounded values times their scales), whole tensor per pass."""
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    blocks = -(-flat.size // BLOCK)
    if flat.size % BLOCK:
        padded = np.zeros(blocks * BLOCK, np.float32)
        padded[: flat.size] = flat
    else:
        padded = flat
    grid = padded.reshape(blocks, BLOCK)
    absmax = np.maximum(grid.max(axis=1, initial=-np.inf), -grid.min(axis=1, initial=np.inf))
    scales = (np.abs(absmax) / np.float32(127)).astype(np.float32)
    inverse = np.divide(np.float32(1), scales, out=np.zeros_like(scales), where=scales > int8_codec.INT8_MIN_SCALE)
    rounded = np.multiply(grid, inverse[:, None])
    np.rint(rounded, out=rounded)
    np.clip(rounded, -127, 127, out=rounded)
    quantized = rounded.astype(np.int8).reshape(-1)[: flat.size]
    np.multiply(rounded, scales[:, None], out=rounded)
    return quantized, scales, rounded.reshape(-1)[: flat.size]


class ReferenceFeedback:
    """Error feedback as the reference did it: a fresh corrected copy per push, which becomes the
    next residual."""

    def __init__(self):
        self.residuals: dict[str, np.ndarray] = {}

    def quantize(self, grads: dict[str, np.ndarray]) -> dict[str, tensor_chunks.Int8Gradient]:
        out = {}
        for name, grad in grads.items():
            corrected = np.asarray(grad, np.float32).astype(np.float32, copy=True)
            residual = self.residuals.get(name)
            if residual is not None and residual.shape == corrected.shape:
                corrected += residual
            with np.errstate(invalid="ignore", over="ignore"):
                quantized, scales, applied = reference_quantize(corrected)
                self.residuals[name] = np.subtract(corrected, applied.reshape(corrected.shape), out=corrected)
            out[name] = tensor_chunks.Int8Gradient(quantized, scales, tuple(corrected.shape))
        return out


def reference_slices(quantized: np.ndarray, scales: np.ndarray, chunk_bytes: int) -> Iterator[tuple[int, bytes]]:
    """``(first element, data)`` per chunk, data = values' bytes + scales' bytes (two copies each)."""
    if quantized.size == 0:
        yield 0, b""
        return
    per_chunk = max(1, chunk_bytes // (BLOCK + 4)) * BLOCK
    raw = quantized.view(np.uint8)
    for start in range(0, quantized.size, per_chunk):
        stop = min(start + per_chunk, quantized.size)
        block_scales = scales[start // BLOCK : -(-stop // BLOCK)]
        yield start, raw[start:stop].tobytes() + block_scales.astype("<f4").tobytes()


def reference_messages(name: str, grad: tensor_chunks.Int8Gradient, chunk_bytes: int) -> Iterator[bytes]:
    for offset, data in reference_slices(grad.quantized, grad.scales, chunk_bytes):
        yield chunk_codec.encode_chunk_message(name, contract.INT8, grad.shape, offset, data)


def reference_write(target: np.ndarray, data) -> None:
    """One chunk dequantized with the scales repeated per value (a full-size temporary)."""
    count = target.size
    raw = np.frombuffer(data, np.uint8)
    per_element = np.repeat(raw[count:].view("<f4").astype(np.float32), BLOCK)[:count]
    np.multiply(raw[:count].view(np.int8), per_element, out=target, dtype=np.float32)


# --- the run ---------------------------------------------------------------------------------


def _drain(messages: Iterator[bytes]) -> int:
    """Builds and drops every message; their total size."""
    return sum(len(message) for message in messages)


def _chunks(encoded: dict[str, tensor_chunks.Int8Gradient], chunk_bytes: int) -> list[tuple[str, int, int, memoryview]]:
    """(tensor, first element, element count, data) of every chunk, as a shard receives them."""
    return [(name, start, int8_codec.int8_count(len(data)), memoryview(data))
            for name, grad in encoded.items() for start, data in int8_codec.int8_slices(grad.quantized, grad.scales, chunk_bytes)]


def _decode(write, chunks, outs: dict[str, np.ndarray]) -> None:
    for name, start, count, data in chunks:
        write(outs[name][start : start + count], data)


def _check_same(reference: dict[str, tensor_chunks.Int8Gradient], current: dict[str, tensor_chunks.Int8Gradient],
                residuals: tuple[dict, dict]) -> None:
    """The two formulations' outputs agree bit for bit (values, scales, residuals)."""
    for name in reference:
        for a, b in ((reference[name].quantized, current[name].quantized), (reference[name].scales, current[name].scales),
                     (residuals[0][name], residuals[1][name])):
            if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
                raise AssertionError(f"reference and current int8 codec differ on {name!r}")


def main(argv: Optional[list[str]] = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="6 x 512 x 512 instead of 6 x 4096 x 4096")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk-bytes", type=int, default=contract.MAX_CHUNK_BYTES)
    args = parser.parse_args(argv)
    _heap.retain_freed_memory()
    dim = 512 if args.small else 4096
    rng = np.random.default_rng(0)
    grads = {f"layer{i}/w": rng.standard_normal((dim, dim), dtype=np.float32) * 1e-3 for i in range(6)}
    values = sum(g.size for g in grads.values())

    feedback = {"reference": ReferenceFeedback(), "current": _wire.ErrorFeedback()}
    encoded = {name: fb.quantize(grads) for name, fb in feedback.items()}
    _check_same(encoded["reference"], encoded["current"], (feedback["reference"].residuals, feedback["current"].residuals))
    chunks = _chunks(encoded["current"], args.chunk_bytes)
    outs = {name: {t: np.empty(g.size, np.float32) for t, g in grads.items()} for name in feedback}
    writes = {"reference": reference_write, "current": int8_codec.write_int8_values}
    messages = {"reference": reference_messages, "current": tensor_chunks.int8_chunk_messages}
    for name in feedback:
        _decode(writes[name], chunks, outs[name])
    if any(outs["reference"][t].tobytes() != outs["current"][t].tobytes() for t in grads):
        raise AssertionError("reference and current dequantization differ")
    first = next(iter(grads))
    built = [list(messages[name](first, encoded["current"][first], args.chunk_bytes)) for name in feedback]
    if built[0] != built[1]:
        raise AssertionError("reference and current chunk messages differ")

    fns = {}
    for name in feedback:
        fns[("error feedback", name)] = lambda fb=feedback[name]: fb.quantize(grads)
        fns[("chunk messages", name)] = lambda m=messages[name], e=encoded[name]: [
            _drain(m(t, g, args.chunk_bytes)) for t, g in e.items()]
        fns[("dequantize", name)] = lambda w=writes[name], o=outs[name]: _decode(w, chunks, o)
    samples, _ = interleaved_seconds(fns, rounds=args.repeats)

    notes = {
        "error feedback": f"ErrorFeedback.quantize, 6 tensors of {dim} x {dim}",
        "chunk messages": f"tensor_chunks.int8_chunk_messages, {args.chunk_bytes >> 10} KiB chunks, {len(chunks)} messages",
        "dequantize": "write_int8_values per chunk into preallocated float32",
    }
    rows = []
    for case, note in notes.items():
        ref, cur = samples[(case, "reference")], samples[(case, "current")]
        ratio = statistics.median(r / c for r, c in zip(ref, cur))
        rows.append([case, statistics.median(ref) * 1e3, statistics.median(cur) * 1e3, f"{ratio:.2f}x", note])
    title = (f"bench.int8_codec: {values / 1e6:.1f}M float32 values, median of {args.repeats} interleaved rounds "
             f"after a warm-up")
    return print_table(title, ["step", "reference ms", "current ms", "ratio", "note"], rows)


if __name__ == "__main__":
    main()
