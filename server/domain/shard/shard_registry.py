"""The sessions one shard holds, by name."""

from __future__ import annotations

import threading
from typing import Generic, Optional, TypeVar

from optserve.server.domain.errors import NotFound, PermissionDenied, Unavailable

# a shard_session.ShardSession: the registry reads its ``config.name``, ``owner`` and ``last_activity_unix_s``
ShardSession = TypeVar("ShardSession")


class ShardRegistry(Generic[ShardSession]):
    """The sessions one shard holds, by name (thread-safe).

    Args:
      recovering: sessions are being restored: a name not (yet) held may come back, so asking for
        it is Unavailable (retry) rather than NotFound. The shard clears it once restored.
    """

    def __init__(self, recovering: bool = False):
        self._sessions: dict[str, ShardSession] = {}
        self._lock = threading.Lock()
        self.recovering = recovering  # sessions are being restored: an unknown name may come back

    def add(self, session: ShardSession) -> None:
        with self._lock:
            self._sessions[session.config.name] = session

    def remove(self, name: str) -> bool:
        with self._lock:
            return self._sessions.pop(name, None) is not None

    def get(self, name: str, tenant: Optional[str] = None) -> ShardSession:
        """The session, if tenant ``tenant`` owns it (None: a caller inside the server, unchecked)."""
        with self._lock:
            session = self._sessions.get(name)
        if session is None:
            if self.recovering:
                raise Unavailable(f"session {name!r}: this shard is restoring its sessions; retry")
            raise NotFound(f"session {name!r} not found on this shard")
        if tenant is not None and session.owner != tenant:
            raise PermissionDenied(f"session {name!r} belongs to another tenant")
        return session

    def find(self, name: str) -> Optional[ShardSession]:
        """The session, or None (callers inside the server)."""
        with self._lock:
            return self._sessions.get(name)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._sessions)

    def sessions(self) -> list[ShardSession]:
        with self._lock:
            return list(self._sessions.values())

    def activity(self) -> dict[str, float]:
        """Session name -> its last activity on this shard (unix seconds, see ``ShardSession.touch``)."""
        with self._lock:
            return {name: session.last_activity_unix_s for name, session in self._sessions.items()}
