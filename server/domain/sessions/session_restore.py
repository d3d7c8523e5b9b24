"""Durable servers: bringing a session back on all its shards at one version.

Each shard's part of a session can be restored up to the last version it logged (its checkpoint
plus its step log). The session is restored at the highest version *every* shard reaches; steps
one shard logged past it were never acknowledged by every shard, so they are rolled back (logged
as ``event=session_rolled_back``). A session that cannot be brought to one version (a damaged
file, a shard whose checkpoint is already past the common version, or one with no checkpoint
while the others have one) is lost, with a message that names the shard and the file.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Sequence

from optserve.server.domain.config import SessionConfig
from optserve.server.domain.errors import OptservError, SessionLost
from optserve.server.domain.events import log_event
from optserve.server.domain.sessions.ports import ShardFleet
from optserve.server.domain.sessions.session_records import SessionRecord

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RestoreOutcome:
    """How a restore ended.

    Attributes:
      why_lost: why the session is lost (None: every shard restored it).
      rolled_back_from: the highest version a shard had logged, when the common version is below
        it (0: nothing was rolled back).
    """

    why_lost: Optional[str] = None
    rolled_back_from: int = 0


def record_from_catalog(entry: dict, addresses: Sequence[str]) -> Optional[SessionRecord]:
    """The session a catalog entry defines, placed on the shards at ``addresses``; None (logged
    as ``event=session_lost``) when it needs more shards than the server has."""
    config = SessionConfig.from_json(entry["config"])
    placement = sorted((int(i), tuple(names)) for i, names in entry["placement"].items())
    if placement[-1][0] >= len(addresses):
        log.error("event=session_lost session=%s reason=needs_%d_shards shards=%d", config.name,
                  placement[-1][0] + 1, len(addresses))
        return None
    return SessionRecord.placed(config, placement, addresses, entry.get("owner", ""), entry.get("creator", ""))


def restore_consistently(fleet: "ShardFleet", record: SessionRecord) -> RestoreOutcome:
    """Restores a durable session on all its shards at the highest version every shard reaches
    exactly (:func:`common_version`); what lies past it on some shard is rolled back."""
    name = record.config.name
    openings = record.openings(fleet.clock_addresses)
    reaches = {}
    for opening in openings:
        try:
            reaches[opening.shard_index] = fleet.reachable(opening)
        except OptservError as exc:
            return RestoreOutcome(_why_lost(name, opening.shard_index, exc))
    common, logged, why = common_version(name, reaches)
    if why is not None:
        return RestoreOutcome(why)
    rolled_back_from = 0
    if logged > common:
        log_event(log, logging.WARNING, "session_rolled_back", session=name, version=common, logged=logged,
                  shards=",".join(f"{i}:{r[1]}" for i, r in sorted(reaches.items())))
        rolled_back_from = logged
    for opening in openings:
        try:
            fleet.restore_session(opening, upto=common)
        except OptservError as exc:
            return RestoreOutcome(_why_lost(name, opening.shard_index, exc), rolled_back_from)
    return RestoreOutcome(None, rolled_back_from)


def restore_recorded(fleet: "ShardFleet", table, record: SessionRecord) -> Optional[str]:
    """Restores a durable session on all its shards at one version (:func:`restore_consistently`),
    noting a roll-back in ``table`` (the coordinator's ``SessionTable``), then, on a server with
    hot standbys, starts its parts' standbys from the restored state (one created with replicas=2;
    older catalog entries have none); returns why it is lost, or None. A standby that cannot start
    leaves its part with one copy (logged) until its shard's next fresh standby."""
    outcome = restore_consistently(fleet, record)
    if outcome.rolled_back_from:
        table.rolled_back(record.config.name, outcome.rolled_back_from)
    if outcome.why_lost is None and fleet.replicated and record.config.replicas == 2:
        name = record.config.name
        try:
            fleet.start_standbys(name, record.openings(fleet.clock_addresses))
        except Exception as exc:  # noqa: BLE001 - restored with one copy, until its shard's next fresh standby
            log.error("event=standby_not_started session=%s error=%s", name, exc)
    return outcome.why_lost


def restore_shard(fleet: "ShardFleet", record: SessionRecord, shard_index: int) -> Optional[str]:
    """A restarted shard's part of a durable session: restores it (its checkpoint and all it
    logged), then points the session's other shards at the shard's new clock endpoint (it is the
    home shard) or tells the home shard its peer is back. Returns why the session is lost, or None."""
    name = record.config.name
    opening = next(o for o in record.openings(fleet.clock_addresses) if o.shard_index == shard_index)
    try:
        fleet.restore_session(opening)
    except OptservError as exc:
        return _why_lost(name, shard_index, exc)
    if record.home == shard_index:
        for a in record.assignments[1:]:
            fleet.set_home_clock(a.shard_index, name, fleet.clock_addresses[shard_index])
    else:
        fleet.peer_up(record.home, shard_index, [name])
    return None


