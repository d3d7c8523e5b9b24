"""A daemon thread that runs one check on a period, surviving a check that fails."""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)


class Periodic:
    """Calls :meth:`check_once` every ``period_s`` seconds on a daemon thread named ``name``
    from :meth:`start` until :meth:`stop`; a check that raises is logged as ``event=<failure_event>``
    and the next one runs on time."""

    failure_event = "periodic_check_failed"

    def __init__(self, name: str, period_s: float):
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def check_once(self):
        raise NotImplementedError

    def start(self):
        """Starts the thread; returns self."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Ends the thread (waits up to 10 s for a check in progress)."""
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            try:
                self.check_once()
            except Exception:  # noqa: BLE001 - the thread must outlive one failed check
                log.exception("event=%s", self.failure_event)
