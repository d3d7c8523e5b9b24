"""Tensors on the wire, NumPy only: dtypes, bfloat16 conversion, chunking, reassembly.

The one place the client decides chunk sizes. bfloat16 is handled with uint32 bit operations
(round to nearest even), so the client needs neither jax nor ml_dtypes.
"""

from __future__ import annotations

from typing import Iterator, Mapping, Optional, Union

import numpy as np

from optserve.protos import chunk_codec
from optserve.client.errors import InvalidArgumentError
from optserve.protos.optserve.v1 import tensor_pb2

DEFAULT_CHUNK_BYTES = 1 << 20  # cache-sized: each chunk is copied three times on its way out, best while it stays in L2
MIN_CHUNK_BYTES, MAX_CHUNK_BYTES = 1 << 20, 4 << 20

FLOAT32, BFLOAT16, FLOAT16 = tensor_pb2.DTYPE_FLOAT32, tensor_pb2.DTYPE_BFLOAT16, tensor_pb2.DTYPE_FLOAT16
_NAMES = {"float32": FLOAT32, "f32": FLOAT32, "bfloat16": BFLOAT16, "bf16": BFLOAT16, "float16": FLOAT16, "f16": FLOAT16}
ITEMSIZE = {FLOAT32: 4, BFLOAT16: 2, FLOAT16: 2}

DTypeLike = Union[str, int, np.dtype, None]


def dtype_enum(dtype: DTypeLike, *, what: str) -> Optional[int]:
    """``"bf16"`` / ``"float32"`` / ``np.float16`` / enum value -> wire enum; None stays None."""
    if dtype is None:
        return None
    if isinstance(dtype, int) and dtype in ITEMSIZE:
        return dtype
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    try:
        return _NAMES[name.lower()]
    except KeyError:
        raise InvalidArgumentError(f"{what}: unsupported dtype {dtype!r} (float32, bfloat16, float16)") from None


def array_dtype_enum(array: np.ndarray, *, name: str) -> int:
    """The wire enum of an array's own dtype (ml_dtypes' bfloat16 is recognised by name)."""
    return dtype_enum(array.dtype.name, what=f"tensor {name!r}")


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    out = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan.reshape(out.shape)] = np.uint16(0x7FC0)
    return out


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 (exact)."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def encode(array: np.ndarray, wire: int) -> memoryview:
    """The little-endian bytes of ``array`` in the wire dtype, flat, as a byte memoryview."""
    if wire == BFLOAT16:
        if array.dtype.name == "bfloat16":
            raw = np.ascontiguousarray(array).view(np.uint16)
        else:
            raw = f32_to_bf16_bits(np.asarray(array, dtype=np.float32))
    elif wire == FLOAT16:
        raw = np.ascontiguousarray(array, dtype=np.float16)
    else:
        source = array.astype(np.float32) if array.dtype.name == "bfloat16" else array
        raw = np.ascontiguousarray(source, dtype=np.float32)
    return memoryview(raw.reshape(-1).view(np.uint8))


def chunk_size(requested: Optional[int]) -> int:
    """Chunk size in bytes, clamped to [1 MB, 4 MB]."""
    return min(max(requested or DEFAULT_CHUNK_BYTES, MIN_CHUNK_BYTES), MAX_CHUNK_BYTES)


def _slices(array: np.ndarray, wire: int, chunk_bytes: int) -> Iterator[tuple[int, memoryview]]:
    """(byte offset, bytes view) pieces of ``array`` converted to ``wire``, in order (one if empty)."""
    raw = encode(array, wire)
    step = chunk_bytes - chunk_bytes % ITEMSIZE[wire]
    if len(raw) == 0:
        yield 0, raw
        return
    for offset in range(0, len(raw), step):
        yield offset, raw[offset : offset + step]


def iter_chunks(name: str, array: np.ndarray, wire: int, chunk_bytes: int) -> Iterator[tensor_pb2.TensorChunk]:
    """``TensorChunk`` messages covering ``array`` (converted to ``wire``) in order."""
    shape = list(array.shape)
    for offset, data in _slices(array, wire, chunk_bytes):
        yield tensor_pb2.TensorChunk(name=name, dtype=wire, shape=shape, offset=offset, data=data.tobytes())


def iter_chunk_messages(name: str, array: np.ndarray, wire: int, chunk_bytes: int) -> Iterator[bytes]:
    """As :func:`iter_chunks`, but each chunk already serialized as a data-plane message
    ``{chunk: ...}`` (see :mod:`optserve.protos.chunk_codec`): the tensor bytes are copied once."""
    shape = array.shape
    for offset, data in _slices(array, wire, chunk_bytes):
        yield chunk_codec.encode_chunk_message(name, wire, shape, offset, data)


def output_dtype(spec_dtype: int) -> np.dtype:
    """NumPy dtype of pulled values: float16 stays float16; float32 and bfloat16 come as float32."""
    return np.dtype(np.float16) if spec_dtype == FLOAT16 else np.dtype(np.float32)


class Reassembler:
    """Writes pulled chunks into arrays of the tensors' shapes.

    Args:
      specs: name -> (spec dtype enum, shape) of the tensors expected.
      out: optional arrays to reuse (name -> C-contiguous array of the right shape and output
        dtype); others are freshly allocated. Reusing avoids page faults on large models.
    """

    def __init__(self, specs: Mapping[str, tuple[int, tuple[int, ...]]], out: Optional[Mapping[str, np.ndarray]] = None):
        out = out or {}
        self.arrays = {}
        for name, (dtype, shape) in specs.items():
            given = out.get(name)
            usable = (given is not None and given.shape == tuple(shape) and given.dtype == output_dtype(dtype)
                      and given.flags.c_contiguous and given.flags.writeable)
            self.arrays[name] = given if usable else np.empty(shape, output_dtype(dtype))
        self._filled = {name: 0 for name in specs}

    def add(self, chunk) -> None:
        """Writes one chunk (a ``TensorChunk`` or a :class:`~optserve.client.chunk_codec.ChunkView`)."""
        out = self.arrays.get(chunk.name)
        if out is None:
            raise InvalidArgumentError(f"server sent unknown tensor {chunk.name!r}")
        data = chunk.data  # read once: on a protobuf message every read is a fresh copy
        item = ITEMSIZE[chunk.dtype]
        start, count = chunk.offset // item, len(data) // item
        flat = out.reshape(-1)
        if start + count > flat.size:
            raise InvalidArgumentError(f"server sent tensor {chunk.name!r} elements beyond its size")
        target = flat[start : start + count]
        if chunk.dtype == BFLOAT16:
            target[:] = bf16_bits_to_f32(np.frombuffer(data, dtype=np.uint16))
        elif (chunk.dtype == FLOAT32 and out.dtype == np.float32) or (chunk.dtype == FLOAT16 and out.dtype == np.float16):
            target.view(np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)
        else:
            target[:] = np.frombuffer(data, dtype=np.float32 if chunk.dtype == FLOAT32 else np.float16)
        self._filled[chunk.name] += count

    def finish(self) -> dict[str, np.ndarray]:
        for name, out in self.arrays.items():
            if self._filled[name] != out.size:
                raise InvalidArgumentError(f"server sent {self._filled[name]} of {out.size} elements of tensor {name!r}")
        return self.arrays
