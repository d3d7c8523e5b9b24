"""The session catalog: which sessions a durable server holds (one ``session.json`` each)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

from optserve.server.storage.files import session_dir, write_atomically
from optserve.server.storage.format import FORMAT_KEY, FORMAT_VERSION, UnsupportedFormat, format_of

log = logging.getLogger(__name__)


class SessionCatalog:
    """The sessions a durable server holds: one ``session.json`` each (written at creation,
    removed first at close, so a half-deleted session is never restored)."""

    def __init__(self, root: str):
        self.root = root
        os.makedirs(os.path.join(root, "sessions"), exist_ok=True)

    def save(self, name: str, entry: dict) -> None:
        """Saves session ``name``'s entry (its definition and shard map) in the current format.

        Raises:
          OSError: the disk refused the write; the message names the folder and the cause.
        """
        folder = session_dir(self.root, name)
        try:
            os.makedirs(folder, exist_ok=True)
            write_atomically(os.path.join(folder, "session.json"),
                             json.dumps({**entry, FORMAT_KEY: FORMAT_VERSION}).encode())
        except OSError as exc:
            raise OSError(exc.errno, f"the session catalog in {folder} cannot be written: "
                                     f"{exc.strerror or exc}") from None

    def _set_aside(self, folder: str) -> None:
        target = os.path.join(self.root, "orphaned", f"{os.path.basename(folder)}-{int(time.time())}")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.replace(folder, target)
        log.error("event=session_files_set_aside folder=%s moved_to=%s reason=no_session_json", folder, target)

    def remove(self, name: str) -> None:
        """Forgets session ``name`` and deletes its files (the entry first)."""
        folder = session_dir(self.root, name)
        try:
            os.unlink(os.path.join(folder, "session.json"))
        except FileNotFoundError:
            pass
        shutil.rmtree(folder, ignore_errors=True)

    def entries(self) -> list[dict]:
        """Every saved session's entry, without the format key (unreadable ones are logged and
        skipped). A session folder without its entry (``session.json`` deleted, or a close cut
        short) is moved to ``DIR/orphaned/`` and logged (``event=session_files_set_aside``): its
        checkpoints and logs are kept for inspection, never restored nor mixed into a new
        session of the same name.

        Raises:
          UnsupportedFormat: an entry was written by a newer optserve (nothing is restored: a
            server that skipped it could later reuse the name and delete its files).
        """
        out = []
        base = os.path.join(self.root, "sessions")
        for folder in sorted(os.listdir(base)):
            path = os.path.join(base, folder, "session.json")
            if not os.path.exists(path):
                self._set_aside(os.path.join(base, folder))
                continue
            try:
                with open(path, "rb") as fh:
                    entry = json.loads(fh.read())
                format_of(path, entry)
            except UnsupportedFormat:
                raise
            except (OSError, ValueError, AttributeError) as exc:
                log.error("event=catalog_entry_unreadable path=%s error=%s", path, exc)
                continue
            entry.pop(FORMAT_KEY, None)
            out.append(entry)
        return out
