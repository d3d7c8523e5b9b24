"""A standby's messages as ``ShardReplica`` frames (``replica.proto``), and back.

A message that carries arrays (a session's start, one applied step) is a ``begin`` frame naming
its arrays' element types and shapes, their bytes in ``part`` frames of at most ``chunk_bytes``,
and an ``end`` frame; the clock's entries are one frame. :class:`FrameAssembler` takes frames in
the order they came and hands back whole messages, refusing (``ValueError``, naming what is
wrong) a frame out of place, an array whose bytes overlap, overrun or fall short, or an element
type outside :data:`ARRAY_DTYPES`: the standby never guesses at a damaged message.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterator, Optional, Sequence, Union

import numpy as np

from optserve.protos.optserve.v1 import replica_pb2
from optserve.server.domain.durability import ShardProgress, StepRecord
from optserve.server.domain.shard import ReplicaStart, RootInstall, StateLeaves

CHUNK_BYTES = 4 << 20
ARRAY_DTYPES = frozenset({"float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8",
                          "uint16", "uint32", "uint64", "bool"})  # what an optimizer's state holds
_KIND_START, _KIND_STEP = replica_pb2.ReplicaBegin.KIND_START, replica_pb2.ReplicaBegin.KIND_STEP


@dataclasses.dataclass(frozen=True)
class StartMessage:
    """A session's start, as the standby installs it."""

    session: str
    start: ReplicaStart


@dataclasses.dataclass(frozen=True)
class StepMessage:
    """One applied step: its record, its gradients (the shard's tensors in order) and the offloaded
    roots its primary installed before it (oldest first)."""

    session: str
    record: StepRecord
    grads: list
    roots: tuple = ()
    digest: Optional[int] = None  # the primary's parameters' digest after the step (every DIGEST_EVERY)


@dataclasses.dataclass(frozen=True)
class ClockMessage:
    """The home clock's journal entries, with the stream's sequence number the answer names."""

    session: str
    entries: list
    sequence: int


Message = Union[StartMessage, StepMessage, ClockMessage]


def start_frames(session: str, start: ReplicaStart, chunk_bytes: int = CHUNK_BYTES) -> Iterator[replica_pb2.ReplicaFrame]:
    """The frames of ``start`` (its optimizer state's leaves in the tree's order)."""
    import jax  # the server's side only: the state is a tree of JAX's

    names = list(start.params)
    leaves = start.opt_state.leaves if isinstance(start.opt_state, StateLeaves) else jax.tree.leaves(start.opt_state)
    meta = {"progress": start.progress.to_json(), "clock": start.clock_state}
    arrays = [np.asarray(start.params[name]) for name in names] + [np.asarray(leaf) for leaf in leaves]
    return _frames(_KIND_START, session, json.dumps(meta), arrays, chunk_bytes, names)


def step_frames(session: str, record: StepRecord, grads: Sequence[np.ndarray],
                chunk_bytes: int = CHUNK_BYTES, roots: Sequence[RootInstall] = (),
                digest: Optional[int] = None) -> Iterator[replica_pb2.ReplicaFrame]:
    """The frames of one applied step (``grads``: the shard's tensors in order; ``roots``: the
    installs before it, each as its roots and errors after the gradients, their steps in the
    description, as is ``digest``)."""
    meta = {**record.to_json(), "root_installs": [install.step for install in roots]}
    if digest is not None:
        meta["digest"] = digest
    arrays = [np.asarray(g) for g in grads]
    for install in roots:
        arrays += [np.asarray(install.roots), np.asarray(install.errors)]
    return _frames(_KIND_STEP, session, json.dumps(meta), arrays, chunk_bytes, [])


def clock_frame(session: str, entries: Sequence[Any], sequence: int) -> replica_pb2.ReplicaFrame:
    """The home clock's journal entries as one frame."""
    return replica_pb2.ReplicaFrame(clock=replica_pb2.ReplicaClockEntries(
        session=session, entries_json=[json.dumps(entry) for entry in entries], sequence=sequence))


def _frames(kind: int, session: str, meta_json: str, arrays: list, chunk_bytes: int,
            param_names: list) -> Iterator[replica_pb2.ReplicaFrame]:
    specs = []
    for array in arrays:
        if array.dtype.name not in ARRAY_DTYPES:
            raise ValueError(f"session {session!r}: an array of {array.dtype.name} cannot be replicated")
        specs.append(replica_pb2.ReplicaArraySpec(dtype=array.dtype.name, shape=array.shape))
    yield replica_pb2.ReplicaFrame(begin=replica_pb2.ReplicaBegin(
        kind=kind, session=session, meta_json=meta_json, arrays=specs, param_names=param_names))
    for index, array in enumerate(arrays):
        data = _bytes_of(np.ascontiguousarray(array))
        for offset in range(0, data.size, chunk_bytes):
            yield replica_pb2.ReplicaFrame(part=replica_pb2.ReplicaPart(
                array=index, offset=offset, data=data[offset:offset + chunk_bytes].tobytes()))
    yield replica_pb2.ReplicaFrame(end=replica_pb2.ReplicaEnd())


