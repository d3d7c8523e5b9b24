"""A long bench stopped by SIGTERM or SIGHUP (``kill``, ``timeout``, a closed terminal) tears down
what it built, as Ctrl-C does: the signal becomes ``SystemExit(128 + signal)`` in the main
thread, so the run's ``finally`` blocks unmount its disk rig, kill its worker processes and stop
its server tree instead of leaving them behind."""

from __future__ import annotations

import contextlib
import signal
from typing import Iterator

TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def exit_on_termination() -> Iterator[None]:
    """While inside, SIGTERM and SIGHUP raise ``SystemExit(128 + signum)`` in the main thread.

    After the first one both are ignored until the block is left, so a second signal (``kill``
    sent twice, a supervisor's repeat) cannot cut the teardown short. Call from the main thread."""

    def _exit(signum, _frame):
        for each in TERMINATING_SIGNALS:
            signal.signal(each, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    previous = {each: signal.signal(each, _exit) for each in TERMINATING_SIGNALS}
    try:
        yield
    finally:
        for each, handler in previous.items():
            signal.signal(each, handler)
