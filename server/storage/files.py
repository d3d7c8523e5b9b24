"""Where a durable session's files live, and writing a small file atomically.

One folder per session under ``DIR/sessions/`` (the name percent-quoted)::

    session.json                     the session's definition and shard map (the catalog entry)
    shard-<i>/checkpoint-<v>/        orbax checkpoint of shard i's part at version v:
                                     {"params": {name: array}, "opt_state": the optax state}
    shard-<i>/checkpoint-<v>.json    its manifest, written last (the commit marker): progress,
                                     clock state (home shard), CRC-32C of every array
    shard-<i>/steps-<k>.log          step log segment k (records after the checkpoint whose
                                     manifest names segment k, in order)
    shard-<i>/tickets-<k>.log        ticket journal segment k (home shard: one JSON line per ticket)
    shard-<i>/seals.json             segment k -> the version it starts after, written by a shard
                                     that took the log over (a restore; see step_log)

and, once per server folder, ``DIR/owners/shard-<i>.json``: shard i's ownership epoch (fencing,
see ownership).
"""

from __future__ import annotations

import os
import threading
import urllib.parse


def session_dir(root: str, name: str) -> str:
    """The folder of session ``name`` under the server's checkpoint folder ``root``."""
    return os.path.join(root, "sessions", urllib.parse.quote(name, safe=""))


def write_atomically(path: str, data: bytes) -> None:
    """Writes ``data`` to ``path`` through a temporary file, fsync and rename (never torn)."""
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def fsync_dir(path: str) -> None:
    """Flushes a folder's entries (a rename or a new file in it) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
