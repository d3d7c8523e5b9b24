"""Idle sessions end: a daemon thread that closes sessions idle past ``--session-idle-s``.

The policy (what counts as activity, which sessions are idle) is the coordinator's
(:meth:`~optserve.server.domain.sessions.coordinator.Coordinator.expire_idle`); this host only runs it
on a period of a quarter of the lease (at most one second), so a session is closed at most that
much later than its lease ends.
"""

from __future__ import annotations

from optserve.server.ops.periodic import Periodic


class SessionLeases(Periodic):
    """Runs ``coordinator.expire_idle(idle_s)`` periodically (see the module docstring)."""

    failure_event = "session_lease_check_failed"

    def __init__(self, coordinator, idle_s: float):
        super().__init__("optserve-session-leases", min(1.0, idle_s / 4))
        self._coordinator = coordinator
        self.idle_s = idle_s
        self.expired = 0  # sessions closed so far

    def check_once(self) -> list:
        """Closes the sessions idle past the lease now; returns their names."""
        expired = self._coordinator.expire_idle(self.idle_s)
        self.expired += len(expired)
        return expired
