"""Compiled programs shared by sessions: a process-wide cache of XLA executables, keyed by the
optimizer and the tensor structure a program serves and by the program's own text, and a count
of this process's XLA compilations."""

from __future__ import annotations

import collections
import hashlib
import json
import threading
from typing import Any, Callable, Hashable, Mapping, Optional

import numpy as np


class Executables:
    """A process-wide, bounded (least recently used) cache of compiled XLA programs by key: the
    structure a program serves first (optimizer, tensor names, argument types: a second session of
    the same model traces nothing), then the hash of a lowered program's text (tensors of other
    names, same program). Thread-safe; callers that need one program at once wait for one
    compilation, not each do their own."""

    _STRIPES = 64  # compile locks, by the structure key's hash: unrelated programs rarely wait on each other

    def __init__(self, capacity: int = 1024):
        self.capacity = capacity
        self._entries: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._compiling = [threading.Lock() for _ in range(self._STRIPES)]
        self.compiles = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable):
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
            return found

    def put(self, key: Hashable, compiled) -> None:
        with self._lock:
            self._entries[key] = compiled
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def compiled_for(self, structure_key: Optional[Hashable], lower: Callable[[], Any], fresh: bool = False):
        """The executable for ``structure_key`` (None: not keyable), else for the program
        ``lower()`` gives (lowered once here, compiled only if no identical program was).
        ``fresh``: look nothing up (an executable found before refused its arguments); lower,
        compile and file the result under both keys."""
        if structure_key is None:
            return self._lowered_and_compiled(None, lower, fresh)
        with self._compiling[hash(structure_key) % self._STRIPES]:
            found = None if fresh else self.get(structure_key)
            with self._lock:
                if found is None:
                    self.misses += 1
                else:
                    self.hits += 1
            return found if found is not None else self._lowered_and_compiled(structure_key, lower, fresh)

    def _lowered_and_compiled(self, structure_key: Optional[Hashable], lower: Callable[[], Any], fresh: bool):
        lowered = lower()
        text_key = ("hlo", hashlib.sha256(lowered.as_text(debug_info=False).encode()).hexdigest())
        found = None if fresh else self.get(text_key)
        if found is None:
            found = lowered.compile()
            with self._lock:
                self.compiles += 1
            self.put(text_key, found)
        if structure_key is not None:
            self.put(structure_key, found)
        return found

    def stats(self) -> dict[str, int]:
        """``{"entries", "hits", "misses"}`` now (lookups by structure)."""
        with self._lock:
            return {"entries": len(self._entries), "hits": self.hits, "misses": self.misses}


EXECUTABLES = Executables()

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
    jitted function, not only updates), plus :data:`EXECUTABLES`' ``entries`` / ``hits`` / ``misses``."""
    return {"compiles": _compiles, **EXECUTABLES.stats()}


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
