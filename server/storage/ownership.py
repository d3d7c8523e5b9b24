"""Who owns shard ``i``'s files: an epoch per shard index, so a shard the server replaced while
it was cut off can never write a session's files again (fencing).

The server (the one process holding the checkpoint folder's lock) *claims* shard ``i`` before it
starts an actor for it (:func:`claim_shard`): it raises the epoch in ``DIR/owners/shard-<i>.json``
and hands the new epoch to that actor. The actor checks its epoch against the file where it
writes (:meth:`ShardFence.check`: before a log record, after it is flushed and before the step is
acknowledged, before a journal line, a checkpoint's commit and a deletion) and every
``period_s`` while idle (:meth:`ShardFence.watch`). A shard whose epoch is no longer the file's is
*superseded*: its replacement exists (and may be restoring from the same files), so it must stop
at once; the shard actor exits its process (``event=shard_fenced``).

The check reads the file each time (an open, a read of a few bytes): on NFS, opening a file
revalidates it (close-to-open consistency), so a claim made on another machine is seen by the
next check there without attribute-cache delay. A check that cannot read the file (the storage
itself is unreachable) raises ``OSError``: the write it guards would have failed too.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Callable, Optional

from optserve.server.storage.files import write_atomically

log = logging.getLogger(__name__)

OWNERS = "owners"


class Superseded(OSError):
    """This shard's ownership epoch is no longer the current one: it was replaced."""


def owner_path(root: str, index: int) -> str:
    """Shard ``index``'s ownership file under the checkpoint folder ``root``."""
    return os.path.join(root, OWNERS, f"shard-{index}.json")


def current_epoch(root: str, index: int) -> int:
    """Shard ``index``'s current ownership epoch (0: never claimed)."""
    try:
        with open(owner_path(root, index), "rb") as fh:
            return int(json.loads(fh.read())["epoch"])
    except FileNotFoundError:
        return 0


def claim_shard(root: str, index: int) -> int:
    """Raises shard ``index``'s epoch (durably, before returning) and returns the new one: from
    now on only an actor given this epoch may write the shard's files. The caller holds the
    folder's lock (one server claims at a time)."""
    os.makedirs(os.path.join(root, OWNERS), exist_ok=True)
    epoch = current_epoch(root, index) + 1
    record = {"epoch": epoch, "claimed_unix_s": time.time(), "host": socket.gethostname(), "pid": os.getpid()}
    write_atomically(owner_path(root, index), (json.dumps(record, sort_keys=True) + "\n").encode())
    log.info("event=shard_claimed shard=%d epoch=%d", index, epoch)
    return epoch


def _raise(message: str) -> None:
    raise Superseded(message)


class ShardFence:
    """A shard's check that it still owns its files (see the module docstring).

    Args:
      root: the checkpoint folder.
      index: the shard.
      epoch: the epoch :func:`claim_shard` gave this shard.
      on_superseded: called with a message naming both epochs once the shard is found replaced;
        it must not return normally (the default raises :class:`Superseded`; the shard actor
        exits its process).
    """

    def __init__(self, root: str, index: int, epoch: int, on_superseded: Callable[[str], None] = _raise):
        self.root, self.index, self.epoch = root, index, epoch
        self._on_superseded = on_superseded
        self._watch: Optional[threading.Thread] = None

    def check(self, before: str) -> None:
        """Returns if this shard still owns its files; ``before``: what the caller is about to
        do (for the message).

        Raises:
          Superseded: (default ``on_superseded``) a newer epoch was claimed.
          OSError: the ownership file cannot be read.
        """
        current = current_epoch(self.root, self.index)
        if current != self.epoch:
            self._on_superseded(f"shard {self.index} was replaced (ownership epoch {current}, this process holds "
                                f"{self.epoch}) before {before}: it no longer writes {self.root}")
            raise Superseded("on_superseded returned")  # never reached with a conforming callback

    def watch(self, period_s: float = 0.5) -> None:
        """Checks every ``period_s`` in a daemon thread, so an idle superseded shard stops too
        (a failed read is retried: the storage may come back)."""
        def loop():
            while True:
                time.sleep(period_s)
                try:
                    self.check("its periodic ownership check")
                except Superseded:
                    return
                except OSError:
                    continue

        self._watch = threading.Thread(target=loop, name="optserve-fence", daemon=True)
        self._watch.start()
