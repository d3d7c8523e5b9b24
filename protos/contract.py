"""The wire contract, defined once: what the client and the server must agree on beyond the .proto files.

- chunk sizes: :data:`DEFAULT_CHUNK_BYTES` and the one range :func:`clamp_chunk_bytes` applies, to
  what a client sends and asks for and to what a shard answers a pull with;
- wire dtypes (:data:`FLOAT32`, :data:`BFLOAT16`, :data:`FLOAT16`, :data:`ITEMSIZE`,
  :func:`dtype_enum`) and bfloat16 narrowing / widening on bit patterns (no ml_dtypes needed);
- the encode direction: :func:`wire_bytes` (an array's flat bytes in a wire dtype) and
  :func:`slices` (those bytes cut into chunks);
- the decode direction: :func:`write_wire_values` (one chunk's bytes into a slice of a target array);
- trailing metadata keys, reject reason names, and the gRPC channel / server options.

The byte-level message codec (chunk messages written and read without copying tensor bytes twice)
is :mod:`optserve.protos.chunk_codec`. NumPy and the generated protobuf modules only: bfloat16
arrays (ml_dtypes) are recognised by their dtype name and handled as uint16 bit patterns. Bytes
on the wire are little-endian; NumPy's native order on every supported host.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Union

import numpy as np

from optserve.protos.optserve.v1 import control_pb2, tensor_pb2

# --- chunk sizes -----------------------------------------------------------------------------

# 1 MiB measured fastest: each chunk is copied about three times on its way out, best while it
# stays in L2.
DEFAULT_CHUNK_BYTES = 1 << 20
# The floor bounds the number of messages per tensor (a 1 GiB tensor is at most 16 Ki chunks),
# so no request can make a shard answer with millions of tiny messages.
MIN_CHUNK_BYTES = 64 << 10
# The ceiling keeps a chunk message far below MAX_MESSAGE_BYTES, below glibc's mmap threshold that
# optserve.protos.heap keeps freed chunks under (32 MiB), and a few chunks inside LOOKAHEAD_BYTES.
MAX_CHUNK_BYTES = 4 << 20


def clamp_chunk_bytes(requested: Optional[int]) -> int:
    """The chunk size in bytes for a request: ``None`` or 0 -> :data:`DEFAULT_CHUNK_BYTES`, others
    clamped to [:data:`MIN_CHUNK_BYTES`, :data:`MAX_CHUNK_BYTES`]."""
    if not requested:
        return DEFAULT_CHUNK_BYTES
    return min(max(int(requested), MIN_CHUNK_BYTES), MAX_CHUNK_BYTES)


# --- wire dtypes -----------------------------------------------------------------------------

FLOAT32 = tensor_pb2.DTYPE_FLOAT32
BFLOAT16 = tensor_pb2.DTYPE_BFLOAT16
FLOAT16 = tensor_pb2.DTYPE_FLOAT16
ITEMSIZE = {FLOAT32: 4, BFLOAT16: 2, FLOAT16: 2}
DTYPE_NAMES = {FLOAT32: "float32", BFLOAT16: "bfloat16", FLOAT16: "float16"}  # NumPy / ml_dtypes names
_BY_NAME = {"float32": FLOAT32, "f32": FLOAT32, "bfloat16": BFLOAT16, "bf16": BFLOAT16, "float16": FLOAT16,
            "f16": FLOAT16}

DTypeLike = Union[str, int, np.dtype, type, None]


def dtype_enum(dtype: DTypeLike) -> Optional[int]:
    """The wire enum of ``dtype``: a name (``"bf16"``, ``"float32"``, ...), a NumPy dtype or type
    (``np.float16``, ml_dtypes' ``bfloat16``) or an enum value; ``None`` stays ``None``.

    Raises:
      ValueError: any other dtype (the message names it and the supported ones).
    """
    if dtype is None:
        return None
    if isinstance(dtype, (int, np.integer)) and not isinstance(dtype, bool):
        if int(dtype) in ITEMSIZE:
            return int(dtype)
        raise ValueError(f"unsupported dtype enum value {int(dtype)} (float32, bfloat16, float16)")
    try:
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    except (TypeError, ValueError):
        name = None
    enum = _BY_NAME.get(name.lower()) if isinstance(name, str) else None
    if enum is None:
        raise ValueError(f"unsupported dtype {dtype!r} (float32, bfloat16, float16)")
    return enum


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 values -> bfloat16 bit patterns (uint16, same shape), rounded to nearest even.

    Overflow rounds to +-inf; NaN stays NaN (quiet, sign kept).
    """
    f32 = np.ascontiguousarray(x, dtype=np.float32)
    bits = f32.view(np.uint32)
    rounded = np.right_shift(bits, np.uint32(16))
    np.bitwise_and(rounded, np.uint32(1), out=rounded)  # the kept part's lowest bit: ties go to even
    np.add(rounded, np.uint32(0x7FFF), out=rounded)
    np.add(rounded, bits, out=rounded)
    np.right_shift(rounded, np.uint32(16), out=rounded)
    out = rounded.astype(np.uint16)
    nan = np.isnan(f32)
    if nan.any():  # rounding could carry a NaN's payload into the exponent (or wrap): keep it NaN
        out[nan] = (bits[nan] >> np.uint32(16)).astype(np.uint16) | np.uint16(0x0040)
    return out


def bf16_bits_to_f32(bits: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 values (exact); into ``out`` (float32) if given."""
    bits = np.asarray(bits, dtype=np.uint16)
    if out is None:
        out = np.empty(bits.shape, np.float32)
    np.left_shift(bits, np.uint32(16), out=out.view(np.uint32), dtype=np.uint32)
    return out


# --- int8 gradients: blockwise absmax quantization ------------------------------------------------

INT8 = tensor_pb2.DTYPE_INT8
INT8_BLOCK = 4096  # elements per quantization block (one float32 scale each: 0.1% overhead)
INT8_NAME = "int8"
# The smallest scale whose float32 reciprocal is finite is just above this (a block whose absmax
# is below ~3.7e-37): scales at or below it get the reciprocal 0, never inf (inf * 0 would make
# NaN of the block's zeros, and error feedback would carry that NaN on forever).
INT8_MIN_SCALE = np.float32(1) / np.finfo(np.float32).max


def wire_option_enum(dtype: DTypeLike) -> Optional[int]:
    """A requested *wire* dtype: :func:`dtype_enum`'s, or ``"int8"`` / :data:`INT8` (gradients only)."""
    if isinstance(dtype, str) and dtype.lower() == INT8_NAME:
        return INT8
    if isinstance(dtype, (int, np.integer)) and not isinstance(dtype, bool) and int(dtype) == INT8:
        return INT8
    return dtype_enum(dtype)


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


# --- encode: arrays -> chunk bytes -------------------------------------------------------------


def wire_bytes(array: np.ndarray, wire: int) -> memoryview:
    """The flat little-endian bytes of ``array`` in wire dtype ``wire``, as a byte memoryview.

    ``array``: float32, float16 or bfloat16 (ml_dtypes, recognised by name). No copy when the
    array already is C-contiguous in the wire dtype. Values beyond float16's range become +-inf.

    Raises:
      ValueError: an unsupported array dtype or wire enum value.
    """
    wire = _checked_wire(wire)
    array = np.asarray(array)
    source = array.dtype.name
    if source not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"unsupported array dtype {array.dtype} (float32, bfloat16, float16)")
    if source == "bfloat16":
        bits = np.ascontiguousarray(array).view(np.uint16)
        if wire == BFLOAT16:
            raw = bits
        else:
            widened = bf16_bits_to_f32(bits)
            raw = widened if wire == FLOAT32 else _to_f16(widened)
    elif wire == BFLOAT16:
        raw = f32_to_bf16_bits(array)
    elif wire == FLOAT16:
        raw = _to_f16(array)
    else:
        raw = np.ascontiguousarray(array, dtype=np.float32)
    return memoryview(raw.reshape(-1).view(np.uint8))


def slices(raw: memoryview, itemsize: int, chunk_bytes: int) -> Iterator[tuple[int, memoryview]]:
    """``(byte offset, bytes)`` pieces of ``raw`` in order, each at most ``chunk_bytes`` rounded
    down to whole elements (at least one element); an empty ``raw`` gives one empty piece."""
    if len(raw) == 0:
        yield 0, raw
        return
    step = max(itemsize, chunk_bytes - chunk_bytes % itemsize)
    for offset in range(0, len(raw), step):
        yield offset, raw[offset : offset + step]


# --- decode: chunk bytes -> arrays -------------------------------------------------------------


def write_wire_values(target: np.ndarray, data: Any, wire: int) -> None:
    """Writes one chunk's values (``data``: bytes-like, elements of wire dtype ``wire``) into
    ``target``, a flat C-contiguous slice of dtype float32, float16 or bfloat16 (ml_dtypes) with
    exactly as many elements; converts where the dtypes differ (a plain copy where they agree).

    Raises:
      ValueError: an unsupported dtype, or ``data`` does not hold ``target.size`` elements.
    """
    wire = _checked_wire(wire)
    kind = target.dtype.name
    if kind not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"unsupported target dtype {target.dtype} (float32, bfloat16, float16)")
    if len(data) != target.size * ITEMSIZE[wire]:
        raise ValueError(f"{len(data)} bytes of {DTYPE_NAMES[wire]} do not fill {target.size} elements")
    if kind == DTYPE_NAMES[wire]:
        target.view(np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)
    elif wire == BFLOAT16:
        bits = np.frombuffer(data, dtype=np.uint16)
        if kind == "float32":
            bf16_bits_to_f32(bits, out=target)
        else:
            with np.errstate(over="ignore"):
                target[:] = bf16_bits_to_f32(bits)
    else:
        values = np.frombuffer(data, dtype=np.float32 if wire == FLOAT32 else np.float16)
        if kind == "bfloat16":
            target.view(np.uint16)[:] = f32_to_bf16_bits(values)
        else:
            with np.errstate(over="ignore"):  # float32 beyond float16's range: +-inf
                target[:] = values


