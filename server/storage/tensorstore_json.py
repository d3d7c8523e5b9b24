"""tensorstore's ``to_json()`` without its leak: every checkpoint write stops keeping memory.

tensorstore (0.1.75 to 0.1.86, the newest release, at least) leaks every key and value of each JSON
object that ``to_json()`` hands to Python: its JSON-to-Python conversion passes released references
to ``PyDict_SetItem``, which does not take them over, so nothing it builds is ever freed (about
220 bytes for a two-key spec). orbax calls ``KvStore.Spec.to_json()`` for every array of every
OCDBT checkpoint it writes (and ``Spec.to_json()`` on restore), so a shard that checkpoints all
day grows by what those calls keep.

A spec's ``repr`` prints the same JSON as a Python literal from C++ (no Python object built by the
faulty conversion), so :func:`install` replaces ``to_json()`` on ``KvStore.Spec`` and ``Spec``
with one that reads that literal back (``ast.literal_eval``: data only, never code). Each call
checks its reading: the spec built from it must print the same ``repr``, or the call falls back
to tensorstore's own conversion. :func:`install` first checks, on specs of every JSON kind, that
both give equal results; where they differ (another tensorstore's ``repr``) it leaves tensorstore
as it is. ``include_defaults=True`` asks for JSON that ``repr`` does not print, so it keeps
tensorstore's own conversion.
"""

from __future__ import annotations

import ast
import logging
import threading
from typing import Any, Callable

log = logging.getLogger(__name__)

_PROBES = (
    ("KvStore.Spec", {"driver": "file", "path": "/probe/it's \"quoted\"/caf\u00e9 \u2603/"}),
    ("KvStore.Spec", {"driver": "ocdbt", "base": {"driver": "file", "path": "/probe/d/",
                                                  "file_io_locking": {"mode": "non_atomic"}},
                      "path": "a.b/c", "config": {"max_inline_value_bytes": 1024, "compression": None}}),
    ("Spec", {"driver": "zarr", "kvstore": {"driver": "memory"},
              "metadata": {"dtype": "<f4", "shape": [3, 5], "chunks": [3, 5], "fill_value": 0.25, "order": "C",
                           "compressor": None, "dimension_separator": "."}}),
    ("Spec", {"driver": "zarr", "kvstore": {"driver": "memory"}, "recheck_cached_data": False,
              "metadata": {"dtype": "|b1", "shape": [0], "chunks": [1], "fill_value": True, "compressor": None}}),
)

_lock = threading.Lock()
_installed: dict[str, Callable] = {}  # class name -> tensorstore's own to_json; guarded by _lock


def _utf8_strings(value: Any) -> Any:
    """``value`` with every string's characters read as UTF-8 bytes: ``repr`` prints a non-ASCII
    character as the ``\\x`` escapes of its UTF-8 bytes, which ``literal_eval`` reads one character
    per byte."""
    if isinstance(value, str):
        return value.encode("latin-1").decode("utf-8")
    if isinstance(value, dict):
        return {_utf8_strings(key): _utf8_strings(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_utf8_strings(item) for item in value]
    return value


def _literal_to_json(original: Callable) -> Callable:
    def to_json(self, include_defaults: bool = False) -> Any:
        if include_defaults:
            return original(self, include_defaults=True)
        text = repr(self)  # "KvStore.Spec({...})" or "Spec({...})"
        try:
            value = _utf8_strings(ast.literal_eval(text[text.index("(") + 1:-1]))
            if repr(type(self)(value)) == text:  # read back exactly: the spec it names is this one
                return value
        except (ValueError, SyntaxError, UnicodeError):
            pass
        return original(self)  # not read back exactly: tensorstore's own (leaking) conversion

    to_json.__doc__ = original.__doc__
    return to_json


def _classes(ts) -> dict[str, type]:
    return {"KvStore.Spec": ts.KvStore.Spec, "Spec": ts.Spec}


def install() -> bool:
    """Replaces ``to_json()`` of tensorstore's ``KvStore.Spec`` and ``Spec`` with the leak-free
    reading of their ``repr`` (idempotent). True if in place; False (tensorstore unchanged, one
    WARNING logged) where the two readings differ on a probe spec."""
    import tensorstore as ts

    with _lock:
        if _installed:
            return True
        classes = _classes(ts)
        replacements = {name: _literal_to_json(cls.to_json) for name, cls in classes.items()}
        for name, json_spec in _PROBES:
            spec = classes[name](json_spec)
            try:
                same = replacements[name](spec) == classes[name].to_json(spec)
            except (ValueError, SyntaxError):
                same = False
            if not same:
                log.warning("event=tensorstore_to_json_kept version=%s reason=its repr does not read back "
                            "as its JSON; checkpoint writes keep tensorstore's per-call leak", ts.__version__)
                return False
        for name, cls in classes.items():
            _installed[name] = cls.to_json
            cls.to_json = replacements[name]
        return True


def uninstall() -> None:
    """Puts tensorstore's own ``to_json()`` back (for tests that measure it)."""
    import tensorstore as ts

    with _lock:
        for name, cls in _classes(ts).items():
            if name in _installed:
                cls.to_json = _installed.pop(name)
