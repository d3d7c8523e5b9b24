"""How far one shard's step log is written, and whether a write failed: what acknowledging a step
waits for (:class:`LoggedMark`)."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Optional


class LoggedMark:
    """The last version whose record is in the log, and the failed write (None: none) since the
    log was (re)started. Waited for in a thread (:meth:`wait`) or without one (:meth:`future`).

    Args:
      folder / shard: named in the OSError a wait raises after a failed write.
    """

    def __init__(self, folder: str, shard: int):
        self._folder, self._shard = folder, shard
        self._cond = threading.Condition()  # guards version / error / _awaited
        self.version = 0
        self.error: Optional[BaseException] = None
        self._awaited: list[tuple[int, concurrent.futures.Future]] = []  # futures not done yet

    def start(self, version: int) -> None:
        """The log opened after everything on disk (it reached ``version``)."""
        with self._cond:
            self.version = version

    def advance(self, version: int) -> None:
        """The record of ``version`` is written (and flushed per the policy)."""
        with self._cond:
            self.version = max(self.version, version)
            self._notify()

    def fail(self, exc: BaseException) -> None:
        """A write failed: every wait for a version not logged yet raises (see :meth:`wait`)."""
        with self._cond:
            self.error = exc
            self._notify()

    def recovered(self, version: Optional[int] = None) -> None:
        """The log takes records again (a checkpoint at ``version`` holds every applied step: the
        waits up to it end)."""
        with self._cond:
            self.error = None
            if version is not None:
                self.version = max(self.version, version)
                self._notify()

    def wait(self, version: int, consequence: str) -> None:
        """Returns once ``version`` is logged; raises OSError (naming the folder, the cause and
        ``consequence``) if a write failed first."""
        with self._cond:
            self._cond.wait_for(lambda: self.version >= version or self.error is not None)
            if self.version < version:
                raise self._unlogged(consequence)

    def future(self, version: int) -> concurrent.futures.Future:
        """A future done once ``version`` is logged (result None), or failed with the OSError
        :meth:`wait` raises for a step applied but not durable."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self.version >= version or self.error is not None:
                self._settle(version, future)
            else:
                self._awaited.append((version, future))
        return future

    def not_durable(self, version: int) -> str:
        return f"step {version} is applied on shard {self._shard} but not durable"

    def _notify(self) -> None:
        """The version or the error changed (lock held): waiters wake, futures settle."""
        self._cond.notify_all()
        if not self._awaited:
            return
        waiting = []
        for version, future in self._awaited:
            if self.version >= version or self.error is not None:
                self._settle(version, future)
            else:
                waiting.append((version, future))
        self._awaited = waiting

    def _settle(self, version: int, future: concurrent.futures.Future) -> None:
        if self.version >= version:
            future.set_result(None)
        else:
            future.set_exception(self._unlogged(self.not_durable(version)))

    def _unlogged(self, consequence: str) -> OSError:
        cause = getattr(self.error, "strerror", None) or self.error
        return OSError(f"the step log in {self._folder} could not be written ({cause}); {consequence}")
