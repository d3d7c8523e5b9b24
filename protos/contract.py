"""The wire contract, defined once: what the client and the server must agree on beyond the .proto files.

- chunk sizes: :data:`DEFAULT_CHUNK_BYTES` and the one range :func:`clamp_chunk_bytes` applies, to
  what a client sends and asks for and to what a shard answers a pull with;
- wire dtypes (:data:`FLOAT32`, :data:`BFLOAT16`, :data:`FLOAT16`, :data:`ITEMSIZE`,
  :func:`dtype_enum`) and bfloat16 narrowing / widening on bit patterns (no ml_dtypes needed);
- the encode direction: :func:`wire_bytes` (an array's flat bytes in a wire dtype) and
  :func:`slices` (those bytes cut into chunks);
- the decode direction: :func:`write_wire_values` (one chunk's bytes into a slice of a target array);
- int8 gradients: the wire enum :data:`INT8`, its option name and block size (the quantization
  codec and its chunk payload are :mod:`optserve.protos.int8_codec`);
- trailing metadata keys, reject reason names, and the gRPC channel / server options.

The byte-level message codec (chunk messages written and read without copying tensor bytes twice)
is :mod:`optserve.protos.chunk_codec`. NumPy and the generated protobuf modules only: bfloat16
arrays (ml_dtypes) are recognised by their dtype name and handled as uint16 bit patterns. Bytes
on the wire are little-endian; NumPy's native order on every supported host.
"""

from __future__ import annotations

import ipaddress
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
# The ceiling keeps a chunk message far below MAX_MESSAGE_BYTES, below the glibc mmap threshold
# under which the client's and the shards' malloc settings keep freed chunks (32 MiB), and a few
# chunks inside LOOKAHEAD_BYTES.
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


# --- int8 gradients: the wire dtype and its block (the codec: optserve.protos.int8_codec) --------

INT8 = tensor_pb2.DTYPE_INT8
INT8_BLOCK = 4096  # elements per quantization block (one float32 scale each: 0.1% overhead); chunks hold whole blocks
INT8_NAME = "int8"


# --- SparseLoCo gradients: the wire dtype (the codec: optserve.protos.sparse_codec) ---------------

SPARSE = tensor_pb2.DTYPE_SPARSE
GRADIENT_ONLY = (INT8, SPARSE)  # wire dtypes that encode gradients, never pulled values


def wire_option_enum(dtype: DTypeLike) -> Optional[int]:
    """A requested *wire* dtype: :func:`dtype_enum`'s, or ``"int8"`` / :data:`INT8` (gradients only)."""
    if isinstance(dtype, str) and dtype.lower() == INT8_NAME:
        return INT8
    if isinstance(dtype, (int, np.integer)) and not isinstance(dtype, bool) and int(dtype) in (INT8, SPARSE):
        return int(dtype)  # SPARSE: gradients already encoded (sparse_codec.SparseGradient values)
    return dtype_enum(dtype)


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

# Trailing metadata of a refused push: the session's version when it was refused as stale
# (ABORTED) or for a base version past it (INVALID_ARGUMENT) ...
CURRENT_VERSION_KEY = "optserve-current-version"
# ... or "1" when another shard refused its part of the push (applied nowhere).
PEER_REFUSED_KEY = "optserve-peer-refused"
# "1" on every error status a server sends itself (its answer to the call): a status without it
# came from the transport (a dropped connection), so a step sent on a reused call never started.
ANSWERED_KEY = "optserve-answered"
# ... or "1" beside the current version when an elastic session dropped a late gradient.
LATE_KEY = "optserve-late"
# "1" on a push refused because the session was replaced (closed and created again under its name)
# after the pushing client attached (FAILED_PRECONDITION).
REPLACED_KEY = "optserve-session-replaced"

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
# The SDK's channels also reconnect as to a service that restarts (a server or a shard killed and
# started again): gRPC's default backoff between dials grows 1.6x per failed dial up to 120 s, and
# a channel waiting out its backoff fails every call at once, so after half a minute down the next
# dial could come 10-20 s after the server listens again. Dials come at most
# MAX_RECONNECT_BACKOFF_MS apart instead (one a second per channel while a server is down). One dial
# may take CONNECT_TIMEOUT_MS (gRPC's "min reconnect backoff" is the time a connection attempt is
# given, a TLS handshake with a busy server included; its default is 20 s).
INITIAL_RECONNECT_BACKOFF_MS = 250
MAX_RECONNECT_BACKOFF_MS = 1000
CONNECT_TIMEOUT_MS = 5000
# The SDK's channels to other machines also have keepalive (client/_transport.py; loopback needs
# none: a local peer's connections are reset when it dies): while one has calls open it pings every
# KEEPALIVE_TIME_MS, and a connection whose ping is not answered within KEEPALIVE_TIMEOUT_MS is
# closed, its calls ending UNAVAILABLE (retried on a new connection, the shard map read again).
# Without it a call to a host that vanished (power, link: no reset ever comes) waits out its whole
# deadline, and the next call rides the same dead connection. Servers accept pings that often
# (SERVER_OPTIONS; gRPC's default answers a ping more often than every 5 minutes with GOAWAY).
KEEPALIVE_TIME_MS = 2000
KEEPALIVE_TIMEOUT_MS = 3000
KEEPALIVE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.max_pings_without_data", 0),  # a call waiting on a vote sends no data: ping anyway
)


def keepalive_options(address: str) -> tuple[tuple[str, int], ...]:
    """:data:`KEEPALIVE_OPTIONS` for a channel to ``address`` ("host:port", "[v6]:port", or a
    target such as "unix:..."), none when it stays on this machine (loopback, a unix socket)."""
    if address.startswith(("unix:", "unix-abstract:")):
        return ()
    host = address.rsplit(":", 1)[0].strip("[]") if ":" in address else address
    if host == "localhost":
        return ()
    try:
        return () if ipaddress.ip_address(host).is_loopback else KEEPALIVE_OPTIONS
    except ValueError:  # a name: another machine
        return KEEPALIVE_OPTIONS


RECONNECT_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", INITIAL_RECONNECT_BACKOFF_MS),
    ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
)
# Servers also refuse to share their port with another process, and accept keepalive pings while
# calls are open (up to one per KEEPALIVE_TIME_MS / 2; a client pings only then).
SERVER_OPTIONS: tuple[tuple[str, int], ...] = CHANNEL_OPTIONS + (
    ("grpc.so_reuseport", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
)
