"""Callbacks run at their deadlines by one shared daemon thread.

A step's watchdog (cancel the call if the step is not done within the client's timeout) is
almost always cancelled a few milliseconds after it is set; a ``threading.Timer`` per step would
start and end a thread every step. Here every watchdog of the process waits in one heap served by
one thread, started on first use.
"""

from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
from typing import Callable, Optional


class Deadline:
    """A scheduled callback; :meth:`cancel` before it runs keeps it from running."""

    __slots__ = ("at", "fn", "cancelled")

    def __init__(self, at: float, fn: Callable[[], None]):
        self.at, self.fn, self.cancelled = at, fn, False

    def cancel(self) -> None:
        """Marks it cancelled and lets go of its callback (and what that holds: a cancelled entry
        may wait in the heap until its time, and a step's call holds its connection open)."""
        self.cancelled = True
        self.fn = _nothing


def _nothing() -> None:
    pass


class Deadlines:
    """One thread running each callback ``delay_s`` after it was scheduled (monotonic clock)."""

    def __init__(self):
        self._reset()
        if hasattr(os, "register_at_fork"):  # a forked child has no thread: it starts its own
            os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._heap: list = []  # (at, order, Deadline)
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._cancelled = 0  # cancelled entries still in the heap (dropped when they are many)

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> Deadline:
        deadline = Deadline(time.monotonic() + delay_s, fn)
        with self._cond:
            heapq.heappush(self._heap, (deadline.at, next(self._order), deadline))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="optserve-deadlines", daemon=True)
                self._thread.start()
            if self._heap[0][2] is deadline:  # sooner than what the thread waits for
                self._cond.notify()
        return deadline

    def _compact(self) -> None:
        """Drops cancelled entries once they are most of the heap (lock held)."""
        self._cancelled += 1
        if self._cancelled > 64 and self._cancelled * 2 > len(self._heap):
            self._heap = [entry for entry in self._heap if not entry[2].cancelled]
            heapq.heapify(self._heap)
            self._cancelled = 0

    def cancel(self, deadline: Deadline) -> None:
        """Keeps ``deadline`` from running (if it has not run yet)."""
        with self._cond:
            if not deadline.cancelled:
                deadline.cancel()
                self._compact()

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    while self._heap and self._heap[0][2].cancelled:
                        heapq.heappop(self._heap)
                        self._cancelled = max(0, self._cancelled - 1)
                    if not self._heap:
                        self._cond.wait()
                        continue
                    wait = self._heap[0][0] - time.monotonic()
                    if wait <= 0:
                        _, _, due = heapq.heappop(self._heap)
                        due.cancelled = True  # ran: a later cancel() is a no-op
                        break
                    self._cond.wait(wait)
            try:
                due.fn()
            except BaseException:  # noqa: BLE001 - one failing callback must not stop the others
                pass


DEADLINES = Deadlines()  # the process's watchdogs
