"""Whether a step log's disk takes writes: the degraded state a failed write leaves, and the probe
that tells when it takes writes again."""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

PROBE_NAME = ".write-probe"  # the file a failed log writes, fsyncs and deletes to see the disk work again
_PROBE_BYTES = b"\0" * 4096


class DiskHealth:
    """The health of the disk under one step log's folder.

    Args:
      folder: the log's folder (where the probe writes).
      session / shard: names for log lines.

    Attributes:
      degraded: why the log cannot take a step now (``"disk: <cause> (<folder>)"``; "": it can).
    """

    def __init__(self, folder: str, session: str, shard: int):
        self.folder, self._session, self._shard = folder, session, shard
        self.degraded = ""
        self._probe_lock = threading.Lock()  # concurrent pushes probe the disk one after another

    def degrade(self, exc: BaseException) -> None:
        """Marks the log degraded by ``exc`` (logged once per episode, not at every refused retry)."""
        cause = getattr(exc, "strerror", None) or exc
        if not self.degraded:
            log.error("event=step_log_degraded session=%s shard=%d folder=%s error=%s", self._session,
                      self._shard, self.folder, cause)
        self.degraded = f"disk: {cause} ({self.folder})"

    def probe(self) -> None:
        """Checks that the disk takes a write again (written, fsynced, deleted; one probe at a time).

        Raises:
          OSError: it does not; the message names the folder and the cause (the log stays degraded).
        """
        path = os.path.join(self.folder, PROBE_NAME)
        try:
            with self._probe_lock:
                fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
                try:
                    os.write(fd, _PROBE_BYTES)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.unlink(path)
        except OSError as exc:
            self.degrade(exc)
            raise OSError(exc.errno, f"the step log in {self.folder} cannot be written: "
                                     f"{exc.strerror or exc}") from None
