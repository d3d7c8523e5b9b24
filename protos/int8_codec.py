"""int8 gradients on the wire: blockwise absmax quantization, its error feedback, and the chunk payload.

A float32 gradient is cut into blocks of :data:`~optserve.protos.contract.INT8_BLOCK` values
(flat order; a partial last block is zero-padded for the math only). Each block travels as
int8 values ``clip(rint(value / scale), -127, 127)`` with one float32 ``scale = absmax / 127``;
the receiver's value is ``float32(int8) * scale``.

- encode: :func:`quantize_int8` (values -> int8 values, flat, and per-block scales) and
  :func:`quantize_int8_feedback` (the same of ``gradient + residual``, and the new residual:
  what the quantization lost, for error feedback);
- the chunk payload: a chunk holds whole blocks, its ``data`` the int8 values followed by their
  blocks' float32 scales (little-endian); ``offset`` is its first element
  (:func:`int8_payload_bytes`, :func:`int8_count`, :func:`int8_chunk_parts`, :func:`int8_slices`);
- decode: :func:`dequantize_int8` and :func:`write_int8_values` (one chunk into a float32 slice).

The wire enum (:data:`~optserve.protos.contract.INT8`), its option name and the block size are
the contract's (:mod:`optserve.protos.contract`). NumPy only.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import numpy as np

from optserve.protos.contract import INT8_BLOCK

# The smallest scale whose float32 reciprocal is finite is just above this (a block whose absmax
# is below ~3.7e-37): scales at or below it get the reciprocal 0, never inf (inf * 0 would make
# NaN of the block's zeros, and error feedback would carry that NaN on forever).
INT8_MIN_SCALE = np.float32(1) / np.finfo(np.float32).max


# Whole blocks per piece of the quantizer's loop: a piece and its float32 scratch (256 KiB each)
# stay in L2 through the piece's passes, where full-size passes would stream every temporary
# through memory.
INT8_PIECE_BLOCKS = 16


def quantize_int8(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 values (any shape) -> (int8 values, flat; float32 scale per block of
    :data:`INT8_BLOCK`), ``value ~ int8 * scale`` with ``scale = absmax(block) / 127``; an
    all-zero block has scale 0. Non-finite values are not representable (callers refuse them).

    Per block: ``int8 = clip(rint(value * (1 / scale)), -127, 127)`` in float32 (the reciprocal
    is 0 where the scale is not above :data:`INT8_MIN_SCALE`: an all-zero block, or one so tiny
    that its reciprocal would overflow, quantizes to zeros; error feedback keeps its values), then
    cast."""
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    quantized, scales = _int8_outputs(flat.size)
    work = _int8_work(flat.size)
    with _block_row_loops():
        for span in _int8_pieces(flat.size):
            _quantize_rows(_rows(flat, span), _rows(quantized, span), scales[_blocks(span)], work)
        tail = slice(flat.size - flat.size % INT8_BLOCK, flat.size)
        if tail.start < tail.stop:
            _quantize_tail(flat[tail], quantized[tail], scales[-1:], residual=None)
    return quantized, scales


