"""Tensors on the wire, what only the client adds: checked dtype options, error feedback, reassembly.

Chunk sizes, wire dtypes and the conversions are the contract's (:mod:`optserve.protos.contract`);
chunk messages are encoded by :mod:`optserve.protos.tensor_chunks`, the encoder both sides use.
This module adds what only the client does: naming the option or tensor in its errors
(:class:`~optserve.client.errors.InvalidArgumentError`), int8 error feedback, the dtype pulled
values come back in, and reassembling pulled chunks into arrays.
"""

from __future__ import annotations

import threading
from typing import Mapping, Optional

import numpy as np

from optserve.client.errors import InvalidArgumentError
from optserve.protos import contract, int8_codec, sparse_codec
from optserve.protos.tensor_chunks import Int8Gradient  # what ErrorFeedback.quantize returns

DTypeLike = contract.DTypeLike


def dtype_enum(dtype: DTypeLike, *, what: str) -> Optional[int]:
    """``"bf16"`` / ``"float32"`` / ``np.float16`` / enum value -> wire enum; None stays None.

    Raises:
      InvalidArgumentError: naming ``what`` (an option or a tensor).
    """
    try:
        return contract.dtype_enum(dtype)
    except ValueError as exc:
        raise InvalidArgumentError(f"{what}: {exc}") from None


def wire_option_enum(dtype: DTypeLike, *, what: str) -> Optional[int]:
    """A requested wire dtype: as :func:`dtype_enum`, plus ``"int8"`` (quantized gradients)."""
    try:
        return contract.wire_option_enum(dtype)
    except ValueError as exc:
        raise InvalidArgumentError(f"{what}: {exc} (or int8 for gradients)") from None


def wire_option_name(wire: int) -> str:
    return contract.INT8_NAME if wire == contract.INT8 else contract.DTYPE_NAMES[wire]


class ErrorFeedback:
    """Per-tensor residuals of int8 quantization (1-bit Adam / hivemind's 8-bit compression):
    each push quantizes ``gradient + residual`` and keeps what the quantization lost as the next
    residual, so the sum of what the server applies tracks the sum of the true gradients
    (their difference is the current residual, at most half a quantization step per value)."""

    def __init__(self):
        self.residuals: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()

    def quantize(self, grads: Mapping[str, np.ndarray]) -> dict[str, Int8Gradient]:
        """Each gradient plus its tensor's residual (none yet, or of another shape: the gradient
        alone), quantized; the residual becomes what that quantization lost, updated in place
        (:func:`optserve.protos.int8_codec.quantize_int8_feedback`)."""
        out = {}
        with self._lock:
            for name, grad in grads.items():
                grad = np.asarray(grad, np.float32)
                residual = self.residuals.get(name)
                if residual is not None and residual.shape != grad.shape:
                    residual = None
                quantized, scales, self.residuals[name] = int8_codec.quantize_int8_feedback(grad, residual)
                out[name] = Int8Gradient(quantized, scales, tuple(grad.shape))
        return out


def array_dtype_enum(array: np.ndarray, *, name: str) -> int:
    """The wire enum of an array's own dtype (ml_dtypes' bfloat16 is recognised by name)."""
    return dtype_enum(array.dtype.name, what=f"tensor {name!r}")


def output_dtype(spec_dtype: int) -> np.dtype:
    """NumPy dtype of pulled values: float16 stays float16; float32 and bfloat16 come as float32."""
    return np.dtype(np.float16) if spec_dtype == contract.FLOAT16 else np.dtype(np.float32)


