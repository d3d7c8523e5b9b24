"""DiLoCo without a framework: the outer loop of low-communication training on optserve sessions.

DiLoCo (Douillard et al., 2023): each worker runs ``sync_every`` (H) inner steps with its own
optimizer, then sends its *pseudo-gradient* ``snapshot - current`` (the start-of-round shared
parameters minus its parameters now); the server averages the workers' pseudo-gradients and the
session's (outer) optimizer updates the shared parameters, which every worker loads and takes as
its next snapshot. Inner optimizer state stays with the worker across rounds.

Streaming DiLoCo (Douillard et al., 2025) splits the parameters into F *fragments* (contiguous
groups of tensors in model order, balanced by size), each its own session with its own outer
state, synced at staggered inner steps: fragment f at the steps ``t`` with ``t % H == f * H // F``
(``t`` counts inner steps from 1, so fragment 0 syncs at H, 2H, ...). With ``overlap_steps`` (tau)
a fragment's exchange runs in the background while the next tau inner steps compute; when its
answer lands the fragment's parameters are merged as the paper does,
``local <- alpha * local + (1 - alpha) * shared`` (``merge_alpha``, 0.5 by default; tau = 0 loads
the shared parameters as they are), and the shared parameters become the fragment's new snapshot.

Dynamic Local Updates (after Liu et al., 2024): with ``sync_every="auto"`` each worker picks its
own H every round from its measured inner-step time, ``H = max(1, round(sync_seconds / step_s))``
(``step_s``: an exponential average of its inner steps' wall time, 0.5 per round, that follows
a faster round at once: a stall such as the first step's does not hold H down), so fast and
slow workers reach the server at a similar cadence (every ``sync_seconds`` plus an exchange; the
exchanges themselves, and the sessions' creation, are not counted as inner-step time); the first
round exchanges after ``sync_seconds`` of wall time once the sessions are ready. Each exchange's H is in :attr:`DiLoCoCore.exchanges`
(and travels with the push as the scalar ``diloco_h``). Fragments need a fixed H.

This module holds the NumPy state and schedule; the torch and JAX adapters
(:class:`optserve.client.torch.DiLoCo`, :class:`optserve.client.jax.DiLoCo`) read and write their
framework's parameters through it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any, Mapping, Optional

import numpy as np

from optserve.client._sparseloco import ErrorFedSparsifier, SparseLoCo
from optserve.client.errors import AlreadyExistsError, InvalidArgumentError
from optserve.client.options import SessionOptions
from optserve.client import _wire
from optserve.protos import contract, int8_codec
from optserve.protos.sparse_codec import SparseGradient

DEFAULT_OUTER = {"name": "sgd", "args": {"learning_rate": 0.7, "momentum": 0.9, "nesterov": True}}


def _wire_bytes(tensor, wire: Optional[int]) -> int:
    """The bytes one pseudo-gradient tensor's values take on the wire (chunk payloads) in wire
    dtype ``wire`` (None: float32)."""
    if isinstance(tensor, SparseGradient):
        return tensor.wire_bytes(contract.DEFAULT_CHUNK_BYTES)
    if wire == contract.INT8:
        return int8_codec.int8_payload_bytes(tensor.size)
    return tensor.size * contract.ITEMSIZE[wire or contract.FLOAT32]


def fragment_names(names_and_sizes: list[tuple[str, int]], fragments: int) -> list[list[str]]:
    """Splits tensors (in model order) into ``fragments`` contiguous groups of similar element counts."""
    if not isinstance(fragments, int) or isinstance(fragments, bool) or not 1 <= fragments <= len(names_and_sizes):
        raise InvalidArgumentError(f"fragments must be an int from 1 to the number of tensors "
                                   f"({len(names_and_sizes)}), got {fragments!r}")
    total = sum(size for _, size in names_and_sizes)
    groups: list[list[str]] = [[] for _ in range(fragments)]
    group, seen = 0, 0
    for index, (name, size) in enumerate(names_and_sizes):
        groups[group].append(name)
        seen += size
        left, empty = len(names_and_sizes) - index - 1, fragments - 1 - group  # tensors / groups still to fill
        if group < fragments - 1 and (left == empty or seen * fragments >= (group + 1) * total):
            group += 1
    return groups


@dataclasses.dataclass(frozen=True)
class Exchange:
    """One completed exchange of a worker: ``fragment``, the inner step it was sent after, the H
    of its round, the session version its pseudo-gradient went into (None: dropped as late by an
    elastic session), the version of the parameters it got back, and the tensor bytes it sent
    (``bytes_up``: the pseudo-gradient as encoded for the wire) and received (``bytes_down``: the
    reply's chunk payloads over gRPC, the round's sparse parts where they rebuilt a tensor; 0
    where the parameters came through shared memory)."""

    fragment: int
    inner_step: int
    sync_every: int
    version: Optional[int]
    received_version: int
    bytes_up: int = 0
    bytes_down: int = 0


@dataclasses.dataclass
class _Fragment:
    session: Any  # optserve.client.Session
    names: list[str]
    offset: int
    snapshot: dict[str, np.ndarray]
    in_flight: Optional[concurrent.futures.Future] = None
    lands_at: int = 0
    sent_after: int = 0
    sent_h: int = 0
    sent_bytes: int = 0
    deltas: dict = dataclasses.field(default_factory=dict)  # pseudo-gradient buffers, reused by each send

    def pseudo_gradient(self, current: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``snapshot - current`` per tensor, into this fragment's reused buffers (an exchange
        reads them until it lands, and a fragment has one exchange in flight at a time)."""
        for name in self.names:
            out = self.deltas.get(name)
            if out is None:
                out = self.deltas[name] = np.empty_like(self.snapshot[name])
            np.subtract(self.snapshot[name], np.asarray(current[name], dtype=np.float32), out=out)
        return {name: self.deltas[name] for name in self.names}


