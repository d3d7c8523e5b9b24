"""A session's whole state as the client holds it: read from the shards, sent to a new session.

A saved state (:meth:`Session.state`) is one version of every shard: the parameters, the
optimizer state kept for each tensor and the state the tensors share (a step count), and the
hyperparameters in force. Its leaves are named by tensor, not by shard (see the server's
``server/compute/state_leaves.py``), so it loads on a server with any number of shards::

    {"format": "optserve.state/1", "session": name, "version": v, "incarnation": "...",
     "optimizer": {"name": ..., "args": {...}}, "mode": "sync" | "async",
     "options": {"num_workers": ..., "max_staleness": ..., ...},   # the session's other options
     "hyperparams": {group: {option: value}},
     "params": {tensor: array},
     "tensors": {tensor: {path: array}},      # e.g. "0.mu", "0.nu" for optax.adam
     "shared": {path: array}}                 # e.g. "0.count"

Every shard answers ``ExportState`` with its part at its current version; a session whose
shards answered at different versions (a step landed between two answers) is read again, and
:class:`~optserve.client.errors.AbortedError` names the versions if it never holds still.
"""

from __future__ import annotations

import json
import time
from typing import Any, Iterator, Mapping

import numpy as np

from optserve.client._fanout import call_shard
from optserve.client.errors import AbortedError, InvalidArgumentError
from optserve.protos.optserve.v1 import data_pb2

FORMAT = "optserve.state/1"
# The session's options a saved state keeps beside its optimizer (a session created from it gets them)
SESSION_OPTIONS = ("mode", "num_workers", "max_staleness", "staleness_policy", "allow_nonfinite", "min_workers",
                   "max_workers", "lease_s", "straggler_s", "late", "sparse_mean")
_PARAM, _TENSOR, _SHARED = "param/", "tensor/", "shared/"
_READ_TRIES = 20
_PIECE_BYTES = 1 << 20


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _dtype_name(array: np.ndarray) -> str:
    return "bfloat16" if array.dtype.name == "bfloat16" else array.dtype.str


def _read_shard(responses) -> tuple[tuple[int, str], dict, dict[str, np.ndarray]]:
    """``((version, incarnation), hyperparams, {key: array})`` of one shard's ``ExportState``
    answer; each leaf is written into its own array as its pieces arrive (no copy of the whole answer)."""
    version, hyper, leaves, filled = None, {}, {}, {}
    for response in responses:
        if response.WhichOneof("item") == "header":
            version = (response.header.version, response.header.incarnation)
            hyper = json.loads(response.header.hyperparams_json or "{}")
            continue
        piece = response.state
        if piece.key not in leaves:
            leaves[piece.key], filled[piece.key] = np.empty(tuple(piece.shape), _dtype(piece.dtype)), 0
        target = leaves[piece.key].reshape(-1).view(np.uint8)
        target[piece.offset:piece.offset + len(piece.data)] = np.frombuffer(piece.data, np.uint8)
        filled[piece.key] += len(piece.data)
    short = [key for key, array in leaves.items() if filled[key] != array.nbytes]
    if version is None or short:
        raise AbortedError(f"a shard's state arrived incomplete (leaves {short[:3]}); read it again", "ABORTED")
    return version, hyper, leaves


def read_state(session) -> dict[str, Any]:
    """The session's state at one version of every shard (see the module's docstring).

    Raises:
      AbortedError: the shards kept answering at different versions (steps kept landing).
      FailedPreconditionError: the optimizer's state cannot be named by tensor.
    """
    timeout = session._client.timeout
    request = data_pb2.ExportStateRequest(session=session.name, max_chunk_bytes=_PIECE_BYTES)
    seen = []
    for attempt in range(_READ_TRIES):
        parts = session._fanout.served(lambda: session._fanout.each(lambda shard: call_shard(
            lambda s: _read_shard(session._client.shard_data(s.address).ExportState(request, timeout=timeout)),
            shard)))
        versions = sorted({version for version, _, _ in parts})
        if len(versions) == 1:  # one version of one incarnation
            return _merged(session, *versions[0], parts)
        seen.append(versions)
        time.sleep(min(0.01 * 2 ** attempt, 0.5))
    raise AbortedError(f"session {session.name!r}: its shards kept answering at different versions "
                       f"({seen[-3:]}): steps kept landing while the state was read; read it between steps",
                       "ABORTED")


