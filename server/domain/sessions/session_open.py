"""Opening a new session on its shards and in the catalog, all or nothing (the coordinator calls
these outside its ``_membership`` lock: the shards compile the session's step meanwhile)."""

from __future__ import annotations

import logging
from typing import Mapping, Optional

from optserve.server.domain.errors import Unavailable
from optserve.server.domain.sessions.ports import SessionCatalog, ShardFleet
from optserve.server.domain.sessions.session_records import SessionRecord

log = logging.getLogger(__name__)


def open_on_shards(fleet: "ShardFleet", catalog: Optional["SessionCatalog"], record: SessionRecord,
                   memory_left: Mapping[int, int]) -> None:
    """Opens the session on its shards (each with ``memory_left`` of its budget beyond the
    part's estimate), and on their standbys (``--replicas 2``), and saves it in ``catalog``
    (durable servers); if any fails, closes what was opened and removes the entry before raising.

    Raises:
      Unavailable: the catalog's disk refused the entry; or what a shard raised.
    """
    name = record.config.name
    try:
        openings = record.openings(fleet.clock_addresses, memory_left)
        fleet.open_session(openings)
        if fleet.replicated:  # each part's standby holds it too, from its initial values on
            fleet.start_standbys(name, openings)
        if catalog is not None:
            try:
                catalog.save(name, record.to_json())
            except OSError as exc:
                raise Unavailable(f"session {name!r}: {exc.strerror}; nothing was created, retry once the disk "
                                  f"takes writes again") from None
    except BaseException:
        undo_open(fleet, catalog, name)
        raise


def undo_open(fleet: "ShardFleet", catalog: Optional["SessionCatalog"], name: str) -> None:
    """Closes what the shards opened of a new session and removes its catalog entry."""
    try:
        fleet.close_session(name)
    finally:  # also when a shard failed to close it: the entry must not bring the session back at start
        if catalog is not None:
            try:
                catalog.remove(name)
            except OSError:  # the disk that refused the entry: the next start sets the folder aside
                log.exception("event=catalog_remove_failed session=%s", name)
