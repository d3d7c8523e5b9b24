"""ShardData replies: a push's answer and the shard's parameters going back as chunks.

Parameters are sliced into chunks of at most the client's ``max_chunk_bytes``, in the wire dtype
it asked for (each tensor's own by default; :mod:`optserve.protos.contract` converts), and
written once by the chunk codec (:mod:`optserve.protos.chunk_codec`) or, for a step small enough
for one message, as ``TensorChunk`` messages.
"""

from __future__ import annotations

import json
import time
from typing import Iterator, Mapping, Optional

import numpy as np

from optserve.protos import chunk_codec, contract
from optserve.protos.optserve.v1 import data_pb2, tensor_pb2
from optserve.server.domain.config import DType
from optserve.server.domain.shard import Receipt, ShardSession
from optserve.server.wire.shared_memory import reply_into


def push_response(receipt: Receipt) -> data_pb2.PushResponse:
    """A push's answer (``Push``, and ``staged`` of a two-phase step)."""
    return data_pb2.PushResponse(already_applied=receipt.already_applied, version=receipt.version,
                                 committed=receipt.committed, staleness=receipt.staleness)


def param_slices(session: ShardSession, params, dtype: Optional[DType], chunk_bytes: int,
                 relayed: Optional[Mapping[str, list]] = None) -> Iterator[tuple]:
    """(name, wire dtype value, shape, byte offset, bytes view) of the shard's parameters, in order;
    a tensor in ``relayed`` goes as its step's sparse parts instead (see ``PullRequest.sparse_update``)."""
    for name, spec in session.specs.items():
        if relayed and name in relayed:
            for part in relayed[name]:
                for offset, data in part:
                    yield name, contract.SPARSE, spec.shape, offset, data
            continue
        wire = dtype or spec.dtype
        array = params[name]
        for offset, data in contract.slices(contract.wire_bytes(array, wire.value), wire.itemsize, chunk_bytes):
            yield name, wire.value, array.shape, offset, data


def tensor_chunk(name, dtype, shape, offset, data) -> tensor_pb2.TensorChunk:
    """One slice of :func:`param_slices` as a ``TensorChunk`` message (its bytes copied once)."""
    return tensor_pb2.TensorChunk(name=name, dtype=dtype, shape=list(shape), offset=offset, data=bytes(data))


def pull_chunks(session: ShardSession, dtype: Optional[DType], chunk_bytes: int, started: float,
                evaluation: bool = False):
    """A ``Pull``'s reply: the version, then the parameters as chunk messages (the bytes sent are
    reported to the session's observer, timed from ``started``, ``time.perf_counter()`` seconds);
    ``evaluation``: the parameters to evaluate with (see ``ShardSession.snapshot``)."""
    version, params = session.snapshot(evaluation)
    yield data_pb2.PullResponse(version=version)
    sent = 0
    for piece in param_slices(session, params, dtype, chunk_bytes):
        sent += len(piece[-1])
        yield chunk_codec.encode_chunk_message(*piece)
    session.observer.sent(time.perf_counter() - started, sent)


def pull_into_region(session: ShardSession, region, started: float, evaluation: bool = False):
    """A same-host ``Pull``'s reply: the parameters written once into the client's shared-memory
    ``region``, then one message with their version."""
    version, sent = reply_into(session, region, evaluation)
    session.observer.sent(time.perf_counter() - started, sent)
    yield data_pb2.PullResponse(version=version)


def state_replies(saved, chunk_bytes: int) -> Iterator[data_pb2.ExportStateResponse]:
    """An ``ExportState``'s reply: the header, then every leaf of ``saved`` (a
    :class:`~optserve.server.domain.shard.saved_state.SavedState`) in pieces of at most ``chunk_bytes``."""
    yield data_pb2.ExportStateResponse(header=data_pb2.ExportStateHeader(
        version=saved.version, hyperparams_json=json.dumps(saved.hyper, sort_keys=True),
        incarnation=saved.incarnation))
    for key, array in saved.leaves.items():
        array = array if array.flags.c_contiguous else array.copy()  # (ascontiguousarray makes 0-d 1-d)
        flat = array.reshape(-1).view(np.uint8)
        dtype = "bfloat16" if array.dtype.name == "bfloat16" else array.dtype.str
        for offset in range(0, max(flat.size, 1), chunk_bytes):
            yield data_pb2.ExportStateResponse(state=data_pb2.StateChunk(
                key=key, dtype=dtype, shape=list(array.shape), offset=offset,
                data=flat[offset:offset + chunk_bytes].tobytes()))