def _merged(session, version: int, incarnation: str, parts) -> dict[str, Any]:
    params, tensors, shared, hyper = {}, {}, {}, {}
    for _, shard_hyper, leaves in reversed(parts):  # the home shard's (first) values win
        for group, values in shard_hyper.items():
            hyper.setdefault(group, {}).update(values)
        for key, array in leaves.items():
            if key.startswith(_PARAM):
                params[key[len(_PARAM):]] = array
            elif key.startswith(_TENSOR):
                tensor, _, path = key[len(_TENSOR):].rpartition("/")  # a tensor's name may hold "/", a path not
                tensors.setdefault(tensor, {})[path] = array
            elif key.startswith(_SHARED):
                path = key[len(_SHARED):]
                if path in shared and (shared[path].shape != array.shape or not np.array_equal(shared[path], array)):
                    raise AbortedError(f"session {session.name!r}: shared state {path!r} differs between its shards "
                                       f"at version {version}", "ABORTED")
                shared[path] = array
    return {"format": FORMAT, "session": session.name, "version": int(version), "incarnation": incarnation,
            "optimizer": session.options.spec,
            "mode": session.mode, "options": {name: getattr(session.options, name) for name in SESSION_OPTIONS},
            "hyperparams": hyper, "params": params, "tensors": tensors, "shared": shared}


def checked(state: Mapping[str, Any], tensor_names) -> Mapping[str, Any]:
    """``state`` if it is a saved state of these tensors (names as a session's), else raises.

    Raises:
      InvalidArgumentError: naming what is wrong (format, a missing or unexpected tensor).
    """
    if not isinstance(state, Mapping) or state.get("format") != FORMAT:
        got = state.get("format") if isinstance(state, Mapping) else type(state).__name__
        raise InvalidArgumentError(f"not a saved session state (format {got!r}; expected {FORMAT!r}: "
                                   f"Session.state() makes one)")
    names = set(tensor_names)
    missing, extra = sorted(names - set(state["params"])), sorted(set(state["params"]) - names)
    if missing or extra:
        raise InvalidArgumentError(f"the saved state holds other tensors than the session: missing {missing[:5]}, "
                                   f"unexpected {extra[:5]}")
    if not int(state["version"]) >= 0:
        raise InvalidArgumentError(f"a saved state's version must be >= 0, got {state['version']}")
    return state


def start_message(state: Mapping[str, Any]) -> data_pb2.StartState:
    """The ``start`` of an InitTensors that creates a session from ``state``."""
    hyper = {str(g): {str(o): float(v) for o, v in values.items()} for g, values in state.get("hyperparams", {}).items()}
    return data_pb2.StartState(version=int(state["version"]), hyperparams_json=json.dumps(hyper, sort_keys=True))


def state_requests(state: Mapping[str, Any], names) -> Iterator[data_pb2.InitTensorsRequest]:
    """The InitTensors messages carrying the optimizer state of tensors ``names`` (one shard's)
    and every shared leaf, in pieces of at most 1 MiB."""
    leaves = [(f"{_TENSOR}{name}/{path}", value) for name in names
              for path, value in state["tensors"].get(name, {}).items()]
    leaves += [(f"{_SHARED}{path}", value) for path, value in state["shared"].items()]
    for key, value in leaves:
        array = np.asarray(value)
        array = array if array.flags.c_contiguous else array.copy()  # (ascontiguousarray makes 0-d 1-d)
        flat = array.reshape(-1).view(np.uint8)
        for offset in range(0, max(flat.size, 1), _PIECE_BYTES):
            yield data_pb2.InitTensorsRequest(state=data_pb2.StateChunk(
                key=key, dtype=_dtype_name(array), shape=list(array.shape), offset=offset,
                data=flat[offset:offset + _PIECE_BYTES].tobytes()))
