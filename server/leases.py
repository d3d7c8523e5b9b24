"""Idle sessions end: a daemon thread that closes sessions idle past ``--session-idle-s``.

The policy (what counts as activity, which sessions are idle) is the coordinator's
(:meth:`~optserve.server.domain.coordinator.Coordinator.expire_idle`); this host only runs it
on a period of a quarter of the lease (at most one second), so a session is closed at most that
much later than its lease ends.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)


class SessionLeases:
    """Runs ``coordinator.expire_idle(idle_s)`` periodically (see the module docstring)."""

    def __init__(self, coordinator, idle_s: float):
        self._coordinator = coordinator
        self.idle_s = idle_s
        self._period_s = min(1.0, idle_s / 4)
        self._stop = threading.Event()
        self.expired = 0  # sessions closed so far
        self._thread = threading.Thread(target=self._run, name="optserve-session-leases", daemon=True)

    def start(self) -> "SessionLeases":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            try:
                self.expired += len(self._coordinator.expire_idle(self.idle_s))
            except Exception:  # noqa: BLE001 - the lease keeper must outlive one failed check
                log.exception("event=session_lease_check_failed")