def quantize_int8_feedback(
    gradient: np.ndarray, residual: Optional[np.ndarray]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Error feedback: :func:`quantize_int8` of ``corrected = gradient + residual`` (the gradient
    alone when ``residual`` is None) and the new residual ``corrected - int8 * scale`` per value,
    computed in float32 as ``corrected - rint-and-clipped * scale`` (what the quantization lost).

    ``gradient``: float32 (or convertible), any shape. ``residual``: None or an array of the
    gradient's shape; the new residual overwrites it in place when it is float32, C-contiguous
    and writable, else it is a new array. Returns ``(int8 values, flat; scales; new residual,
    the gradient's shape)``. The sum warns as NumPy does; the quantization is silent about
    non-finite values (callers refuse them, or let them through when the session allows them).
    """
    gradient = np.asarray(gradient, np.float32)
    flat = np.ascontiguousarray(gradient).reshape(-1)
    reusable = (residual is not None and residual.dtype == np.float32 and residual.flags.c_contiguous
                and residual.flags.writeable)
    new_residual = residual if reusable else np.empty(gradient.shape, np.float32)
    out = new_residual.reshape(-1)
    previous = None if residual is None else residual.reshape(-1)
    quantized, scales = _int8_outputs(flat.size)
    work = _int8_work(flat.size)
    with _block_row_loops():
        for span in _int8_pieces(flat.size):
            rows = _add_residual(flat, previous, out, span).reshape(-1, INT8_BLOCK)
            with np.errstate(invalid="ignore", over="ignore"):
                _quantize_rows(rows, _rows(quantized, span), scales[_blocks(span)], work, residual=_rows(out, span))
        tail = slice(flat.size - flat.size % INT8_BLOCK, flat.size)
        if tail.start < tail.stop:
            values = _add_tail_residual(flat, previous, tail)
            with np.errstate(invalid="ignore", over="ignore"):
                _quantize_tail(values, quantized[tail], scales[-1:], residual=out[tail])
    return quantized, scales, new_residual


def _int8_outputs(count: int) -> tuple[np.ndarray, np.ndarray]:
    """Fresh outputs for ``count`` values: int8 values ``(count,)`` and float32 scales ``(blocks,)``."""
    return np.empty(count, np.int8), np.empty(-(-count // INT8_BLOCK), np.float32)


def _int8_work(count: int) -> np.ndarray:
    """float32 scratch rows for the piece loop over ``count`` values: at most one piece."""
    return np.empty((min(INT8_PIECE_BLOCKS, count // INT8_BLOCK), INT8_BLOCK), np.float32)


def _int8_pieces(count: int) -> Iterator[slice]:
    """Element spans of :data:`INT8_PIECE_BLOCKS` whole blocks (the last fewer) covering the whole
    blocks of ``count`` values (a partial last block is :func:`_quantize_tail`'s)."""
    whole = count - count % INT8_BLOCK
    step = INT8_PIECE_BLOCKS * INT8_BLOCK
    for start in range(0, whole, step):
        yield slice(start, min(start + step, whole))


def _rows(flat: np.ndarray, span: slice) -> np.ndarray:
    """``flat[span]`` (whole blocks) as a ``(blocks, INT8_BLOCK)`` view."""
    return flat[span].reshape(-1, INT8_BLOCK)


def _blocks(span: slice) -> slice:
    """The block indices of an element span that starts at a block boundary."""
    return slice(span.start // INT8_BLOCK, -(-span.stop // INT8_BLOCK))


def _add_residual(gradient: np.ndarray, previous: Optional[np.ndarray], out: np.ndarray, span: slice) -> np.ndarray:
    """The corrected values of a span of whole blocks (flat float32 arrays): ``gradient[span] +
    previous[span]`` written into ``out[span]`` (``out`` may be ``previous``), or
    ``gradient[span]`` itself (no copy) when ``previous`` is None. A span of whole blocks lies in
    the vector body of NumPy's add loop, as these values did in the whole-tensor ``corrected +=
    previous``: the same NaN of two is kept."""
    if previous is None:
        return gradient[span]
    return np.add(gradient[span], previous[span], out=out[span])


def _add_tail_residual(gradient: np.ndarray, previous: Optional[np.ndarray], tail: slice) -> np.ndarray:
    """The corrected values of the partial last block: ``gradient[tail] + previous[tail]`` (a new
    array), or the gradient's own values when ``previous`` is None.

    Which NaN of two an add keeps depends on where NumPy's loop handles the value (vector body or
    remainder; a one-value array is a case of its own). Starting one block early, where a block
    precedes, gives each value the place it had in the whole-tensor ``corrected =
    gradient.copy(); corrected += previous``."""
    if previous is None:
        return gradient[tail]
    start = max(0, tail.start - INT8_BLOCK)
    corrected = gradient[start : tail.stop].copy()
    corrected += previous[start : tail.stop]
    return corrected[tail.start - start :]


def _quantize_rows(rows: np.ndarray, quantized: np.ndarray, scales: np.ndarray, work: np.ndarray,
                   residual: Optional[np.ndarray] = None) -> None:
    """Quantizes ``rows`` ``(k, INT8_BLOCK)`` float32, one block per row, into ``quantized``
    ``(k, INT8_BLOCK)`` int8 and ``scales`` ``(k,)`` float32; ``residual`` (``(k, INT8_BLOCK)``
    float32, may be ``rows`` itself) receives ``rows - rounded * scale``. ``work``: float32
    scratch of at least ``k`` rows."""
    work = work[: len(rows)]
    inverse, in_range = _block_scales(rows, scales)
    np.multiply(rows, inverse[:, None], out=work)
    np.rint(work, out=work)
    if not in_range:
        np.clip(work, -127, 127, out=work)
    np.copyto(quantized, work, casting="unsafe")
    if residual is not None:
        _times_scales(work, scales, maybe_nan=not in_range)
        np.subtract(rows, work, out=residual)


def _times_scales(rows: np.ndarray, scales: np.ndarray, maybe_nan: bool) -> None:
    """``rows *= scales[:, None]`` in place (``(k, INT8_BLOCK)`` and ``(k,)`` float32).

    A NaN scale (a block holding NaN; only ``maybe_nan`` pieces can have one) takes the contiguous
    loop with the scales repeated per value: of two NaN operands, NumPy's broadcast loop keeps the
    scale's NaN, the contiguous loop the value's, and the value's (the NaN of ``inf * 0``) is what
    residuals always held."""
    if maybe_nan and np.isnan(scales).any():
        np.multiply(rows, np.repeat(scales, INT8_BLOCK).reshape(rows.shape), out=rows)
    else:
        np.multiply(rows, scales[:, None], out=rows)


def _block_scales(rows: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, bool]:
    """Writes each row's ``absmax / 127`` into ``scales`` (float32, ``(k,)``; ``abs`` makes an
    all-zero row's +0.0); returns the reciprocals (0 where a scale is not above
    :data:`INT8_MIN_SCALE`: zero, too tiny to invert, or NaN)
    and whether every row is known to round within +-127 (then no clip is needed, and no scale
    is NaN).

    Knowing is exact: rounding is monotonic, so no value of a row rounds beyond
    ``rint(absmax * reciprocal)``, at most 127 exactly when ``absmax * reciprocal < 127.5``;
    that holds unless the row holds NaN or inf, or its scale is so small (subnormal) that the
    reciprocal loses precision or overflows."""
    absmax = rows.max(axis=1, initial=-np.inf)
    low = rows.min(axis=1, initial=np.inf)
    np.negative(low, out=low)
    np.maximum(absmax, low, out=absmax)
    np.abs(absmax, out=absmax)
    np.divide(absmax, np.float32(127), out=scales)
    positive = scales > INT8_MIN_SCALE
    if positive.all():
        inverse = np.divide(np.float32(1), scales)
    else:
        inverse = np.divide(np.float32(1), scales, out=np.zeros_like(scales), where=positive)
    with np.errstate(invalid="ignore"):  # inf * 0 (a row holding inf): NaN, not in range
        np.multiply(absmax, inverse, out=absmax)
    return inverse, bool((absmax < 127.5).all())  # rint(peak) <= 127 (127.5 rounds to even 128)


def _quantize_tail(values: np.ndarray, quantized: np.ndarray, scale: np.ndarray,
                   residual: Optional[np.ndarray]) -> None:
    """A partial last block: ``values`` (flat float32, fewer than :data:`INT8_BLOCK`) zero-padded
    to a whole block, as the block quantization defines it, into ``quantized`` (int8, same size),
    ``scale`` (float32, ``(1,)``) and ``residual`` (float32, same size) if given."""
    row = np.zeros((1, INT8_BLOCK), np.float32)
    row[0, : values.size] = values
    q_row = np.empty((1, INT8_BLOCK), np.int8)
    _quantize_rows(row, q_row, scale, np.empty_like(row), residual=None if residual is None else row)
    quantized[:] = q_row[0, : values.size]
    if residual is not None:
        residual[:] = row[0, : values.size]


def dequantize_int8(quantized: np.ndarray, scales: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
    """The float32 values of int8 ``quantized`` (flat, starting at a block boundary) and their
    blocks' ``scales``; into ``out`` (flat float32 of the same size) if given.

    Each value is ``float32(int8) * scale`` in float32, written straight into ``out`` (the
    scales broadcast over ``(blocks, INT8_BLOCK)`` rows, never repeated per value)."""
    quantized = np.asarray(quantized, np.int8).reshape(-1)
    scales = np.asarray(scales, np.float32)
    if out is None:
        out = np.empty(quantized.size, np.float32)
    whole = quantized.size - quantized.size % INT8_BLOCK
    with _block_row_loops():
        np.multiply(quantized[:whole].reshape(-1, INT8_BLOCK), scales[: whole // INT8_BLOCK, None],
                    out=out[:whole].reshape(-1, INT8_BLOCK), dtype=np.float32)
    if whole < quantized.size:
        np.multiply(quantized[whole:], scales[whole // INT8_BLOCK], out=out[whole:], dtype=np.float32)
    return out


@contextlib.contextmanager
def _block_row_loops() -> Iterator[None]:
    """Sets NumPy's ufunc buffer to one block for the ``with`` body (restored after, thread-local).

    A per-row operand (``scales[:, None]`` against ``(k, INT8_BLOCK)`` rows) or a cast makes
    ufuncs iterate with buffers; with the default 8192-element buffer NumPy packs two rows per
    buffer and copies the broadcast operand into it, where one row per inner loop needs no copy.
    The values computed do not depend on the buffer size, except which NaN of two a multiply
    keeps (:func:`_times_scales`)."""
    previous = np.setbufsize(INT8_BLOCK)
    try:
        yield
    finally:
        np.setbufsize(previous)


def int8_payload_bytes(count: int) -> int:
    """Bytes of an int8 chunk's ``data`` holding ``count`` elements (values, then scales)."""
    return count + 4 * -(-count // INT8_BLOCK)


def int8_count(nbytes: int) -> Optional[int]:
    """The element count of an int8 chunk whose ``data`` has ``nbytes`` bytes; None if no count fits."""
    full, rest = divmod(nbytes, INT8_BLOCK + 4)
    if rest == 0:
        return full * INT8_BLOCK
    return full * INT8_BLOCK + rest - 4 if rest > 4 else None


def int8_chunk_parts(quantized: np.ndarray, scales: np.ndarray,
                     chunk_bytes: int) -> Iterator[tuple[int, tuple[memoryview, memoryview]]]:
    """``(first element index, (values, scales))`` of int8 chunks of about ``chunk_bytes`` (whole
    blocks): byte memoryviews into ``quantized`` (flat int8) and ``scales`` (float32), no copies;
    a chunk's ``data`` is the two joined. An empty tensor gives one empty chunk."""
    if quantized.size == 0:
        yield 0, (memoryview(b""), memoryview(b""))
        return
    per_chunk = max(1, chunk_bytes // (INT8_BLOCK + 4)) * INT8_BLOCK
    raw = quantized.view(np.uint8)
    scale_bytes = np.ascontiguousarray(scales, "<f4").view(np.uint8)
    for start in range(0, quantized.size, per_chunk):
        stop = min(start + per_chunk, quantized.size)
        first, last = start // INT8_BLOCK, -(-stop // INT8_BLOCK)
        yield start, (memoryview(raw[start:stop]), memoryview(scale_bytes[4 * first : 4 * last]))


def int8_slices(quantized: np.ndarray, scales: np.ndarray, chunk_bytes: int) -> Iterator[tuple[int, bytes]]:
    """``(first element index, data)`` of int8 chunks of about ``chunk_bytes`` (whole blocks),
    each ``data`` built with one copy (:func:`int8_chunk_parts` joined); an empty tensor gives
    one empty chunk."""
    for start, parts in int8_chunk_parts(quantized, scales, chunk_bytes):
        yield start, b"".join(parts)


def write_int8_values(target: np.ndarray, data: Any) -> None:
    """Dequantizes one int8 chunk's ``data`` into ``target`` (flat float32 slice of exactly its
    element count, starting at a block boundary).

    Raises:
      ValueError: ``data`` does not hold ``target.size`` elements and their scales.
    """
    if target.dtype != np.float32:
        raise ValueError(f"int8 gradients decode into float32, not {target.dtype}")
    count = target.size
    if len(data) != int8_payload_bytes(count):
        raise ValueError(f"{len(data)} bytes of int8 do not hold {count} elements and their scales")
    raw = np.frombuffer(data, np.uint8)
    dequantize_int8(raw[:count].view(np.int8), raw[count:].view("<f4"), out=target)
