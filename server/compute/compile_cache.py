"""Compiled updates shared by sessions: a process-wide cache of jitted step, partial-statistic and
init functions keyed by the optimizer and the tensor structure, and a count of XLA compilations."""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
from typing import Any, Callable, Hashable, Mapping, Optional

import numpy as np


@dataclasses.dataclass(frozen=True)
class CompiledUpdate:
    """The jitted functions of one (optimizer, tensor structure): ``step(params, state, grads,
    scale, global_stat, hyper) -> (params, state)`` (donates params and state; ``hyper``: the
    step's hyperparameters, see :mod:`optserve.optim_kernels.hyperparams`), ``partial(grads, state,
    params) -> scalar`` (None without a cross-shard statistic) and ``init(params) -> state``."""

    step: Callable
    partial: Optional[Callable]
    init: Callable
    masked: Optional[Callable] = None  # step(..., hyper, keep): tensors with keep[name] left alone; compiles on first use
    measured: dict = dataclasses.field(default_factory=dict, compare=False)  # "working": step_working_bytes' figure
    compiled: threading.Event = dataclasses.field(default_factory=threading.Event, compare=False)  # see Updater
    compiling: threading.Lock = dataclasses.field(default_factory=threading.Lock, compare=False)


class CompiledUpdates:
    """A process-wide, bounded (least recently used) cache of :class:`CompiledUpdate` by key.

    ``hits`` / ``misses`` count lookups (a miss builds new jitted functions, which compile on
    their first call). Thread-safe.
    """

    def __init__(self, capacity: int = 256):
        self.capacity = capacity
        self.hits = 0
        self.misses = 0
        self._entries: collections.OrderedDict[Hashable, CompiledUpdate] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Optional[Hashable], build: Callable[[], CompiledUpdate]) -> CompiledUpdate:
        """The entry for ``key``, built by ``build()`` on a miss (``key`` None: built, not kept)."""
        with self._lock:
            entry = self._entries.get(key) if key is not None else None
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return entry
            self.misses += 1
        entry = build()
        if key is not None:
            with self._lock:
                entry = self._entries.setdefault(key, entry)  # a concurrent miss may have built one first
                self._entries.move_to_end(key)
                while len(self._entries) > self.capacity:
                    self._entries.popitem(last=False)
        return entry

    def stats(self) -> dict[str, int]:
        """``{"entries", "hits", "misses"}`` now."""
        with self._lock:
            return {"entries": len(self._entries), "hits": self.hits, "misses": self.misses}

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


COMPILED = CompiledUpdates()

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # one per XLA compilation
_compiles = 0
_listening = False
_listen_lock = threading.Lock()


def count_compiles() -> None:
    """Starts counting this process's XLA compilations (idempotent; see :func:`compile_stats`)."""
    global _listening
    import jax

    with _listen_lock:
        if _listening:
            return
        _listening = True

    def listener(event: str, duration_s: float, **_) -> None:
        global _compiles
        if event == _BACKEND_COMPILE_EVENT:
            _compiles += 1

    jax.monitoring.register_event_duration_secs_listener(listener)


def compile_stats() -> dict[str, int]:
    """``{"compiles"}``: XLA compilations in this process since :func:`count_compiles` (every
    jitted function, not only updates), plus :data:`COMPILED`'s ``entries`` / ``hits`` / ``misses``."""
    return {"compiles": _compiles, **COMPILED.stats()}


def update_key(optimizer, offloaded: bool, params: Mapping[str, Any]) -> Optional[tuple]:
    """The cache key of ``optimizer`` over ``params`` (name -> array), or None if its options are
    not plain JSON (then no two sessions can be shown to run the same function).

    ``offloaded``: Shampoo's roots come from the workers (the state the step sees is then fed
    by the preconditioner object; its options already differ, keyed anyway for clarity).
    """
    try:
        args = json.dumps(optimizer.args, sort_keys=True, allow_nan=True)
    except (TypeError, ValueError):
        return None
    structure = tuple((name, tuple(np.shape(params[name])), str(params[name].dtype if hasattr(params[name], 'dtype') else np.asarray(params[name]).dtype)) for name in sorted(params))
    return optimizer.name, args, bool(offloaded), structure


def compile_ahead(functions: CompiledUpdate, device, params, state, hyper) -> None:
    """Compiles ``functions``' step (and partial statistic) for ``params`` and ``state`` (arrays
    on ``device``; ``hyper``: abstract hyperparameters) now, so the first step is a dispatch (jit's
    cache keeps the result), then marks them compiled. Best effort: if it fails, the first step
    compiles as it would have."""
    import jax

    grads, scalar = _step_inputs(device, params)
    try:
        # twice: for the state init made, then for the state a step makes (its leaves' types can
        # differ, e.g. weakly typed counters), which every later step sees
        for _ in range(2):
            functions.step.lower(params, state, grads, scalar, scalar, hyper).compile()
            if functions.partial is not None:
                functions.partial.lower(grads, state, params).compile()
            params, state = _placed(device, jax.eval_shape(functions.step, params, state, grads, scalar, scalar, hyper))
    except Exception:  # noqa: BLE001 - an optimization only
        return
    functions.compiled.set()


def step_working_bytes(functions: CompiledUpdate, device, specs: Mapping[str, tuple], hyper) -> Optional[int]:
    """Bytes of XLA temporaries one step of ``functions`` allocates for tensors ``specs`` (name ->
    (shape, dtype)) on ``device``, beyond its inputs and outputs: its compiled program's working
    memory (``memory_analysis().temp_size_in_bytes``; for Shampoo with its roots computed inside
    the step, several times the parameters). Measured once per ``functions`` (kept in its
    ``measured``): the step is compiled for the shapes then, and its later calls
    (:func:`compile_ahead`, the first step) reuse that compilation. ``hyper``: abstract
    hyperparameters. None when it cannot be compiled (initialize reports why)."""
    if "working" not in functions.measured:
        with functions.compiling:
            if "working" not in functions.measured:
                functions.measured["working"] = _compiled_temporaries(functions, device, specs, hyper)
    return functions.measured["working"]


def _compiled_temporaries(functions: CompiledUpdate, device, specs: Mapping[str, tuple], hyper) -> Optional[int]:
    import jax

    params = _placed(device, {name: jax.ShapeDtypeStruct(tuple(shape), dtype) for name, (shape, dtype) in specs.items()})
    grads, scalar = _step_inputs(device, params)
    try:
        state = _placed(device, jax.eval_shape(functions.init, params))
        compiled = functions.step.lower(params, state, grads, scalar, scalar, hyper).compile()
        return int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - the step's own failure is reported where it runs
        return None


def _placed(device, tree):
    """``jax.ShapeDtypeStruct``s like ``tree``'s leaves (arrays or abstract values), placed on
    ``device``: what a step's compilation for arrays held there takes."""
    import jax

    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, weak_type=getattr(leaf, "weak_type", False),
                                          sharding=sharding), tree)


def _step_inputs(device, params) -> tuple[dict, Any]:
    """A step's abstract float32 gradients for ``params`` (placed on ``device``) and its scalar
    (the gradient scale and the global statistic)."""
    import jax

    grads = _placed(device, {name: jax.ShapeDtypeStruct(p.shape, np.float32) for name, p in params.items()})
    return grads, jax.ShapeDtypeStruct((), np.float32)
