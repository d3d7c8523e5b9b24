"""A tensor as the chunks that carry it on the wire: the one encoder of chunk messages.

A tensor travels as consecutive ``optserve.v1.TensorChunk`` messages, in order. Two kinds of
tensor are sent:

- an array (float32, bfloat16 from ml_dtypes, or float16) in a wire dtype (:data:`~optserve.protos.contract.FLOAT32`,
  ``BFLOAT16``, ``FLOAT16``; ``None``: the array's own dtype). Each chunk holds at most
  ``chunk_bytes`` of whole elements of the flat little-endian values; ``offset`` is the chunk's
  first *byte* (:func:`~optserve.protos.contract.wire_bytes`, :func:`~optserve.protos.contract.slices`);
- an :class:`Int8Gradient` (blockwise quantized float32 gradient, wire dtype
  :data:`~optserve.protos.contract.INT8`). Each chunk holds whole blocks' int8 values followed
  by their float32 scales; ``offset`` is the chunk's first *element*
  (:func:`~optserve.protos.int8_codec.int8_chunk_parts`);
- a :class:`~optserve.protos.sparse_codec.SparseGradient` (a SparseLoCo selection, wire dtype
  :data:`~optserve.protos.contract.SPARSE`). Each chunk holds whole tile rows or pieces
  (:meth:`~optserve.protos.sparse_codec.SparseGradient.payloads`).

Either kind comes in two forms:

- :func:`chunk_messages`: each chunk already serialized as a data-plane message
  ``{chunk: TensorChunk}`` (valid as any request or response that carries a chunk, see
  :mod:`optserve.protos.chunk_codec`), the tensor bytes copied once: for streams;
- :func:`tensor_chunks`: ``TensorChunk`` messages, to put inside one message (a step sent as one
  ``PushPullStep``).

Decoding is the receiver's: :func:`~optserve.protos.contract.write_wire_values` and
:func:`~optserve.protos.int8_codec.write_int8_values` write one chunk into a slice of an array.
"""

from __future__ import annotations

from typing import Iterator, Optional, Union

import numpy as np

from optserve.protos import chunk_codec, contract, int8_codec
from optserve.protos.optserve.v1 import tensor_pb2
from optserve.protos.sparse_codec import SparseGradient


class Int8Gradient:
    """A float32 gradient quantized for the wire (:func:`~optserve.protos.int8_codec.quantize_int8`).

    ``quantized``: int8, flat, one per element; ``scales``: float32, one per block of
    :data:`~optserve.protos.contract.INT8_BLOCK` elements; ``shape``: the gradient's shape.
    """

    __slots__ = ("quantized", "scales", "shape")

    def __init__(self, quantized: np.ndarray, scales: np.ndarray, shape: tuple[int, ...]):
        self.quantized, self.scales, self.shape = quantized, scales, shape


Tensor = Union[np.ndarray, Int8Gradient, SparseGradient]


def chunk_messages(name: str, tensor: Tensor, wire: Optional[int], chunk_bytes: int) -> Iterator[bytes]:
    """The serialized ``{chunk: ...}`` messages of ``tensor`` (an array in wire dtype ``wire``, or an
    :class:`Int8Gradient` or a :class:`~optserve.protos.sparse_codec.SparseGradient`, whose wire
    dtypes are their own whatever ``wire`` says)."""
    if isinstance(tensor, Int8Gradient):
        return int8_chunk_messages(name, tensor, chunk_bytes)
    if isinstance(tensor, SparseGradient):
        return (chunk_codec.encode_chunk_message(name, contract.SPARSE, tensor.shape, offset, data)
                for offset, data in tensor.payloads(chunk_bytes))
    return float_chunk_messages(name, tensor, _wire_of(tensor, wire), chunk_bytes)


def tensor_chunks(name: str, tensor: Tensor, wire: Optional[int], chunk_bytes: int) -> Iterator[tensor_pb2.TensorChunk]:
    """As :func:`chunk_messages`, as ``TensorChunk`` messages."""
    if isinstance(tensor, Int8Gradient):
        return int8_tensor_chunks(name, tensor, chunk_bytes)
    if isinstance(tensor, SparseGradient):
        return (tensor_pb2.TensorChunk(name=name, dtype=contract.SPARSE, shape=list(tensor.shape), offset=offset,
                                       data=data) for offset, data in tensor.payloads(chunk_bytes))
    return float_tensor_chunks(name, tensor, _wire_of(tensor, wire), chunk_bytes)


def float_chunk_messages(name: str, array: np.ndarray, wire: int, chunk_bytes: int) -> Iterator[bytes]:
    """The serialized ``{chunk: ...}`` messages of ``array`` converted to wire dtype ``wire``."""
    for offset, data in _float_slices(array, wire, chunk_bytes):
        yield chunk_codec.encode_chunk_message(name, wire, array.shape, offset, data)


def float_tensor_chunks(name: str, array: np.ndarray, wire: int, chunk_bytes: int) -> Iterator[tensor_pb2.TensorChunk]:
    """The ``TensorChunk`` messages of ``array`` converted to wire dtype ``wire``."""
    shape = list(array.shape)
    for offset, data in _float_slices(array, wire, chunk_bytes):
        yield tensor_pb2.TensorChunk(name=name, dtype=wire, shape=shape, offset=offset, data=data.tobytes())


def int8_chunk_messages(name: str, grad: Int8Gradient, chunk_bytes: int) -> Iterator[bytes]:
    """The serialized ``{chunk: ...}`` messages of an int8 gradient; each chunk's values and scales
    are copied once, straight into the message."""
    for offset, parts in int8_codec.int8_chunk_parts(grad.quantized, grad.scales, chunk_bytes):
        yield chunk_codec.encode_chunk_message_parts(name, contract.INT8, grad.shape, offset, parts)


def int8_tensor_chunks(name: str, grad: Int8Gradient, chunk_bytes: int) -> Iterator[tensor_pb2.TensorChunk]:
    """The ``TensorChunk`` messages of an int8 gradient."""
    shape = list(grad.shape)
    for offset, data in int8_codec.int8_slices(grad.quantized, grad.scales, chunk_bytes):
        yield tensor_pb2.TensorChunk(name=name, dtype=contract.INT8, shape=shape, offset=offset, data=data)


def _float_slices(array: np.ndarray, wire: int, chunk_bytes: int) -> Iterator[tuple[int, memoryview]]:
    """``(byte offset, bytes)`` of each chunk of ``array`` in wire dtype ``wire``."""
    return contract.slices(contract.wire_bytes(array, wire), contract.ITEMSIZE[wire], chunk_bytes)


def _wire_of(array: np.ndarray, wire: Optional[int]) -> int:
    """``wire``, or the array's own dtype's enum when ``wire`` is None (ValueError if unsupported)."""
    return wire or contract.dtype_enum(array.dtype.name)
