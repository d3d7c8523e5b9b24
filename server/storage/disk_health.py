"""Whether a step log's disk takes writes: the degraded state a failed write leaves, and the probe
that tells when it takes writes again."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from typing import Optional

log = logging.getLogger(__name__)

def storage_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the file system refusing (no space, an I/O error, a read-only disk):
    an ``OSError``, or tensorstore's error as orbax raises it: carrying an ``os_error_code``, or
    ``RESOURCE_EXHAUSTED`` (tensorstore's word for a full disk). An expected condition on a server
    with a disk: logged as one line, not a traceback."""
    text = str(exc)
    return isinstance(exc, OSError) or "os_error_code" in text or text.startswith("RESOURCE_EXHAUSTED: ")


def error_line(exc: BaseException) -> str:
    """``Type: message``, its first line, without the ``[tensorstore_spec=...]`` tensorstore appends."""
    text = f"{type(exc).__name__}: {exc}"
    line = text.splitlines()[0] if text else ""
    return line.split(" [tensorstore_spec=", 1)[0]


def log_write_failure(logger: logging.Logger, event: str, exc: BaseException, **fields) -> None:
    """Logs a failed write: one ERROR line naming the error for the disk's own refusals
    (:func:`storage_error`), the traceback for anything else (a defect)."""
    text = "".join(f" {key}={value}" for key, value in fields.items())
    if storage_error(exc):
        logger.error("event=%s%s error=%s", event, text, error_line(exc))
    else:
        logger.error("event=%s%s", event, text, exc_info=exc)


def _expected(exc: Optional[BaseException]) -> bool:
    """The disk refusing, a damaged file read back (tensorstore's ``DATA_LOSS``), or an event loop
    closed under a writer (an orbax operation that failed, or the process shutting down)."""
    return exc is not None and (storage_error(exc) or str(exc).startswith("DATA_LOSS: ") or _closed_loop(exc))


def _closed_loop(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and "Event loop is closed" in str(exc)


class _OneLine(logging.Filter):
    """Keeps a library's record of an expected storage error to one line, without traceback: its
    message's first line, and the error's when the line does not name it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and _expected(record.exc_info[1]):
            message = record.getMessage()
            line = message.splitlines()[0].split(" [tensorstore_spec=", 1)[0] if message else ""
            error = error_line(record.exc_info[1])
            record.msg = line if error.split(": ", 1)[-1][:40] in line else f"{line}: {error}"
            record.args, record.exc_info, record.exc_text = None, None, None
        return True


def _one_line_unraisable(previous):
    """A ``sys.unraisablehook`` that logs an expected storage error one line, and hands anything
    else to ``previous``. tensorstore reports an exception raised in a future's callback there: an
    orbax operation's callback that finds its event loop closed (the operation failed, or the
    process is shutting down) printed a traceback each."""

    def hook(unraisable) -> None:
        exc = unraisable.exc_value
        if _expected(exc):
            level = logging.INFO if _closed_loop(exc) else logging.WARNING
            log.log(level, "event=storage_callback_failed error=%s", json.dumps(error_line(exc)))
        else:
            previous(unraisable)
    return hook


def quiet_expected_thread_errors() -> None:
    """Makes the storage libraries' own reports of expected errors one line each, once per process:
    orbax's records on the ``absl`` logger and asyncio's records of a future's unretrieved error
    (the disk refusing, a damaged file, an event loop closed while the process shuts down) came
    with a traceback, and tensorstore's callbacks that found their event loop closed printed one
    each (``sys.unraisablehook``). The call that started a write raises the disk's error to its
    caller too, which logs and reports it."""
    global _hook_installed
    with _hook_lock:
        if not _hook_installed:
            for library in ("absl", "asyncio"):
                logging.getLogger(library).addFilter(_OneLine())
            sys.unraisablehook = _one_line_unraisable(sys.unraisablehook)
            _hook_installed = True


_hook_lock = threading.Lock()
_hook_installed = False

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