class DiLoCoViews:
    """What the torch and JAX adapters show of their :class:`DiLoCoCore` (``self._core``)."""

    _core: "DiLoCoCore"

    @property
    def sessions(self) -> list:
        """The ``Session`` objects, one per fragment."""
        return self._core.sessions

    @property
    def rounds(self) -> list[int]:
        """Exchanges completed, per fragment."""
        return list(self._core.rounds)

    @property
    def exchanges(self) -> list:
        """One :class:`Exchange` per completed exchange (fragment, inner step, H, versions)."""
        return list(self._core.exchanges)


class DiLoCoCore:
    """The outer loop's state for one worker (see the module docstring).

    Args:
      client: an ``optserve.client.Client``.
      session: the session's name (fragment f of F > 1 is session ``"{session}.f{f}"``).
      initial: tensor name -> float32 values, in model order (the worker's parameters now).
      sync_every: H, inner steps per round (>= 1), or "auto" (Dynamic Local Updates, see the
        module docstring; then ``sync_seconds`` is the target round time).
      outer: the outer optimizer spec (any registry optimizer); default Nesterov SGD, lr 0.7, momentum 0.9.
      fragments, overlap_steps, merge_alpha: streaming (see the module docstring).
      wire_dtype: the pseudo-gradients' wire dtype (None, "bf16", "f16", "int8" with error feedback).
      compression: None, or ``{"name": "sparseloco", ...}`` (:class:`~optserve.client._sparseloco.SparseLoCo`):
        each exchange sends the top entries of each chunk of an error-fed buffer, a few bits each.
      worker_id: this worker's id in the sessions (elastic ones: its member id).
      options: the other session options (mode, num_workers, elastic options, ...).

    Attributes:
      created: whether this worker created the sessions (False: it attached).
      rounds: exchanges completed per fragment.
    """

    def __init__(self, client, session: str, initial: Mapping[str, np.ndarray], *, sync_every: Any,
                 outer: Optional[Mapping[str, Any]] = None, fragments: int = 1, overlap_steps: int = 0,
                 merge_alpha: float = 0.5, wire_dtype: Optional[str] = None, worker_id: Optional[str] = None,
                 sync_seconds: Optional[float] = None, compression: Optional[Mapping[str, Any]] = None,
                 **options: Any):
        self.auto = sync_every == "auto"
        if self.auto:
            if sync_seconds is None or not 0 < float(sync_seconds) < float("inf"):
                raise InvalidArgumentError(f'sync_every="auto" needs sync_seconds > 0 (the target round time), '
                                           f"got {sync_seconds!r}")
            if fragments != 1 or overlap_steps:
                raise InvalidArgumentError('sync_every="auto" works with fragments=1 and overlap_steps=0')
            sync_every = 1 << 30  # not used: rounds end by wall time, then by the measured H
        elif not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1:
            raise InvalidArgumentError(f'sync_every must be an int >= 1 or "auto", got {sync_every!r}')
        if not isinstance(overlap_steps, int) or isinstance(overlap_steps, bool) or not 0 <= overlap_steps < sync_every:
            raise InvalidArgumentError(f"overlap_steps must be an int from 0 to sync_every - 1, got {overlap_steps!r}")
        self.sync_seconds = None if sync_seconds is None else float(sync_seconds)
        self._step_s: Optional[float] = None  # auto: average inner-step wall time
        self._round_start_step = 0
        self._auto_h: Optional[int] = None  # auto: this round's H (None: the first round, timed)
        self.exchanges: list[Exchange] = []
        if not 0.0 <= merge_alpha <= 1.0:
            raise InvalidArgumentError(f"merge_alpha must be in [0, 1], got {merge_alpha!r}")
        self.sync_every, self.overlap_steps, self.merge_alpha = sync_every, overlap_steps, float(merge_alpha)
        self.wire_dtype = wire_dtype
        sparse = SparseLoCo.from_spec(compression)
        if sparse is not None:
            if wire_dtype is not None:
                raise InvalidArgumentError(f"compression {compression['name']!r} encodes the pseudo-gradients "
                                           f"itself: leave wire_dtype unset (got {wire_dtype!r})")
            if options.setdefault("sparse_mean", sparse.aggregation) != sparse.aggregation:
                raise InvalidArgumentError(f"sparse_mean={options['sparse_mean']!r} contradicts the compression's "
                                           f"aggregation={sparse.aggregation!r} (set one)")
        self.sparsifier = None if sparse is None else ErrorFedSparsifier(sparse)
        session_options = SessionOptions.from_spec(dict(outer or DEFAULT_OUTER), wire_dtype=wire_dtype, **options)
        groups = fragment_names([(n, int(np.asarray(v).size)) for n, v in initial.items()], fragments)
        self.created = True
        self.fragments: list[_Fragment] = []
        for index, names in enumerate(groups):
            name = session if len(groups) == 1 else f"{session}.f{index}"
            values = {n: np.array(initial[n], dtype=np.float32) for n in names}
            try:
                handle = client.create_session_with(name, values, session_options, worker_id=worker_id)
                shared = values
            except AlreadyExistsError:  # another worker created it: attach and start from the shared values
                handle = client.session(name, expect=session_options, worker_id=worker_id)
                shared = handle.pull(wire_dtype=None)
                self.created = False
            self.fragments.append(_Fragment(handle, names, index * sync_every // len(groups),
                                            {n: np.array(shared[n], dtype=np.float32) for n in names}))
        self.rounds = [0] * len(self.fragments)
        self._round_started = time.monotonic()  # auto: the first round is timed from here (sessions ready)

    @property
    def sessions(self) -> list:
        return [f.session for f in self.fragments]

    def shared(self) -> dict[str, np.ndarray]:
        """The shared parameters as this worker last received them (its snapshots)."""
        return {n: v for f in self.fragments for n, v in f.snapshot.items()}

    def due(self, step: int) -> list[int]:
        """Fragments whose exchange starts after inner step ``step`` (counted from 1)."""
        if self.auto:
            return [0] if self._auto_round_over(step) else []
        return [i for i, f in enumerate(self.fragments) if step % self.sync_every == f.offset % self.sync_every]

    def _auto_round_over(self, step: int) -> bool:
        steps = step - self._round_start_step
        if self._auto_h is None:  # the first round: by wall time
            return time.monotonic() - self._round_started >= self.sync_seconds
        return steps >= self._auto_h

    def _next_auto_round(self, step: int) -> None:
        """Dynamic Local Updates: the next round's H from this round's inner-step time."""
        steps = max(1, step - self._round_start_step)
        step_s = (time.monotonic() - self._round_started) / steps
        # a round's steps can only be slowed by a one-off stall (the first step, a compile), never sped
        # up: the average follows a faster round at once and a slower one by halves
        self._step_s = step_s if self._step_s is None else min(step_s, 0.5 * self._step_s + 0.5 * step_s)
        self._auto_h = max(1, round(self.sync_seconds / self._step_s))
        self._round_started, self._round_start_step = time.monotonic(), step

    def send(self, index: int, current: Mapping[str, np.ndarray], step: int) -> None:
        """Starts fragment ``index``'s exchange: pushes ``snapshot - current`` (``current``: its
        tensors' float32 values now); with ``overlap_steps`` it runs in the background."""
        fragment = self.fragments[index]
        delta = fragment.pseudo_gradient(current)
        kwargs: dict[str, Any] = {"wire_dtype": self.wire_dtype} if self.wire_dtype is not None else {}
        if self.sparsifier is not None:
            delta = self.sparsifier.compress(delta)
            kwargs["wire_dtype"] = contract.SPARSE
            # the round's answer may be its sparse parts, rebuilt from the snapshot (the values of this version)
            kwargs["sparse_base"] = (fragment.session.version, fragment.snapshot)
        wire = _wire.wire_option_enum(kwargs.get("wire_dtype"), what="wire_dtype")
        fragment.sent_bytes = sum(_wire_bytes(d, wire) for d in delta.values())
        fragment.sent_after = step
        fragment.sent_h = (step - self._round_start_step) if self.auto else self.sync_every
        kwargs["scalars"] = {"diloco_h": float(fragment.sent_h)}
        if self.auto:
            self._next_auto_round(step)
        if self.overlap_steps:
            fragment.in_flight = fragment.session.push_pull_async(delta, **kwargs)
        else:
            fragment.in_flight = concurrent.futures.Future()
            try:
                fragment.in_flight.set_result(fragment.session.push_pull(delta, **kwargs))
            except Exception as exc:  # noqa: BLE001 - raised by receive(), which puts back what was sent
                fragment.in_flight.set_exception(exc)
            if self.auto:  # an exchange is not an inner step: the next round's steps are timed from here
                self._round_started = time.monotonic()
        fragment.lands_at = step + self.overlap_steps

    def after_inner_step(self, step: int, current_of) -> dict[str, np.ndarray]:
        """The exchanges due after inner step ``step``: merges those landing now, starts those
        due now (no overlap: and waits for them); returns the values the adapter loads
        (``current_of(names)``: the current float32 values of those tensors)."""
        loaded: dict[str, np.ndarray] = {}
        for index in self.landing(step):
            loaded.update(self.receive(index, current_of(self.fragments[index].names)))
        for index in self.due(step):  # fragments are disjoint: a landing one is never due at once
            self.send(index, current_of(self.fragments[index].names), step)
            if not self.overlap_steps:
                loaded.update(self.receive(index, {}))
        return loaded

    def landing(self, step: int) -> list[int]:
        """Fragments whose exchange is due to be merged after inner step ``step``."""
        return [i for i, f in enumerate(self.fragments) if f.in_flight is not None and step >= f.lands_at]

    def receive(self, index: int, current: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Waits for fragment ``index``'s exchange and returns the values its tensors take now: the
        shared parameters (no overlap), or their merge with ``current`` (overlap)."""
        fragment = self.fragments[index]
        try:
            shared = fragment.in_flight.result()
        except BaseException:
            if self.sparsifier is not None:  # applied nowhere: what it sent stays to be sent
                self.sparsifier.unsend(fragment.names)
            raise
        finally:
            fragment.in_flight = None
        # push_pull hands back fresh arrays (no views): they become the snapshot without a copy
        fragment.snapshot = {n: np.asarray(shared[n], dtype=np.float32) for n in fragment.names}
        self.rounds[index] += 1
        outcome = fragment.session.last_step
        if self.sparsifier is not None and outcome is not None and outcome.version is None:
            self.sparsifier.unsend(fragment.names)  # dropped as late: applied nowhere
        self.exchanges.append(Exchange(index, fragment.sent_after, fragment.sent_h,
                                       outcome.version if outcome is not None else None,
                                       outcome.current_version if outcome is not None else fragment.session.version,
                                       fragment.sent_bytes, fragment.session.last_received_bytes))
        if not self.overlap_steps:
            return fragment.snapshot
        alpha = np.float32(self.merge_alpha)
        return {n: alpha * np.asarray(current[n], dtype=np.float32) + (np.float32(1) - alpha) * fragment.snapshot[n]
                for n in fragment.names}

    def error_buffers(self) -> dict[str, np.ndarray]:
        """Copies of SparseLoCo's error buffers (empty without compression)."""
        return {} if self.sparsifier is None else self.sparsifier.state()

    def load_error_buffers(self, buffers: Mapping[str, np.ndarray]) -> None:
        """Restores :meth:`error_buffers` from a checkpoint (each tensor's shape checked)."""
        if not buffers:
            return
        if self.sparsifier is None:
            raise InvalidArgumentError("the state holds SparseLoCo error buffers, but this DiLoCo has no compression")
        shapes = {n: v.shape for f in self.fragments for n, v in f.snapshot.items()}
        for name, value in buffers.items():
            if name not in shapes or tuple(np.shape(value)) != shapes[name]:
                raise InvalidArgumentError(f"error buffer {name!r} of shape {list(np.shape(value))} does not match "
                                           f"a tensor of this model ({list(shapes.get(name, ()))})")
        self.sparsifier.load_state(buffers)

    def flush(self, current_of) -> dict[str, np.ndarray]:
        """Waits for every exchange in flight; returns the values to load (``current_of(names)``
        gives the current values of those tensors)."""
        loaded = {}
        for index in [i for i, f in enumerate(self.fragments) if f.in_flight is not None]:
            loaded.update(self.receive(index, current_of(self.fragments[index].names)))
        return loaded

    def close(self) -> None:
        for fragment in self.fragments:
            fragment.session.detach()
