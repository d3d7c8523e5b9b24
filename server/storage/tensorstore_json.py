"""tensorstore's ``to_json()`` without its leak: every checkpoint write stops keeping memory.

tensorstore (0.1.75 to 0.1.86, the newest release, at least) leaks every key and value of each JSON
object that ``to_json()`` hands to Python: its JSON-to-Python conversion passes released references
to ``PyDict_SetItem``, which does not take them over, so nothing it builds is ever freed (about
220 bytes for a two-key spec). orbax calls ``KvStore.Spec.to_json()`` for every array of every
OCDBT checkpoint it writes (and ``Spec.to_json()`` on restore), so a shard that checkpoints all
day grows by what those calls keep.

A spec's ``repr`` prints the same JSON as a Python literal from C++ (no Python object built by the
faulty conversion), so :func:`install` replaces ``to_json()`` on ``KvStore.Spec`` and ``Spec``
with one that reads that literal back: its strings, constants and trailing commas turned into
JSON's, then ``json.loads`` (not ``ast.literal_eval``: on CPython 3.11 compiling in several
threads at once can fail with ``SystemError: AST constructor recursion depth mismatch``, and
shards write checkpoints from several threads). Each call
checks its reading: the spec built from it must print the same ``repr``, or the call falls back
to tensorstore's own conversion. :func:`install` first checks, on specs of every JSON kind, that
both give equal results; where they differ (another tensorstore's ``repr``) it leaves tensorstore
as it is. ``include_defaults=True`` asks for JSON that ``repr`` does not print, so it keeps
tensorstore's own conversion.
"""

from __future__ import annotations

import codecs
import importlib.metadata
import json
import logging
import re
import threading
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)

_PROBES = (
    ("KvStore.Spec", {"driver": "file", "path": "/probe/it's \"quoted\"/caf\u00e9 \u2603/"}),
    ("KvStore.Spec", {"driver": "ocdbt", "base": {"driver": "file", "path": "/probe/d/",
                                                  "file_io_locking": {"mode": "non_atomic"}},
                      "path": "a.b/c", "config": {"max_inline_value_bytes": 1024, "compression": None}}),
    ("Spec", {"driver": "zarr", "kvstore": {"driver": "memory"},  # a float that rounds, and 1.0 (not 1)
              "metadata": {"dtype": "<f8", "shape": [2], "chunks": [2], "fill_value": 0.30000000000000004,
                           "compressor": None}}),
    ("Spec", {"driver": "zarr", "kvstore": {"driver": "memory"},
              "metadata": {"dtype": "<f4", "shape": [3, 5], "chunks": [3, 5], "fill_value": 1.0, "order": "C",
                           "compressor": None, "dimension_separator": "."}}),
    ("Spec", {"driver": "zarr", "kvstore": {"driver": "memory"}, "recheck_cached_data": False,
              "metadata": {"dtype": "|b1", "shape": [0], "chunks": [1], "fill_value": True, "compressor": None}}),
)

# In a spec's repr: a quoted string (its escapes those of C: \', \", \\, \n, \xNN for other bytes,
# non-ASCII characters as their UTF-8 bytes), a Python constant, or a trailing comma before a
# closing bracket (the pretty-printed form has them). Everything else is JSON already.
_REPR_TOKEN = re.compile(r"'((?:[^'\\]|\\.)*)'|\b(True|False|None)\b|,(\s*[}\]])")
_CONSTANTS = {"True": "true", "False": "false", "None": "null"}


def _json_text(literal: str) -> str:
    """The JSON text of a spec's ``repr`` literal (the part inside ``Spec(...)``)."""
    def token(match: re.Match) -> str:
        if match.group(1) is not None:
            return json.dumps(codecs.escape_decode(match.group(1).encode("ascii"))[0].decode("utf-8"))
        if match.group(2) is not None:
            return _CONSTANTS[match.group(2)]
        return match.group(3)

    return _REPR_TOKEN.sub(token, literal)


