"""The processes of a session a command was started as the leader of (``start_new_session=True``):
a server, its embedded Ray and the Ray workers (shard actors) Ray started for it. Ray puts its
workers in process groups of their own, so a process group kill misses them; they stay in the
leader's session. Other servers on the machine, in sessions of their own, are never touched."""

from __future__ import annotations

import os
import signal
import time
from typing import Callable


def session_pids(leader: int) -> list[int]:
    """Every live (not zombie) process of the session whose leader is ``leader``, ascending."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == leader and fields[0] != "Z":
            found.append(int(entry))
    return sorted(found)


def titled(pids: list[int], prefix: bytes) -> list[int]:
    """Those of ``pids`` whose process title (first word of the command line) starts with ``prefix``."""
    matching = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                title = fh.read().split(b"\0")[0]
        except OSError:
            continue
        if title.startswith(prefix):
            matching.append(pid)
    return matching


def kill_session(leader: int, wait_s: float = 15.0) -> None:
    """SIGKILL of every live process of the session (the leader among them while it lives)."""
    kill_until_gone(lambda: session_pids(leader), wait_s)


def kill_until_gone(live: Callable[[], list[int]], wait_s: float) -> None:
    """SIGKILL of every process ``live()`` lists, again for any still listed (a process dies a
    moment after its signal; one may have been starting), until none is or ``wait_s`` has passed."""
    deadline = time.monotonic() + wait_s
    while (pids := live()) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for signal ``sig`` (``SigCgt`` in /proc): one that has
    not would be ended by it (SIGUSR1, SIGUSR2)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            caught = next(line.split()[1] for line in fh if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(caught, 16) >> (sig - 1) & 1)


def ask_for_stacks(pids: list[int], wait_s: float = 2.0) -> None:
    """SIGUSR1 to each of ``pids`` that catches it (``optserve serve`` and its shard actors then
    print every thread's stack; one that has not registered the dump yet is spared: the signal
    would end it), then ``wait_s`` for the dumps to be written."""
    for pid in pids:
        if not catches(pid, signal.SIGUSR1):
            continue
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(wait_s)
