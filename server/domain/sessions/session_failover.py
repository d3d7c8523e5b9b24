"""A dead shard's standby serves in its place (``--replicas 2``, ``docs/plans/hot_standby.md``):
each session the shard held is promoted on the standby, which becomes the shard at its own
addresses; the session map follows, so clients find it on their next retry.

Where the dead shard was a session's home, the other shards call its clock at the standby's
internal address from now on; where it was not, the home's votes that waited for the dead
process end now (the clients retry, and the standby votes in its place). A session the standby
did not hold in sync cannot be promoted: it is lost, with the reason; so is one created with
``replicas`` 1 (no standby held it). On a durable server such sessions are restored from their
files on the promoted standby instead (:func:`restore_unpromoted`).
"""

from __future__ import annotations

import logging
from typing import Optional

from optserve.server.domain.sessions.ports import ShardFleet
from optserve.server.domain.sessions.session_restore import restore_restarted
from optserve.server.domain.sessions.session_table import SessionTable

log = logging.getLogger(__name__)

PROMOTE_TIMEOUT_S = 30.0  # how long a standby may take to apply the steps it holds


def fail_over(fleet: ShardFleet, table: SessionTable, shard_index: int, address: str, cause: str,
              durable: bool) -> Optional[dict[str, str]]:
    """Shard ``shard_index`` (at ``address``) died of ``cause``: its standby serves its sessions
    (:func:`promote_standby`); on a ``durable`` server those it did not take are restored from
    their files there (:func:`restore_unpromoted`). Returns the sessions lost, each with its
    message (the caller loses them), or None: durable, and the standby was gone too (nothing
    changed: the shard is to be restarted and restored from its files)."""
    lost = promote_standby(fleet, table, shard_index, f"shard {shard_index} ({address}), which held part of it, "
                                                      f"died ({cause})")
    if not durable:
        return lost
    if fleet.addresses[shard_index] == address:  # no standby took over
        return None
    return restore_unpromoted(fleet, table, shard_index, set(lost))


def promote_standby(fleet: ShardFleet, table: SessionTable, shard_index: int, death: str) -> dict[str, str]:
    """Shard ``shard_index``'s process died (``death`` says how) and it has a standby: the standby
    serves its sessions (see the module's docstring). Returns the sessions that could not be
    promoted, each with its lost message (the caller loses them)."""
    by_home = table.live_on(shard_index)
    one_copy = {name for names in by_home.values() for name in names if _copies(table, name) == 1}
    by_home = {home: [name for name in names if name not in one_copy] for home, names in by_home.items()}
    names = sorted(name for names in by_home.values() for name in names)
    outcomes = fleet.promote(shard_index, names, PROMOTE_TIMEOUT_S)
    address, clock_address = fleet.addresses[shard_index], fleet.clock_addresses[shard_index]
    for home, names_there in by_home.items():
        promoted = [name for name in names_there if outcomes.get(name) is None]
        for name in promoted:
            record = table.moved(name, shard_index, address)
            if home == shard_index and record is not None:  # its peers vote at the promoted clock
                for assignment in record.assignments[1:]:
                    fleet.set_home_clock(assignment.shard_index, name, clock_address)
        if home != shard_index and promoted:  # votes that waited for the dead process end; the standby votes now
            for name in promoted:  # at the home's clock as it is now (it may have failed over itself meanwhile)
                fleet.set_home_clock(shard_index, name, fleet.clock_addresses[home])
            fleet.peer_down(home, shard_index, promoted)
            fleet.peer_up(home, shard_index, promoted)
    lost = {name: f"session {name!r} is lost: {death} and its standby could not take over ({why}); close the "
                  f"session and create it again" for name, why in outcomes.items() if why is not None}
    lost.update({name: f"session {name!r} is lost: {death}, and it was created with replicas=1 (no standby held "
                       f"its state); close the session and create it again" for name in one_copy})
    return lost


def restore_unpromoted(fleet: ShardFleet, table: SessionTable, shard_index: int, names: set[str]) -> dict[str, str]:
    """A durable server's shard ``shard_index`` failed over: its sessions ``names`` that its
    standby did not take (created with replicas=1, or not in sync) are restored from their files
    on the promoted standby, which owns them now (votes that waited for the dead process end
    first); then it answers for sessions it does not hold again. Returns those that could not be,
    with why they are lost."""
    if not names:
        fleet.recovered(shard_index)
        return {}
    for home, there in table.live_on(shard_index).items():
        waiting = [name for name in there if name in names]
        if home != shard_index and waiting:
            fleet.peer_down(home, shard_index, waiting)
    lost, rolled_back, _pending = restore_restarted(fleet, table, [shard_index], only=names)
    for name, logged in rolled_back.items():
        table.rolled_back(name, logged)
    log.warning("event=sessions_restored_after_failover shard=%d sessions=%s lost=%s", shard_index,
                ",".join(sorted(names)), ",".join(sorted(lost)) or "-")
    return lost


def _copies(table: SessionTable, name: str) -> int:
    entry = table.entry(name)
    return 2 if entry is None else (entry.record.config.replicas or 1)  # (unset: restored from a catalog)


def restandby(fleet: ShardFleet, table: SessionTable, shard_index: int,
              names: Optional[list[str]] = None) -> list[str]:
    """Shard ``shard_index`` has a fresh standby (``fleet.add_standby``): each session live on it
    starts the standby from its part's state now, caught up from the shard's memory, and is
    acknowledged with two copies again. ``names``: those sessions alone, whose standby part there
    is stale (their primary let it go while both processes live): it is replaced. Returns the
    sessions whose part could not be (closed meanwhile, or inside steps for too long: they go on
    with one copy, logged)."""
    records = {name: table.entry(name) for live in table.live_on(shard_index).values() for name in live
               if names is None or name in names}
    failed = []
    for name, entry in records.items():
        if entry is None or entry.record.config.replicas != 2:
            continue
        try:
            fleet.start_standbys(name, entry.record.openings(fleet.clock_addresses), only=shard_index,
                                 replace=names is not None)
        except Exception as exc:  # noqa: BLE001 - that session goes on with one copy; the others are taken
            failed.append(name)
            log.warning("event=standby_not_started session=%s shard=%d error=%s", name, shard_index, exc)
    return sorted(failed)