class FrameAssembler:
    """Frames in, whole messages out (:meth:`add`), for one stream."""

    def __init__(self):
        self._begin: Optional[replica_pb2.ReplicaBegin] = None
        self._arrays: list[np.ndarray] = []
        self._filled: list[int] = []

    def add(self, frame: replica_pb2.ReplicaFrame) -> Optional[Message]:
        """The message ``frame`` completes (None while one is under way).

        Raises:
          ValueError: the frame does not fit where it came (the stream is damaged).
        """
        body = frame.WhichOneof("body")
        if body == "begin":
            if self._begin is not None:
                raise ValueError(f"a message for session {frame.begin.session!r} began inside one for "
                                 f"{self._begin.session!r}")
            self._open(frame.begin)
            return None
        if body == "part":
            self._fill(frame.part)
            return None
        if body == "end":
            return self._close()
        if body == "clock":
            if self._begin is not None:
                raise ValueError(f"clock entries for session {frame.clock.session!r} came inside a message")
            if frame.clock.sequence <= 0:
                raise ValueError(f"clock entries for session {frame.clock.session!r} with sequence "
                                 f"{frame.clock.sequence}: expected 1 or more")
            return ClockMessage(frame.clock.session, [_json(text, "a clock entry") for text in frame.clock.entries_json],
                                frame.clock.sequence)
        raise ValueError("an empty frame")

    def _open(self, begin: replica_pb2.ReplicaBegin) -> None:
        if begin.kind not in (_KIND_START, _KIND_STEP):
            raise ValueError(f"session {begin.session!r}: a message of unknown kind {begin.kind}")
        arrays = []
        for index, spec in enumerate(begin.arrays):
            if spec.dtype not in ARRAY_DTYPES or any(d < 0 for d in spec.shape):
                raise ValueError(f"session {begin.session!r}: array {index} is {spec.dtype} {list(spec.shape)}")
            arrays.append(np.empty(tuple(spec.shape), dtype=_dtype(spec.dtype)))
        if len(begin.param_names) > len(arrays) or (begin.kind == _KIND_STEP and begin.param_names):
            raise ValueError(f"session {begin.session!r}: {len(begin.param_names)} parameter names for "
                             f"{len(arrays)} arrays")
        self._begin, self._arrays, self._filled = begin, arrays, [0] * len(arrays)

    def _fill(self, part: replica_pb2.ReplicaPart) -> None:
        if self._begin is None:
            raise ValueError("array bytes came outside a message")
        if not 0 <= part.array < len(self._arrays):
            raise ValueError(f"session {self._begin.session!r}: bytes for array {part.array} of {len(self._arrays)}")
        target = _bytes_of(self._arrays[part.array])
        if part.offset != self._filled[part.array] or part.offset + len(part.data) > target.size:
            raise ValueError(f"session {self._begin.session!r}: array {part.array} got bytes "
                             f"[{part.offset}, {part.offset + len(part.data)}) after {self._filled[part.array]} of "
                             f"{target.size}")
        target[part.offset:part.offset + len(part.data)] = np.frombuffer(part.data, np.uint8)
        self._filled[part.array] += len(part.data)

    def _close(self) -> Message:
        begin, arrays = self._begin, self._arrays
        if begin is None:
            raise ValueError("a message ended that never began")
        short = [i for i, (a, n) in enumerate(zip(arrays, self._filled)) if n != a.nbytes]
        if short:
            raise ValueError(f"session {begin.session!r}: arrays {short} ended short of their bytes")
        self._begin, self._arrays, self._filled = None, [], []
        meta = _json(begin.meta_json, "a message's description")
        try:
            if begin.kind == _KIND_STEP:
                grads, roots = _split_roots(begin.session, arrays, [int(step) for step in meta.get("root_installs", [])])
                digest = meta.get("digest")
                return StepMessage(begin.session, StepRecord.from_json(meta), grads, roots,
                                   None if digest is None else int(digest))
            names = list(begin.param_names)
            start = ReplicaStart(ShardProgress.from_json(meta["progress"]), dict(zip(names, arrays[:len(names)])),
                                 StateLeaves(tuple(arrays[len(names):])), meta.get("clock"))
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"session {begin.session!r}: the message's description does not decode: {exc!r}") from None
        return StartMessage(begin.session, start)


def _split_roots(session: str, arrays: list, steps: list[int]) -> tuple[list, tuple]:
    """A step's arrays as its gradients and its root installs (two arrays each, last).

    Raises:
      ValueError: the installs' arrays are missing or are not float32 ``[B, n, n]`` and ``[B]``.
    """
    count = len(arrays) - 2 * len(steps)
    if count < 0:
        raise ValueError(f"session {session!r}: {len(steps)} root installs in a step of {len(arrays)} arrays")
    roots = []
    for index, step in enumerate(steps):
        matrices, errors = arrays[count + 2 * index], arrays[count + 2 * index + 1]
        if (matrices.dtype != np.float32 or errors.dtype != np.float32 or matrices.ndim != 3 or errors.ndim != 1
                or matrices.shape[0] != errors.shape[0] or matrices.shape[1] != matrices.shape[2]):
            raise ValueError(f"session {session!r}: root install {index} (step {step}) is {matrices.dtype} "
                             f"{list(matrices.shape)} with errors {errors.dtype} {list(errors.shape)}")
        roots.append(RootInstall(step, matrices, errors))
    return arrays[:count], tuple(roots)


def _bytes_of(array: np.ndarray) -> np.ndarray:
    """A C-contiguous array's bytes, as a flat uint8 view (any element type, empty arrays too)."""
    return array.reshape(-1).view(np.uint8)


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes  # numpy knows bfloat16 through it (JAX's own dependency)

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{what} is not JSON: {exc}") from None
