"""Test helpers over a durable session's files (storage layer), for tests that write a step log
without a shard session around it."""

from __future__ import annotations

from typing import Callable, Optional


def log_step(log, record, grads: list, release: Optional[Callable[[], None]] = None) -> None:
    """Logs one step whose update already ran: its gradient (``grads``, in tensor order), then
    its ``record`` (a ``StepRecord``), as a shard session does around an update."""
    log.begin_step(grads)
    log.end_step(record, release)
