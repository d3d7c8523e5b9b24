"""What a process's open descriptors are: TCP connections from this process (the soak's crowd runs
its clients as threads here), connections their other end has closed and this one has not
(``CLOSE_WAIT``), other sockets, pipes, anonymous inodes (eventfd, epoll, timerfd), files. A
sampler uses it to tell descriptors a process holds of its own from the connections a crowd's
round opens and closes, and a descriptor leak from a round caught at its peak.

Reads ``/proc/<pid>/fd`` and the network namespace's ``/proc/net/tcp`` and ``/proc/net/tcp6``
(Linux only; elsewhere every census is empty).
"""

from __future__ import annotations

import collections
import os

CLOSE_WAIT = "08"  # /proc/net/tcp's state of a connection whose other end closed
KINDS = ("from_here", "close_wait", "socket", "pipe", "anon", "file")


def _tcp_table() -> dict[int, tuple[str, str, str]]:
    """Every TCP socket of this network namespace: inode -> (local end, remote end, state), as
    the kernel writes them (address and port in hex)."""
    table: dict[int, tuple[str, str, str]] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as fh:
                next(fh, None)  # the header
                for line in fh:
                    fields = line.split()
                    if len(fields) >= 10 and fields[9] != "0":
                        table[int(fields[9])] = (fields[1], fields[2], fields[3])
        except OSError:
            continue
    return table


def _targets(pid: int) -> list[str]:
    """What each of ``pid``'s descriptors points at (empty where the process is gone)."""
    folder = f"/proc/{pid}/fd"
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    targets = []
    for name in names:
        try:
            targets.append(os.readlink(os.path.join(folder, name)))
        except OSError:
            continue
    return targets


def _inode(target: str) -> int:
    return int(target[len("socket:["):-1])


def census(pids) -> dict[int, dict[str, int]]:
    """For each of ``pids`` its descriptors by kind (pid -> {kind: count}, the kinds of
    :data:`KINDS`; a process that is gone has none). ``from_here``: TCP connections whose other
    end is a socket of this process; ``close_wait``: TCP connections whose other end has closed
    (the process has not closed its own yet)."""
    table = _tcp_table()
    ours = {table[_inode(t)][:2] for t in _targets(os.getpid()) if t.startswith("socket:[") and _inode(t) in table}
    counts = {}
    for pid in pids:
        kinds: collections.Counter = collections.Counter()
        for target in _targets(pid):
            if target.startswith("socket:["):
                entry = table.get(_inode(target))
                if entry is not None and (entry[1], entry[0]) in ours:
                    kinds["from_here"] += 1
                elif entry is not None and entry[2] == CLOSE_WAIT:
                    kinds["close_wait"] += 1
                else:
                    kinds["socket"] += 1
            elif target.startswith("pipe:["):
                kinds["pipe"] += 1
            elif target.startswith("anon_inode:"):
                kinds["anon"] += 1
            else:
                kinds["file"] += 1
        counts[pid] = {kind: kinds[kind] for kind in KINDS}
    return counts
