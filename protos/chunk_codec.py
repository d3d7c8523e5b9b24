"""Chunk-carrying data-plane messages, encoded and decoded without copying tensor bytes twice.

The generated protobuf classes copy a chunk's ``data`` on every step (into the message, into a
wrapping message, into the serialized string, and once more on each ``.data`` read); at
hundreds of MB per step those copies cost more than the transfer itself. The messages here are
the same protobuf wire format (``optserve.v1.TensorChunk`` inside field ``CHUNK_FIELD`` of
``PushRequest`` / ``PushPullRequest`` / ``PullResponse`` / ``PushPullResponse`` /
``InitTensorsRequest``), written and read by hand for the chunk case only: the encoder copies the
tensor bytes once (into the message string gRPC sends), the decoder not at all (a memoryview into
the received string). Every other message goes through the generated classes.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from optserve.protos.optserve.v1 import tensor_pb2

CHUNK_FIELD = 2  # the `chunk` field number in every data-plane message that carries one
_LEN, _VARINT, _I64, _I32 = 2, 0, 1, 5
_DATA_TAG = bytes([5 << 3 | _LEN])  # TensorChunk.data
_OUTER_TAG = bytes([CHUNK_FIELD << 3 | _LEN])


@dataclasses.dataclass(frozen=True)
class ChunkView:
    """A decoded ``TensorChunk`` whose ``data`` is a memoryview into the received message."""

    name: str
    dtype: int
    shape: tuple[int, ...]
    offset: int
    data: memoryview


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1  # int64 two's complement, as protobuf writes negative numbers
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_chunk_message(name: str, dtype: int, shape: Sequence[int], offset: int, data: memoryview) -> bytes:
    """The serialized data-plane message ``{chunk: TensorChunk(name, dtype, shape, offset, data)}``.

    ``data`` (any bytes-like object) is copied once, into the returned string.
    """
    return encode_chunk_message_parts(name, dtype, shape, offset, (data,))


def encode_chunk_message_parts(name: str, dtype: int, shape: Sequence[int], offset: int,
                               parts: Sequence[memoryview]) -> bytes:
    """As :func:`encode_chunk_message`, with ``data`` given as consecutive pieces (byte
    memoryviews or other bytes-like objects of one-byte items), each copied once, straight into
    the returned string: an int8 chunk's values and its scales need no joined copy first."""
    head = tensor_pb2.TensorChunk(name=name, dtype=dtype, shape=list(shape), offset=offset).SerializeToString()
    size = sum(len(part) for part in parts)
    data_field = _DATA_TAG + _varint(size)
    body_len = len(head) + len(data_field) + size
    return b"".join((_OUTER_TAG, _varint(body_len), head, data_field, *parts))


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buf: memoryview, pos: int, end: int):
    """Yields (field number, wire type, value): an int, or a memoryview for length-delimited."""
    while pos < end:
        key, pos = _read_varint(buf, pos)
        number, kind = key >> 3, key & 7
        if kind == _VARINT:
            value, pos = _read_varint(buf, pos)
        elif kind == _LEN:
            size, pos = _read_varint(buf, pos)
            value, pos = buf[pos : pos + size], pos + size
        elif kind in (_I64, _I32):
            size = 8 if kind == _I64 else 4
            value, pos = int.from_bytes(buf[pos : pos + size], "little"), pos + size
        else:
            raise ValueError(f"unsupported protobuf wire type {kind}")
        if pos > end:
            raise ValueError("truncated protobuf message")
        yield number, kind, value


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def decode_chunk(body: memoryview) -> ChunkView:
    """Decodes a serialized ``TensorChunk`` (``data`` stays a view into ``body``)."""
    name, dtype, shape, offset, data = "", 0, [], 0, body[0:0]
    for number, kind, value in _fields(body, 0, len(body)):
        if number == 1 and kind == _LEN:
            name = bytes(value).decode("utf-8")
        elif number == 2 and kind == _VARINT:
            dtype = value
        elif number == 3 and kind == _LEN:  # packed (what protobuf writes)
            pos = 0
            while pos < len(value):
                dim, pos = _read_varint(value, pos)
                shape.append(_signed(dim))
        elif number == 3 and kind == _VARINT:  # unpacked (also valid on the wire)
            shape.append(_signed(value))
        elif number == 4 and kind == _VARINT:
            offset = _signed(value)
        elif number == 5 and kind == _LEN:
            data = value
    return ChunkView(name, dtype, tuple(shape), offset, data)


def split_chunk(serialized: bytes):
    """The :class:`ChunkView` if ``serialized`` is a data-plane message holding a chunk, else None."""
    buf = memoryview(serialized)
    chunk = None
    for number, kind, value in _fields(buf, 0, len(buf)):
        if number == CHUNK_FIELD and kind == _LEN:
            chunk = value
        else:  # another oneof member after the chunk: the last one wins
            chunk = None
    return None if chunk is None else decode_chunk(chunk)


def chunk_or_message(message_type) -> Callable[[bytes], tuple[str, object]]:
    """A gRPC deserializer for ``message_type`` (a message with ``oneof item``).

    Returns ``(kind, value)``: ``("chunk", ChunkView)`` for a chunk (no copy of its bytes),
    otherwise the set field's name and value from the generated class.
    """

    def deserialize(serialized: bytes) -> tuple[str, object]:
        chunk = split_chunk(serialized)
        if chunk is not None:
            return "chunk", chunk
        message = message_type.FromString(serialized)
        kind = message.WhichOneof("item")
        return kind, getattr(message, kind) if kind else None

    return deserialize


def serialize(message) -> bytes:
    """gRPC serializer: pre-encoded messages (bytes) pass through, generated messages serialize."""
    return message if isinstance(message, bytes) else message.SerializeToString()
