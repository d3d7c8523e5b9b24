"""What a session object knows of its session's version: the latest one its calls were answered
with, corrected when the server says it is lower (a restore rolled back a version only pulled)."""

from __future__ import annotations

import threading


class VersionView:
    """The session's version as one session object saw it (thread-safe).

    Answers to pushes only raise it (calls on several threads may be answered out of order). A
    pull's answer is the server's word and may lower it, unless another call was answered while
    the pull ran (that answer is the newer one): :meth:`mark` before the pull, :meth:`settle` after.
    """

    def __init__(self, version: int):
        self._lock = threading.Lock()
        self._value = version
        self._answers = 0  # calls answered so far (a pull's settle sees whether any came meanwhile)

    @property
    def value(self) -> int:
        return self._value

    def see(self, version: int) -> None:
        """A push's answer: the session reached ``version``."""
        with self._lock:
            self._value = max(self._value, version)
            self._answers += 1

    def set(self, version: int) -> None:
        """The server said the session is at ``version`` (e.g. a refusal carrying it)."""
        with self._lock:
            self._value = version
            self._answers += 1

    def mark(self) -> int:
        """Before a pull: what :meth:`settle` compares against."""
        with self._lock:
            return self._answers

    def settle(self, version: int, mark: int) -> None:
        """A pull's answer: taken as is when no call was answered since ``mark``, else only raises."""
        with self._lock:
            self._value = version if self._answers == mark else max(self._value, version)
            self._answers += 1