_counts = {"read_back": 0, "fell_back": 0}
_counts_lock = threading.Lock()


def _count(outcome: str) -> None:
    with _counts_lock:
        _counts[outcome] += 1


def conversions() -> dict[str, int]:
    """How the replaced ``to_json()`` answered in this process: ``read_back`` (from the repr, keeping
    nothing) and ``fell_back`` (tensorstore's own conversion)."""
    with _counts_lock:
        return dict(_counts)


def _literal_to_json(original: Callable) -> Callable:
    def to_json(self, include_defaults: bool = False) -> Any:
        if include_defaults:
            return original(self, include_defaults=True)
        text = repr(self)  # "KvStore.Spec({...})" or "Spec({...})"
        try:
            value = json.loads(_json_text(text[text.index("(") + 1:-1]))
            if repr(type(self)(value)) == text:  # read back exactly: the spec it names is this one
                _count("read_back")
                return value
        except Exception:  # noqa: BLE001 - not a literal of its JSON (e.g. "Spec(...)"): tensorstore's own answer
            pass
        _count("fell_back")
        return original(self)  # not read back exactly: tensorstore's own (leaking) conversion, or its error

    to_json.__doc__ = original.__doc__
    return to_json


def _classes(ts) -> dict[str, type]:
    return {"KvStore.Spec": ts.KvStore.Spec, "Spec": ts.Spec}


_OWN: dict[str, Callable] = {}  # class name -> tensorstore's own to_json, once replaced


def own_to_json(name: str) -> Callable:
    """tensorstore's own ``to_json`` of the class ``name`` ("KvStore.Spec" or "Spec"), replaced or not."""
    import tensorstore as ts

    return _OWN.get(name) or _classes(ts)[name].to_json


def probe_disagreement(probes=_PROBES) -> Optional[str]:
    """None if, for every ``(class name, JSON)`` of ``probes``, the spec built from it reads back
    through its ``repr`` as tensorstore's ``to_json()`` gives it; else why not (the probe named)."""
    import tensorstore as ts

    classes = _classes(ts)
    for name, json_spec in probes:
        try:
            spec = classes[name](json_spec)
            own = own_to_json(name)(spec)
            literal = _literal_to_json(lambda _spec: None)(spec)
        except Exception as exc:  # noqa: BLE001 - a probe this tensorstore refuses: not installable
            return f"{name} probe {json_spec!r} failed: {type(exc).__name__}: {exc}"
        if literal != own:
            return f"{name} probe {json_spec!r} reads back as {literal!r}, not {own!r}"
    return None


class _Replacement:
    """The replacement of ``to_json()``, put in place once by :meth:`install` (or refused once)."""

    def __init__(self, probes):
        self._probes = probes
        self._lock = threading.Lock()
        self._installed = False  # guarded by _lock
        self._refused: Optional[str] = None  # why it is not in place, once the probes said so

    def install(self) -> bool:
        with self._lock:
            if self._installed or self._refused is not None:
                return self._installed
            self._refused = probe_disagreement(self._probes)
            if self._refused is not None:
                log.warning("event=tensorstore_to_json_kept tensorstore=%s reason=%s; checkpoint writes keep "
                            "tensorstore's per-call leak", _version(), self._refused)
                return False
            import tensorstore as ts

            for name, cls in _classes(ts).items():
                _OWN[name] = cls.to_json
                cls.to_json = _literal_to_json(cls.to_json)
            self._installed = True
            return True


def _version() -> str:
    try:
        return importlib.metadata.version("tensorstore")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


_REPLACEMENT = _Replacement(_PROBES)


def install() -> bool:
    """Replaces ``to_json()`` of tensorstore's ``KvStore.Spec`` and ``Spec`` with the leak-free
    reading of their ``repr``, once per process. True if in place; False where a probe spec does
    not read back that way (:func:`probe_disagreement`): tensorstore stays as it is, one WARNING
    ``event=tensorstore_to_json_kept`` is logged, and later calls return False at once."""
    return _REPLACEMENT.install()
