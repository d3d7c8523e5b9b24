"""What a caller hands a :class:`~optserve.client.Session`, checked before anything is sent.

Every refusal is an :class:`~optserve.client.errors.InvalidArgumentError` naming the tensor, the
option or the value, raised in the caller's thread: nothing reached a server.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np

from optserve.client import _wire
from optserve.client.errors import InvalidArgumentError
from optserve.protos import contract
from optserve.protos.optserve.v1 import data_pb2
from optserve.protos.sparse_codec import SparseGradient

Specs = Mapping[str, tuple[int, tuple[int, ...]]]  # tensor name -> (spec dtype enum, shape)


def check_worker_id(worker_id: Any) -> str:
    """A worker id: a string of 1-64 characters without '/' (it prefixes the push identity)."""
    if not isinstance(worker_id, str) or not 1 <= len(worker_id) <= 64 or "/" in worker_id:
        raise InvalidArgumentError(f"worker_id must be a string of 1-64 characters without '/', got {worker_id!r}")
    return worker_id


def checked_gradients(grads: Mapping[str, np.ndarray], specs: Specs, session: str) -> dict[str, np.ndarray]:
    """``grads`` as arrays, checked against session ``session``'s tensors ``specs``: every tensor
    and no other, each in its shape, in a wire-capable dtype (float64, NumPy's default, becomes
    float32: the server's math is float32 anyway)."""
    unknown = sorted(set(grads) - set(specs))
    if unknown:
        raise InvalidArgumentError(f"unknown tensor {unknown[0]!r}: session {session!r} has {sorted(specs)}")
    missing = sorted(set(specs) - set(grads))
    if missing:
        raise InvalidArgumentError(f"missing tensor {missing[0]!r}: a push must include every tensor")
    checked = {}
    for name, value in grads.items():
        if isinstance(value, SparseGradient):  # encoded already (DiLoCo's sparse compression)
            if tuple(value.shape) != specs[name][1]:
                raise InvalidArgumentError(f"tensor {name!r}: sparse shape {list(value.shape)} does not match the "
                                           f"session's {list(specs[name][1])}")
            checked[name] = value
            continue
        array = np.asarray(value)
        if array.dtype == np.float64:
            array = array.astype(np.float32)
        if tuple(array.shape) != specs[name][1]:
            raise InvalidArgumentError(
                f"tensor {name!r}: shape {list(array.shape)} does not match the session's {list(specs[name][1])}")
        _wire.array_dtype_enum(array, name=name)
        checked[name] = array
    return checked


def add_telemetry(header: data_pb2.PushHeader, loss: Optional[float],
                  scalars: Optional[Mapping[str, float]]) -> data_pb2.PushHeader:
    """Writes a push's telemetry into its ``header``: ``loss`` and up to ``contract.MAX_SCALARS``
    named ``scalars`` (names of 1-``contract.MAX_SCALAR_NAME`` characters); each value a number,
    a 0-d array or a framework scalar tensor. Returns ``header``."""
    if loss is not None:
        header.loss = _scalar(loss, "loss")
    for name, value in (scalars or {}).items():
        if not isinstance(name, str) or not 1 <= len(name) <= contract.MAX_SCALAR_NAME:
            raise InvalidArgumentError(f"scalars: a name must be a string of 1-{contract.MAX_SCALAR_NAME} characters, "
                                       f"got {name!r}")
        header.scalars[name] = _scalar(value, f"scalars[{name!r}]")
    if len(header.scalars) > contract.MAX_SCALARS:
        raise InvalidArgumentError(f"scalars: at most {contract.MAX_SCALARS} per push, got {len(header.scalars)}")
    return header


def _scalar(value: Any, what: str) -> float:
    """A telemetry value as a float (a 0-d array or a framework scalar tensor works too)."""
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{what}: must be a number, got {type(value).__name__}") from None
