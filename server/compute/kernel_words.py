"""Kernel failures in words: which tensors an optimizer cannot handle, and an exception on one line
(for refusals and status)."""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

import numpy as np

_NAMED_TENSORS = 8  # a message names at most this many tensors (then "and N more")


def tensors_in_words(specs: Mapping[str, tuple], failing: list[str]) -> str:
    """``tensor 'w' (shape [2, 3], float32)`` / ``tensors ...`` for the names in ``failing``, or
    ``the tensors ... together`` for all of ``specs`` (name -> (shape, dtype)) when ``failing``
    is empty; at most :data:`_NAMED_TENSORS` named (then ``and N more``)."""

    def describe(names: list[str]) -> str:
        shown = ", ".join(f"{n!r} (shape {list(specs[n][0])}, {np.dtype(specs[n][1]).name})"
                          for n in names[:_NAMED_TENSORS])
        return shown if len(names) <= _NAMED_TENSORS else f"{shown} and {len(names) - _NAMED_TENSORS} more"

    if not failing:
        return f"the tensors {describe(list(specs))} together"
    return f"tensor{'s' if len(failing) > 1 else ''} {describe(failing)}"


def failing_alone(params: Mapping[str, Any], trace: Callable[[dict], Any]) -> str:
    """The tensors of ``params`` for which ``trace({name: tensor})`` raises, in words (all of them
    together when none fails alone: the kernel fails on their combination)."""
    failing = []
    for name, value in params.items():
        try:
            trace({name: value})
        except Exception:  # noqa: BLE001 - a tensor the kernel cannot handle
            failing.append(name)
    return tensors_in_words(specs_of(params), failing)


def specs_of(params: Mapping[str, Any]) -> dict[str, tuple]:
    """name -> (shape, dtype) of arrays or ``jax.ShapeDtypeStruct``s."""
    return {name: (tuple(np.shape(p)), _dtype(p)) for name, p in params.items()}


_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")  # terminal control sequences (colours) some errors carry


def error_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` of ``exc`` on one line of at most ``limit`` characters (for a status): a
    traceback inside the message (an XLA error carrying a host callback's) is cut to its last line,
    terminal colour codes are dropped."""
    head, traceback, trace = _ANSI.sub("", str(exc)).strip().partition("Traceback (most recent call last)")
    lines = head.strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}".strip().rstrip(":")
    if traceback:
        last = next((line.strip() for line in reversed(trace.splitlines()) if line.strip()), "")
        text = f"{text}: {last}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _dtype(value):
    return value.dtype if hasattr(value, "dtype") else np.asarray(value).dtype