class Reassembler:
    """Writes pulled chunks into arrays of the tensors' shapes.

    Args:
      specs: name -> (spec dtype enum, shape) of the tensors expected.
      out: optional arrays to reuse (name -> C-contiguous array of the right shape and output
        dtype); others are freshly allocated. Reusing avoids page faults on large models.
      sparse_base: the parameters the request's ``sparse_update`` named (its base version's): a
        tensor sent as its step's sparse parts (DTYPE_SPARSE chunks) is rebuilt from them
        (:func:`optserve.protos.sparse_codec.apply_parts`; ``over_senders``: the session's
        ``sparse_mean`` is "senders").
    """

    def __init__(self, specs: Mapping[str, tuple[int, tuple[int, ...]]], out: Optional[Mapping[str, np.ndarray]] = None,
                 sparse_base: Optional[Mapping[str, np.ndarray]] = None, over_senders: bool = False):
        out = out or {}
        self._sparse_base = sparse_base or {}
        self._over_senders = over_senders
        self._sparse: dict[str, list[tuple[int, bytes]]] = {}  # tensor -> its parts' chunks, in order
        self.received_bytes = 0
        self.arrays = {}
        for name, (dtype, shape) in specs.items():
            given = out.get(name)
            usable = (given is not None and given.shape == tuple(shape) and given.dtype == output_dtype(dtype)
                      and given.flags.c_contiguous and given.flags.writeable)
            self.arrays[name] = given if usable else np.empty(shape, output_dtype(dtype))
        self._filled = {name: 0 for name in specs}

    def add(self, chunk) -> None:
        """Writes one chunk (a ``TensorChunk`` or a :class:`~optserve.protos.chunk_codec.ChunkView`)."""
        out = self.arrays.get(chunk.name)
        if out is None:
            raise InvalidArgumentError(f"server sent unknown tensor {chunk.name!r}")
        if chunk.dtype == contract.SPARSE:
            if chunk.name not in self._sparse_base:
                raise InvalidArgumentError(f"server sent tensor {chunk.name!r} as sparse parts, which this call did "
                                           f"not ask for")
            data = bytes(chunk.data)
            self._sparse.setdefault(chunk.name, []).append((chunk.offset, data))
            self.received_bytes += len(data)
            return
        item = contract.ITEMSIZE.get(chunk.dtype)
        if item is None:
            raise InvalidArgumentError(f"server sent tensor {chunk.name!r} in unsupported dtype {chunk.dtype}")
        data = chunk.data  # read once: on a protobuf message every read is a fresh copy
        if chunk.offset % item or len(data) % item:
            raise InvalidArgumentError(f"server sent tensor {chunk.name!r} chunk not aligned to its {item}-byte elements")
        start, count = chunk.offset // item, len(data) // item
        flat = out.reshape(-1)
        if start < 0 or start + count > flat.size:
            raise InvalidArgumentError(f"server sent tensor {chunk.name!r} elements beyond its size")
        contract.write_wire_values(flat[start : start + count], data, chunk.dtype)
        self._filled[chunk.name] += count
        self.received_bytes += len(data)

    def finish(self) -> dict[str, np.ndarray]:
        for name in self._sparse:
            if self._filled[name]:
                raise InvalidArgumentError(f"server sent tensor {name!r} both as values and as sparse parts")
            if self.arrays[name].dtype != np.float32:
                raise InvalidArgumentError(f"server sent tensor {name!r} ({self.arrays[name].dtype}) as sparse parts: "
                                           f"float32 only")

        def rebuild(name: str) -> Optional[str]:
            """Writes tensor ``name`` rebuilt from its parts; a part that does not decode: why."""
            try:
                self.arrays[name][...] = sparse_codec.apply_parts(
                    self._sparse_base[name], sparse_codec.split_parts(self._sparse[name]), self._over_senders)
            except ValueError as exc:
                return f"server sent tensor {name!r} as sparse parts that do not decode: {exc}"
            return None

        names = list(self._sparse)
        failures = sparse_codec.tensor_map(rebuild, names, [self.arrays[n].size for n in names])
        for name, failure in zip(names, failures):
            if failure is not None:
                raise InvalidArgumentError(failure)
            self._filled[name] = self.arrays[name].size
        for name, out in self.arrays.items():
            if self._filled[name] != out.size:
                raise InvalidArgumentError(f"server sent {self._filled[name]} of {out.size} elements of tensor {name!r}")
        return self.arrays
