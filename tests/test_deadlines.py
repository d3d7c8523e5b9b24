"""The client's shared watchdog thread: callbacks run at their deadlines, in order; cancelled
ones never run; the heap does not keep every cancelled watchdog."""

from __future__ import annotations

import threading
import time

from optserve.client._deadlines import Deadlines


def test_callbacks_run_in_deadline_order_on_one_thread_and_cancelled_ones_never():
    threads_before = threading.active_count()  # other tests' servers keep their pools' threads
    deadlines = Deadlines()
    ran: list = []
    done = threading.Event()
    deadlines.call_later(0.20, lambda: (ran.append(("late", threading.current_thread().name)), done.set()))
    deadlines.call_later(0.05, lambda: ran.append(("early", threading.current_thread().name)))
    cancelled = deadlines.call_later(0.10, lambda: ran.append(("cancelled", "")))
    deadlines.cancel(cancelled)
    assert done.wait(5)
    assert [what for what, _ in ran] == ["early", "late"]
    assert {thread for _, thread in ran} == {"optserve-deadlines"}
    assert threading.active_count() <= threads_before + 1  # the one watchdog thread, not one per callback


def test_a_sooner_deadline_wakes_the_thread_waiting_for_a_later_one():
    deadlines = Deadlines()
    deadlines.call_later(60.0, lambda: None)
    time.sleep(0.05)  # the thread now waits for the 60 s one
    fired = threading.Event()
    started = time.monotonic()
    deadlines.call_later(0.05, fired.set)
    assert fired.wait(5) and time.monotonic() - started < 2


def test_cancelled_watchdogs_do_not_pile_up():
    deadlines = Deadlines()
    for _ in range(10_000):  # a step's watchdog: set, then cancelled when the step is answered
        deadlines.cancel(deadlines.call_later(120.0, lambda: None))
    assert len(deadlines._heap) < 200


_FORK_CHECK = """
import os, threading
from optserve.client._deadlines import DEADLINES
DEADLINES.cancel(DEADLINES.call_later(60.0, lambda: None))  # the parent's thread is running
pid = os.fork()
if pid == 0:
    done = threading.Event()
    DEADLINES.call_later(0.05, done.set)
    os._exit(0 if done.wait(10) else 1)
_, status = os.waitpid(pid, 0)
raise SystemExit(os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_runs_its_own_watchdogs():
    # in a fresh interpreter: this one runs JAX's and Ray's threads, which a fork must not copy
    import subprocess
    import sys

    assert subprocess.run([sys.executable, "-c", _FORK_CHECK], timeout=60).returncode == 0


def test_a_cancelled_deadline_lets_go_of_what_its_callback_holds_at_once():
    """A step's watchdog holds the step's call (and through it the connection): cancelled, the
    entry may wait in the heap until its time, but without the callback."""
    import weakref

    class Held:
        def expire(self):
            pass

    deadlines = Deadlines()
    held = Held()
    alive = weakref.ref(held)
    deadline = deadlines.call_later(600.0, held.expire)
    del held
    assert alive() is not None  # the pending watchdog keeps it
    deadlines.cancel(deadline)
    assert alive() is None
