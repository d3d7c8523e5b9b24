"""Structured log lines: one ``event=NAME key=value ...`` line per event (sessions, refusals, errors).

Values are written as they are when plain (letters, digits, ``-_.:/@+``), else JSON-quoted, so a
line splits on spaces and ``=`` whatever a session or client is named. Callers pass names,
counts and reasons only: never a tensor's values, never a token.
"""

from __future__ import annotations

import json
import logging


def field(value) -> str:
    """One ``key=value`` field's value (see the module docstring)."""
    text = str(value)
    if text and all(c.isalnum() or c in "-_.:/@+" for c in text):
        return text
    return json.dumps(text)


def log_event(logger: logging.Logger, level: int, event: str, /, exc_info=None, **fields) -> None:
    """Logs ``event=<event> k=v ...`` (fields in the order given; None values left out)."""
    if not logger.isEnabledFor(level):
        return
    text = " ".join(f"{key}={field(value)}" for key, value in fields.items() if value is not None)
    logger.log(level, "event=%s%s", event, f" {text}" if text else "", exc_info=exc_info)
