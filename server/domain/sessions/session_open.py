"""Opening a new session on its shards and in the catalog, all or nothing (the coordinator calls
these outside its ``_membership`` lock: the shards compile the session's step meanwhile)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Mapping, Optional

from optserve.server.domain.config import SessionConfig
from optserve.server.domain.errors import FailedPrecondition, Unavailable
from optserve.server.domain.sessions.ports import SessionCatalog, ShardFleet
from optserve.server.domain.sessions.session_records import SessionRecord

log = logging.getLogger(__name__)


def with_replicas(config: SessionConfig, replicated: bool) -> SessionConfig:
    """``config`` with the copies it is kept in: the server's (2 where its shards have hot
    standbys, ``replicated``) unless it asks for its own.

    Raises:
      FailedPrecondition: it asks for 2 on a server without standbys (naming ``--replicas``).
    """
    if config.replicas == 2 and not replicated:
        raise FailedPrecondition(f"session {config.name!r} asks for replicas=2, but this server keeps one copy of "
                                 f"each session (it runs with --replicas 1): ask for replicas=1, or use a server "
                                 f"started with --replicas 2")
    if config.replicas is None:
        return dataclasses.replace(config, replicas=2 if replicated else 1)
    return config


def open_on_shards(fleet: "ShardFleet", catalog: Optional["SessionCatalog"], record: SessionRecord,
                   memory_left: Mapping[int, int]) -> list[int]:
    """Opens the session on its shards (each with ``memory_left`` of its budget beyond the
    part's estimate), and on their standbys (``replicas`` 2), and saves it in ``catalog``
    (durable servers); if any fails, closes what was opened and removes the entry before raising.
    Returns the shards that had no standby to take their part (see :func:`catch_up_missed`).

    Raises:
      Unavailable: the catalog's disk refused the entry; or what a shard raised.
    """
    name = record.config.name
    try:
        openings = record.openings(fleet.clock_addresses, memory_left)
        fleet.open_session(openings)
        missing = []
        if record.config.replicas == 2:  # each part's standby holds it too, from its initial values on
            missing = fleet.start_standbys(name, openings)
        if catalog is not None:
            try:
                catalog.save(name, record.to_json())
            except OSError as exc:
                raise Unavailable(f"session {name!r}: {exc.strerror}; nothing was created, retry once the disk "
                                  f"takes writes again") from None
    except BaseException:
        undo_open(fleet, catalog, name)
        raise
    return missing


def catch_up_missed(fleet: "ShardFleet", record: SessionRecord, missing: list[int]) -> None:
    """A new live session whose parts on shards ``missing`` found no standby when it opened (a
    fresh one was being started): those that have one now get it. (A fresh standby's catching up
    takes the live sessions; this one may have gone live after it looked. Taken by both, the
    second start finds the part held and does nothing.)"""
    for index in missing:
        if fleet.has_standby(index):
            try:
                fleet.start_standbys(record.config.name, record.openings(fleet.clock_addresses), only=index)
            except Exception as exc:  # noqa: BLE001 - held already (AlreadyExists), or that part awaits the next
                log.info("event=standby_catch_up_skipped session=%s shard=%d why=%s", record.config.name, index, exc)


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
