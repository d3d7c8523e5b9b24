"""The coordinator: sessions, their placement over the shards, and their status.

The coordinator never sees tensor values: it validates a session's configuration, places its
tensors (:func:`~optserve.server.domain.sessions.placement.place_tensors`), opens the session on the
shards it chose (through a :class:`ShardFleet`, which the process host implements over Ray) and
answers with the shard map; clients then talk to the shards directly.

Ownership: a session belongs to the tenant that created it (``""`` when the server has no
tokens). Session names are one namespace: another tenant's session is PERMISSION_DENIED to every
call, and its name cannot be taken while it lives (ALREADY_EXISTS). Listing shows only the
caller's own sessions.

Lost sessions: on a server without durability, when a shard process dies
(:meth:`Coordinator.shard_lost`), every session with tensors on it is *lost*: its parts on the
other shards are dropped, and every call naming it is refused with
:class:`~optserve.server.domain.errors.SessionLost` (the message names the session and the shard)
until its owner closes it; it stays listed, so the owner sees what happened.

Durable sessions (a :class:`SessionCatalog`): each session's definition and shard map are saved
at creation. A dead shard is replaced and its part of every session restored from its checkpoint
and step log (:meth:`Coordinator.shard_down`, then :meth:`Coordinator.shards_restarted`); a
restarted server restores every saved session (:meth:`Coordinator.restore_all`). A session whose
part cannot be restored (a damaged checkpoint) is lost, with the reason.

Idle sessions: with a lease (:meth:`Coordinator.expire_idle`), a session no client pushed to,
committed on, pulled from or initialized for that long is closed, as its owner would close it.

Each session's state (opening, live, lost, unloaded, closing) is kept in one
:class:`~optserve.server.domain.sessions.session_table.SessionTable`, whose methods are its transitions;
restoring a durable session at one version on all its shards is
:mod:`~optserve.server.domain.sessions.session_restore`'s job.

Every session event is one log line (:mod:`~optserve.server.domain.events`):
``event=session_created``, ``session_closed``, ``session_expired``, ``session_lost``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Mapping, Optional, Sequence

from optserve.server.domain.config import Limits, SessionConfig
from optserve.server.domain.errors import FailedPrecondition, SessionLost, Unavailable
from optserve.server.domain.events import log_event
from optserve.server.domain.sessions.admission import check_request, place_session
from optserve.server.domain.sessions.ports import SessionCatalog, ShardFleet
from optserve.server.domain.sessions.session_records import (AttachExpectation, SessionRecord, SessionStatus,
                                                             ShardSummary)
from optserve.server.domain.sessions.session_failover import fail_over, restandby
from optserve.server.domain.sessions.session_open import catch_up_missed, open_on_shards, undo_open, with_replicas
from optserve.server.domain.sessions.session_restore import record_from_catalog, restore_recorded, restore_restarted
from optserve.server.domain.sessions.session_table import SessionState, SessionTable

log = logging.getLogger(__name__)

_CLOSING_WAIT_S = 10.0  # how long a create waits for a closing session of its name to be gone
_OPENING_WAIT_S = 600.0  # ... and for a session of its name that another create is opening
_OPENS_AT_ONCE = 4  # creates whose shards open (compile) at once: the rest of a shard's threads serve calls
ADMIN_TENANT = "admin"  # the tenant whose token sees every tenant's figures in the server's status


class Coordinator:
    """Sessions on one server.

    Args:
      fleet: the shard actors.
      min_shard_bytes: see :func:`~optserve.server.domain.sessions.placement.place_tensors`.
      catalog: durable servers: where sessions' definitions are saved (None: not durable).
      limits: bounds a new session must keep (bytes, memory budget per shard, sessions per tenant).

    Locks: the session table's own lock is held only briefly, so listing and status answer while
    a session is being created; ``_membership`` is held while a new session is placed and taken
    live, and while a shard's sessions change hands (lost, down, restarted, unloaded, reloaded).
    The shards open a new session (compiling its step: a minute for a large Shampoo model)
    outside it, so other creates and a shard's failure are handled meanwhile; a create whose
    shard died or restarted while opening is undone (:meth:`_take_live`).
    """

    def __init__(self, fleet: ShardFleet, *, min_shard_bytes: int = 0, catalog: Optional[SessionCatalog] = None,
                 limits: Optional[Limits] = None, precond_workers: bool = False):
        self._fleet = fleet
        self._workers = precond_workers  # roots are exchanged with workers (the estimates count them in flight)
        self._catalog = catalog
        self._min_shard_bytes = min_shard_bytes
        self.limits = limits or Limits()
        self._table = SessionTable()
        self._membership = threading.Lock()
        self._shard_changes: collections.Counter = collections.Counter()  # shard -> deaths and restarts seen
        self._opens = threading.BoundedSemaphore(_OPENS_AT_ONCE)

    @property
    def durable(self) -> bool:
        return self._catalog is not None

    def create_session(self, config: SessionConfig, owner: str = "", creator: str = "") -> SessionRecord:
        """Places and opens a session owned by tenant ``owner``, created by client ``creator``.

        Raises:
          AlreadyExists: a session of this name exists (one still closing, or being opened by
            another create, is waited for first).
          ResourceExhausted: the session is larger than ``max_session_bytes``, its tensors would
            take a shard past its memory budget, or ``owner`` holds ``max_sessions_per_tenant``
            sessions (checked before any shard allocates anything).
          InvalidArgument: a bad optimizer option, or a shard refused to open its part: the
            optimizer cannot build its state for the shard's tensors (checked abstractly, before
            the shard holds anything).
          Unavailable: a shard died or restarted while opening it.
          FailedPrecondition: it asks for ``replicas`` 2 on a server without standbys.
        Whatever is raised, nothing is left: no shard holds the session and its name is free.
        """
        check_request(config, self.limits)
        config = with_replicas(config, self._fleet.replicated)
        record = None
        while record is None:  # until no other create of this name is opening it
            self._table.wait_until_free(config.name, _CLOSING_WAIT_S, _OPENING_WAIT_S)
            with self._membership:  # placed one at a time, each counting those being opened
                if self._table.state_of(config.name) is SessionState.OPENING:
                    continue  # placed by another create since the wait: wait for that one
                owned = self._table.held_by(owner)
                if owned >= self.limits.max_sessions_per_tenant:
                    raise self.limits.exceeded("max_sessions_per_tenant", f"tenant {owner!r}: {owned + 1} open sessions")
                record, estimated, left = place_session(
                    config, owner, creator, addresses=self._fleet.addresses, table=self._table, limits=self.limits,
                    workers=self._workers, min_shard_bytes=self._min_shard_bytes)
                self._table.opening(record, estimated)
                changes = {a.shard_index: self._shard_changes[a.shard_index] for a in record.assignments}
        try:
            with self._opens:
                missing = open_on_shards(self._fleet, self._catalog, record, left)
        except BaseException:
            self._table.abandoned(config.name)
            raise
        self._take_live(record, changes)
        catch_up_missed(self._fleet, record, missing)
        log_event(log, logging.INFO, "session_created", session=config.name, optimizer=config.optimizer_name,
                  mode=config.mode.name.lower(), tensors=len(config.tensors),
                  shards=",".join(str(a.shard_index) for a in record.assignments),
                  param_bytes=sum(a.param_bytes for a in record.assignments))
        return record

    def _take_live(self, record: SessionRecord, changes: Mapping[int, int]) -> None:
        """Its shards opened the new session: it is live, unless one of them died or restarted
        since it was placed (``changes``: each shard's count then). Such a shard holds no part
        of it, and its failure's handling did not see a session not live yet: it is undone.

        Raises:
          Unavailable: a shard died or restarted meanwhile; nothing was created.
        """
        name = record.config.name
        with self._membership:
            changed = sorted(i for i, seen in changes.items() if self._shard_changes[i] != seen)
            if not changed:
                self._table.opened(name)
                return
        try:  # outside the lock: no one else changes an OPENING session
            undo_open(self._fleet, self._catalog, name)
        finally:
            self._table.abandoned(name)
        raise Unavailable(f"session {name!r}: shard {', '.join(map(str, changed))} died or restarted while the "
                          f"session was being created; nothing was created, retry")

    def restore_all(self) -> list[str]:
        """Durable servers, at start: restores every session of the catalog on the shards (its
        checkpoint and step log); returns their names. One that cannot be restored is lost."""
        restored = []
        with self._membership:
            for entry in self._catalog.entries():
                record = record_from_catalog(entry, self._fleet.addresses)
                if record is None:
                    continue
                self._table.restored(record, record.estimated_bytes(self._workers))
                why = restore_recorded(self._fleet, self._table, record)
                if why is not None:
                    self._lose({record.config.name: why})
                    log.error("event=session_lost session=%s reason=%s", record.config.name, why)
                else:
                    restored.append(record.config.name)
                    log.warning("event=session_restored session=%s", record.config.name)
        return restored

    def shard_down(self, shard_index: int) -> list[str]:
        """Durable servers: shard ``shard_index`` died and is being restarted. Votes waiting for it
        on its sessions' home shards end now (the clients retry); returns those sessions."""
        with self._membership:
            self._shard_changes[shard_index] += 1
            by_home = self._table.live_on(shard_index)
        for home, names in by_home.items():
            if home != shard_index:
                self._fleet.peer_down(home, shard_index, names)
        return sorted(n for names in by_home.values() for n in names)

    def shards_restarted(self, shard_indices: Sequence[int], waiting: Sequence[int] = ()) -> tuple[list[str], set[int]]:
        """Durable servers: shards ``shard_indices``, restarted together, run again (at
        ``fleet.addresses``): restores their parts of their sessions, but those on a shard of
        ``waiting`` (its restart failed; see :func:`~.session_restore.restore_restarted`).
        Returns the sessions that could not be restored (now lost), and the restarted shards
        still holding back a session (pass them again once ``waiting`` is back)."""
        with self._membership:
            self._shard_changes.update(shard_indices)
            lost, rolled_back, pending = restore_restarted(self._fleet, self._table, shard_indices, waiting)
            for name, logged in rolled_back.items():
                self._table.rolled_back(name, logged)
            if lost:
                self._lose(lost)
        return sorted(lost), pending

    def shard_replaced(self, shard_index: int) -> None:
        """A lost shard's replacement runs (maybe at a new address): a create placed before is undone."""
        with self._membership:
            self._shard_changes[shard_index] += 1

    def shard_lost(self, shard_index: int, address: str, cause: str) -> list[str]:
        """Shard ``shard_index`` (at ``address``) died of ``cause``: its sessions are lost.

        Drops their parts on the other shards (calls waiting there fail with the same message)
        and returns their names. Sessions already lost are left as they are.
        """
        with self._membership:
            self._shard_changes[shard_index] += 1
            names = [n for names in self._table.live_on(shard_index).values() for n in names]
        lost = {name: (f"session {name!r} is lost: shard {shard_index} ({address}), which held part of it, died "
                       f"({cause}) and the server keeps no copy of its state; close the session and create it again")
                for name in names}
        self._lose(lost, shard_index, cause)
        return sorted(lost)

    def fail_over(self, shard_index: int, address: str, cause: str) -> Optional[list[str]]:
        """Shard ``shard_index`` (at ``address``) died of ``cause`` and has a hot standby, which
        serves its sessions from now on (:func:`~.session_failover.fail_over`); returns the
        sessions lost, or None (durable servers) when the standby was gone too: the caller
        restarts the shard and restores it from its files."""
        with self._membership:
            self._shard_changes[shard_index] += 1
            lost = fail_over(self._fleet, self._table, shard_index, address, cause, self.durable)
            if lost is not None:
                self._lose(lost, shard_index, cause)
        return None if lost is None else sorted(lost)

    def restandby(self, shard_index: int, names: Optional[list[str]] = None) -> list[str]:
        """Shard ``shard_index``'s fresh standby takes its sessions (``names``: those, again;
        :func:`~.session_failover.restandby`)."""
        return restandby(self._fleet, self._table, shard_index, names)

    def _lose(self, lost: dict[str, str], shard_index: Optional[int] = None, cause: str = "") -> None:
        """The sessions of ``lost`` are lost (each with its message): their shards drop them (a
        ``shard_index`` that died of ``cause``: each one logged as lost there)."""
        for name in lost if shard_index is not None else ():
            log_event(log, logging.ERROR, "session_lost", session=name, shard=shard_index, cause=cause)
        self._table.lost(lost)
        for name, why in lost.items():
            self._fleet.close_session(name, why)

    def get_session(self, name: str, tenant: str = "", expect: Optional[AttachExpectation] = None) -> SessionRecord:
        """The session, if ``tenant`` owns it, it is not lost and it is what the caller ``expect``s."""
        record = self._usable(name, tenant)
        differences = expect.differences(record.config) if expect is not None else []
        if differences:
            raise FailedPrecondition(f"session {name!r} is not the session you expect: it has "
                                     + "; ".join(differences)
                                     + f". To go on: attach with its options, close it with "
                                       f"client.close_session({name!r}) (`optserve sessions close {name}`) and "
                                       f"create it anew, or pick a new name")
        return record

    def _usable(self, name: str, tenant: str) -> SessionRecord:
        """The session, if ``tenant`` owns it (loaded back first if it was unloaded when idle);
        raises SessionLost if it is lost."""
        entry = self._table.owned(name, tenant)
        if entry.state is SessionState.UNLOADED:
            self._reload(name)
        why = self._table.why_lost(name)
        if why is not None:
            raise SessionLost(why)
        return entry.record

    def expire_idle(self, idle_s: float, now: Optional[float] = None) -> list[str]:
        """Ends every session idle over ``idle_s`` s at unix time ``now`` (default: now; its activity:
        the latest any of its shards saw, one no shard reported on is kept); returns their names. Closed
        without durability; a durable one is checkpointed and *unloaded* (its shards free it, it stays
        listed and on disk, and the next call naming it loads it back from its checkpoint)."""
        activity = self._fleet.session_activity()
        now = time.time() if now is None else now
        expired = self._table.expired(activity, now, idle_s, close=self._catalog is None)
        for name, idle in expired:
            log_event(log, logging.INFO, "session_expired", session=name, idle_s=f"{idle:.1f}",
                      session_idle_s=f"{idle_s:g}", unloaded=self._catalog is not None)
            if self._catalog is None:
                self._drop(name)
            else:
                self._unload(name)
        return [name for name, _ in expired]

    def _unload(self, name: str) -> None:
        """Durable servers: a final checkpoint of the session, then its shards free it (its
        catalog entry, checkpoint and log stay); :meth:`_usable` loads it back on demand."""
        with self._membership:
            if self._table.unloaded(name):
                self._fleet.unload_session(name)

    def _reload(self, name: str) -> None:
        """Loads an unloaded durable session back onto its shards (its checkpoint and step log)."""
        with self._membership:
            entry = self._table.entry(name)
            if entry is None or entry.state is not SessionState.UNLOADED:
                return  # loaded meanwhile, or closed
            why = restore_recorded(self._fleet, self._table, entry.record)
            self._table.reloaded(name, why)
            if why is not None:
                self._fleet.close_session(name, why)
            log_event(log, logging.INFO, "session_reloaded", session=name, lost=why is not None)

    def close_session(self, name: str, tenant: str = "") -> None:
        """Closes ``tenant``'s session; its name is free again once every shard dropped it."""
        self._table.closing(name, tenant)
        self._drop(name)
        log_event(log, logging.INFO, "session_closed", session=name)

    def _drop(self, name: str) -> None:
        """Closes a CLOSING session on its shards and in the catalog; the name is free again after."""
        try:
            self._fleet.close_session(name)
            if self._catalog is not None:
                self._catalog.remove(name)
        finally:
            self._table.dropped(name)

    def lost_sessions(self) -> dict[str, str]:
        """Lost session -> why (operators' view)."""
        return self._table.lost_sessions()

    def list_sessions(self, tenant: str = "") -> list[str]:
        """The names of ``tenant``'s sessions."""
        return sorted(self._table.records(tenant))

    def list_all(self) -> list[str]:
        """Every open session's name (operators' view: metrics, server status)."""
        return sorted(self._table.records())

    def series(self, name: str, tenant: str = ""):
        """The session's ``(accepted, refused, rounds)`` records, kept by its home shard."""
        record = self._usable(name, tenant)
        return self._fleet.session_series(name, record.home)

    def shards(self, tenant: Optional[str] = None) -> list[ShardSummary]:
        """Every shard actor, as tenant ``tenant`` may see it: its own sessions' count and bytes
        only, and no process memory (shared with the other tenants). None (a server without
        tenants, or its admin tenant :data:`ADMIN_TENANT`): everything."""
        summaries = self._fleet.shard_summaries()
        if tenant is None or tenant == ADMIN_TENANT:
            return summaries
        owned = list(self._table.records(tenant).values())
        return [summary.seen_by(owned) for summary in summaries]

    def status(self, name: str, tenant: str = "") -> SessionStatus:
        record = self._usable(name, tenant)
        shards = self._fleet.session_status(name, [a.shard_index for a in record.assignments])
        # the home shard keeps the clock
        return SessionStatus(record, shards[0].clock, tuple(shards), self._table.rolled_back_from(name))