def _to_f16(values: np.ndarray) -> np.ndarray:
    """float16, C-contiguous; beyond float16's range is +-inf (IEEE rounding), without a warning."""
    with np.errstate(over="ignore"):
        return np.ascontiguousarray(values, dtype=np.float16)


def _checked_wire(wire: int) -> int:
    if wire not in ITEMSIZE:
        raise ValueError(f"unsupported wire dtype enum value {wire!r} (float32, bfloat16, float16)")
    return wire


# --- push telemetry (PushHeader.loss / scalars) -------------------------------------------------

MAX_SCALARS = 16  # scalars per push
MAX_SCALAR_NAME = 64  # characters in a scalar's name
# Characters of a push's client_id (the SDK sends 32 hex digits): shards remember client ids
# (idempotency, expired pushes), so they are bounded.
MAX_CLIENT_ID_CHARS = 256


# --- metadata, reject reasons, gRPC options ----------------------------------------------------

# Trailing metadata of an ABORTED push: the session's version when it was refused as stale ...
CURRENT_VERSION_KEY = "optserve-current-version"
# ... or "1" when another shard refused its part of the push (applied nowhere).
PEER_REFUSED_KEY = "optserve-peer-refused"
# ... or "1" beside the current version when an elastic session dropped a late gradient.
LATE_KEY = "optserve-late"

# How status reports and clients name each RejectReason.
REJECT_REASON_NAMES: dict[int, str] = {
    control_pb2.REJECT_REASON_INVALID: "invalid",
    control_pb2.REJECT_REASON_NONFINITE: "nonfinite",
    control_pb2.REJECT_REASON_STALE: "stale",
    control_pb2.REJECT_REASON_ABORTED: "aborted",
}
REJECT_REASONS_BY_NAME: dict[str, int] = {name: reason for reason, name in REJECT_REASON_NAMES.items()}

MAX_MESSAGE_BYTES = 64 << 20
# How far a stream may run ahead of what its reader has consumed (gRPC's default is 64 KiB): the
# peer keeps sending chunks while this side copies the previous ones.
LOOKAHEAD_BYTES = 16 << 20
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.lookahead_bytes", LOOKAHEAD_BYTES),
)
# Servers also refuse to share their port with another process.
SERVER_OPTIONS: tuple[tuple[str, int], ...] = CHANNEL_OPTIONS + (("grpc.so_reuseport", 0),)
