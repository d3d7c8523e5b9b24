"""Receiving tensors from chunks: validation and decoding into preallocated buffers.

A :class:`TensorAssembler` checks every chunk against the shard's specs (known name, same shape,
supported dtype, aligned, in range, no overlap), decodes it into the destination buffer (casting
from the wire dtype) and, at :meth:`finish`, checks that every tensor is covered exactly once.
Errors are :class:`InvalidArgument` naming the tensor; nothing outside the buffers is touched, so
a refused or broken stream leaves the session's state unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import numpy as np

from optserve.protos import contract, int8_codec, sparse_codec
from optserve.server.domain.config import DType, TensorSpec
from optserve.server.domain.errors import InvalidArgument, NonFinite
from optserve.server.domain.shard.host_passes import parallel_all_finite


def wire_dtype(value: int, *, what: str) -> DType:
    """The DType for a wire enum value; raises InvalidArgument naming ``what``."""
    try:
        return DType(value)
    except ValueError:
        raise InvalidArgument(f"{what}: unsupported dtype {value} (supported: FLOAT32, BFLOAT16, FLOAT16)") from None


class TensorAssembler:
    """Assembles one push (or one initialization) of a shard's tensors.

    Args:
      specs: the shard's tensors, by name.
      buffers: destination arrays by name, shape ``spec.shape``; dtype float32 for gradients or
        the spec's dtype for initial values.
      check_finite: reject NaN/Inf values (naming the tensor).
      in_place: a float32 chunk covering a whole tensor whose bytes are aligned to
        :data:`IN_PLACE_ALIGNMENT` (a shared-memory region's) and whose buffer is float32 is
        used where it lies instead of being copied into its buffer: the caller guarantees the bytes stay unchanged until the
        push is applied or dropped.
      upload: an accelerator shard's ``upload(arrays, check_finite) -> (on_device, not_finite)``
        (:func:`~optserve.server.compute.device_upload.upload_checked` for its device): the
        tensors read in place go to the device at :meth:`finish` and are checked finite there
        instead of on the host; the result carries them (``AssembledGrads.on_device``).
    """

    def __init__(self, specs: Mapping[str, TensorSpec], buffers: Mapping[str, np.ndarray], *, check_finite: bool,
                 in_place: bool = False, upload: Optional[Callable] = None):
        self._specs = specs
        self._buffers = buffers
        self._in_place = in_place
        self._upload = upload
        self._adopted: dict[str, np.ndarray] = {}  # in_place: tensors read where they lie
        self._flat = {name: buf.reshape(-1) for name, buf in buffers.items()}
        self._check_finite = check_finite
        self._ranges: dict[str, list[tuple[int, int]]] = {name: [] for name in specs}
        self.received_bytes = 0  # tensor bytes accepted so far
        self._support: dict[str, list[np.ndarray]] = {}  # sparse tensors: the positions their chunks named
        self._sparse_chunks: dict[str, list[tuple[int, bytes]]] = {}  # and the chunks, as received

    def add(self, chunk) -> None:
        """Validates and decodes one ``optserve.v1.TensorChunk``."""
        spec = self._specs.get(chunk.name)
        if spec is None:
            raise InvalidArgument(f"unknown tensor {chunk.name!r}: this shard holds {sorted(self._specs)}")
        if tuple(chunk.shape) != spec.shape:
            raise InvalidArgument(
                f"tensor {spec.name!r}: shape {list(chunk.shape)} does not match the session's {list(spec.shape)}"
            )
        data = chunk.data
        sparse = chunk.dtype == contract.SPARSE
        ranges = self._ranges[spec.name]
        if ranges and (spec.name in self._sparse_chunks) != sparse:  # a selection is the whole tensor's or none
            raise InvalidArgument(f"tensor {spec.name!r}: sparse chunks and chunks of values mixed in one push "
                                  f"(a SparseLoCo selection covers its tensor alone)")
        if sparse:  # a SparseLoCo selection (protos/sparse_codec.py): decoded here
            self._add_sparse(spec, chunk)
            return
        if chunk.dtype == contract.INT8:  # quantized gradients (protos/int8_codec.py: values, then block scales)
            dtype, start, count = None, chunk.offset, int8_codec.int8_count(len(data))
            if count is None or start % contract.INT8_BLOCK or self._flat[spec.name].dtype != np.float32:
                raise InvalidArgument(
                    f"tensor {spec.name!r}: int8 chunk at element {start} with {len(data)} bytes is not whole "
                    f"blocks of {contract.INT8_BLOCK} values and their scales (int8 is for gradients only)")
        else:
            dtype = wire_dtype(chunk.dtype, what=f"tensor {spec.name!r}")
            item = dtype.itemsize
            if chunk.offset % item or len(data) % item:
                raise InvalidArgument(
                    f"tensor {spec.name!r}: chunk at byte offset {chunk.offset} with {len(data)} bytes "
                    f"is not aligned to the {dtype.name} element size {item}"
                )
            start, count = chunk.offset // item, len(data) // item
        if start < 0 or start + count > spec.size:
            raise InvalidArgument(
                f"tensor {spec.name!r}: chunk elements [{start}, {start + count}) out of range [0, {spec.size})"
            )
        ranges = self._ranges[spec.name]
        if ranges and start < ranges[-1][1] and start + count > ranges[-1][0]:
            raise InvalidArgument(f"tensor {spec.name!r}: chunk elements [{start}, {start + count}) overlap another chunk")
        ranges.append((start, start + count))
        self.received_bytes += len(data)
        if count == 0:
            return
        if (self._in_place and dtype is DType.FLOAT32 and count == spec.size and _aligned(data)
                and self._flat[spec.name].dtype == np.float32):  # initial values of another dtype are cast
            destination = np.frombuffer(data, np.float32)
            self._adopted[spec.name] = destination.reshape(spec.shape)
            if self._upload is None:  # else checked on the device at finish()
                self._check(spec, destination, start, count)
            return
        destination = self._flat[spec.name][start : start + count]
        if dtype is None:
            int8_codec.write_int8_values(destination, data)
        else:
            contract.write_wire_values(destination, data, dtype.value)
        # Checked after the copy, on the destination: the pass then reads cached memory (~2x
        # cheaper than checking the message first). Casts keep NaN and Inf; a refused push
        # only wrote into its own buffers, which return to the pool.
        self._check(spec, destination, start, count)

    def _add_sparse(self, spec: TensorSpec, chunk) -> None:
        """Decodes a SparseLoCo chunk into the tensor's buffer (zeros where no entry is named)."""
        flat = self._flat[spec.name]
        if flat.dtype != np.float32:
            raise InvalidArgument(f"tensor {spec.name!r}: a sparse chunk is for gradients only")
        start = chunk.offset
        ranges = self._ranges[spec.name]
        self._sparse_chunks.setdefault(spec.name, [])
        try:  # writes only this push's own buffer, which a refused push returns to its pool
            if start < 0:
                raise ValueError(f"its first element {start} is out of range")
            count = sparse_codec.decode_into(flat, spec.shape, start, chunk.data,
                                             self._support.setdefault(spec.name, []))
        except ValueError as exc:
            raise InvalidArgument(f"tensor {spec.name!r}: {exc}") from None
        if ranges and start < ranges[-1][1] and start + count > ranges[-1][0]:
            raise InvalidArgument(f"tensor {spec.name!r}: chunk elements [{start}, {start + count}) overlap another chunk")
        ranges.append((start, start + count))
        self._sparse_chunks[spec.name].append((start, bytes(chunk.data)))
        self.received_bytes += len(chunk.data)
        self._check(spec, flat[start:start + count], start, count)

    def _check(self, spec: TensorSpec, values: np.ndarray, start: int, count: int) -> None:
        if self._check_finite and not all_finite(values):
            raise NonFinite(
                f"tensor {spec.name!r}: NaN or Inf in elements [{start}, {start + count}); "
                f"the session does not allow non-finite gradients (allow_nonfinite)"
            )

    def finish(self) -> dict[str, np.ndarray]:
        """Checks that every tensor was covered exactly once; returns the buffers by name."""
        for name, spec in self._specs.items():
            ranges = sorted(self._ranges[name])
            if not ranges and spec.size:
                raise InvalidArgument(f"missing tensor {name!r}: no chunks received")
            for (_, e0), (s1, _) in zip(ranges, ranges[1:]):
                if s1 < e0:
                    raise InvalidArgument(f"tensor {name!r}: chunks overlap at element {s1}")
            covered = sum(e - s for s, e in ranges)
            if covered != spec.size:
                raise InvalidArgument(f"tensor {name!r}: chunks cover {covered} of {spec.size} elements")
        support = {name: np.concatenate(parts) for name, parts in self._support.items()}
        sparse = {name: sorted(chunks) for name, chunks in self._sparse_chunks.items()}
        on_device = {}
        if self._upload is not None and self._adopted:
            on_device, not_finite = self._upload(self._adopted, self._check_finite)
            if not_finite:
                name = not_finite[0]
                raise NonFinite(f"tensor {name!r}: NaN or Inf in elements [0, {self._specs[name].size}); "
                                f"the session does not allow non-finite gradients (allow_nonfinite)")
        return AssembledGrads({**self._buffers, **self._adopted}, pooled=self._buffers, support=support,
                              sparse_chunks=sparse, on_device=on_device)


def all_finite(values: np.ndarray) -> bool:
    """Whether every value is finite, in one read-only pass (split across a few threads when
    large, :func:`~optserve.server.domain.shard.host_passes.parallel_all_finite`)."""
    return parallel_all_finite(values, _all_finite_piece)


def _all_finite_piece(values: np.ndarray) -> bool:
    """A sum is finite only if every term is (an inf or NaN term makes it inf or NaN), so only a
    sum that is not (NaN or inf among the values, or finite values overflowing it) needs the
    exact per-value check."""
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(np.add.reduce(values.reshape(-1))):
            return True
    return bool(np.isfinite(values).all())


IN_PLACE_ALIGNMENT = 64  # what XLA:CPU needs to read an input where it lies


def _aligned(data) -> bool:
    return isinstance(data, memoryview) and np.frombuffer(data, np.uint8).ctypes.data % IN_PLACE_ALIGNMENT == 0


class AssembledGrads(dict):
    """A push's gradients by name; ``pooled``: the buffers it was assembled into (what goes back
    to their pool: the tensors read in place are not among them); ``support``: the tensors sent
    as SparseLoCo selections, each with the flat positions it named (others zero);
    ``sparse_chunks``: their chunks as received, ``(offset, data)`` in ascending offsets; and
    ``on_device``: copies of some of them already on the shard's accelerator (equal to the host
    values, which stay readable)."""

    def __init__(self, grads: Mapping[str, np.ndarray], pooled: Mapping[str, np.ndarray],
                 support: Optional[Mapping[str, np.ndarray]] = None,
                 sparse_chunks: Optional[Mapping[str, list]] = None, on_device: Optional[Mapping[str, Any]] = None):
        super().__init__(grads)
        self.pooled = pooled
        self.support = dict(support or {})
        self.sparse_chunks = dict(sparse_chunks or {})
        self.on_device = dict(on_device or {})