def restore_restarted(fleet: "ShardFleet", table, restarted: Sequence[int], waiting: Sequence[int] = (),
                      only: Optional[set] = None) -> tuple[dict[str, str], dict[str, int], set[int]]:
    """Shards ``restarted``, started again together, restore their parts of their LIVE sessions
    (``table``: the coordinator's :class:`~.session_table.SessionTable`, whose records learn the
    shards' new addresses from ``fleet.addresses``); then each is told it is recovered. Returns
    ``(why each lost session is lost, the version each rolled-back session had logged, the
    restarted shards still holding back a session)``.

    A session with a shard still running restores each restarted part to all it logged (the live
    shards hold its state in memory) and points the peers at a moved home clock
    (:func:`restore_shard`). A session all of whose shards were restarted (a machine holding them
    all was lost) has no live part: it is restored as a whole server restores it, at the version
    every shard logged (:func:`restore_consistently`), so a step its clock decided that no shard
    logged, never acknowledged, is forgotten and its client's retry decided afresh. A session on
    a shard of ``waiting`` (dead, its restart failed) waits for it: it is restored once that shard
    is back (its restarted shards are not told they are recovered meanwhile: calls naming it are
    UNAVAILABLE there, retried). ``only``: these sessions only (None: all; a promoted standby
    serves the others already).
    """
    restarted, waiting = set(restarted), set(waiting)
    lost, rolled_back, pending = {}, {}, set()
    try:
        for name in sorted({n for i in restarted for names in table.live_on(i).values() for n in names
                            if only is None or n in only}):
            record = None
            for index in sorted(restarted):
                record = table.moved(name, index, fleet.addresses[index]) or record
            if record is None:
                continue
            held = {a.shard_index for a in record.assignments}
            if held & waiting:
                pending |= held & restarted
                continue
            if held <= restarted:
                outcome = restore_consistently(fleet, record)
                why = outcome.why_lost
                if outcome.rolled_back_from:
                    rolled_back[name] = outcome.rolled_back_from
            else:
                why = next(filter(None, (restore_shard(fleet, record, i) for i in sorted(held & restarted))), None)
            if why is not None:
                lost[name] = why
    finally:
        for index in sorted(restarted - pending):
            fleet.recovered(index)
    return lost, rolled_back, pending


def common_version(name: str, reaches: dict[int, tuple]) -> tuple[int, int, Optional[str]]:
    """``(common, logged, why)`` for session ``name`` whose shards reach ``reaches`` (shard index
    -> ``(checkpoint version, last logged version, checkpoint path[, fallback version, fallback
    reach])``, -1: none; see ``LogReach``): the version every shard reaches, the highest one any
    shard logged, and why no common version can be restored (None: it can). A shard whose latest
    checkpoint is past the common version is rolled back from the checkpoint it kept before that
    one, if its log reaches the common version from there without a gap."""
    common = min(reach[1] for reach in reaches.values())
    logged = max(reach[1] for reach in reaches.values())
    for index, (checkpoint, _, path, *_) in sorted(reaches.items()):
        if checkpoint < 0 and logged >= 0:
            return common, logged, (f"session {name!r} cannot be restored: shard {index} has no checkpoint in {path} "
                                    f"(its manifest is missing) while its other shards have one")
    for index, (checkpoint, _, path, *fallback) in sorted(reaches.items()):
        fallback_version, fallback_reach = (fallback + [-1, -1])[:2]
        if checkpoint > common and not 0 <= fallback_version <= common <= fallback_reach:
            shortest = min(reaches, key=lambda i: reaches[i][1])
            kept = (f" (the checkpoint kept before it, at version {fallback_version}, reaches {fallback_reach})"
                    if fallback_version >= 0 else "")
            return common, logged, (f"session {name!r} cannot be restored at one version on all its shards: shard "
                                    f"{index}'s checkpoint {path} is at version {checkpoint}{kept}, but shard "
                                    f"{shortest}'s checkpoint and log reach only version {common}")
    return common, logged, None


def _why_lost(name: str, shard_index: int, exc: OptservError) -> str:
    """The message of a session lost because shard ``shard_index`` could not restore its part."""
    if isinstance(exc, SessionLost):  # names the damaged file already
        return str(exc)
    return f"session {name!r} could not be restored on shard {shard_index}: {exc}"
