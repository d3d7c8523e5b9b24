"""The coordinator: sessions, their placement over the shards, and their status.

The coordinator never sees tensor values: it validates a session's configuration, places its
tensors (:func:`~optserve.server.domain.placement.place_tensors`), opens the session on the
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
and step log (:meth:`Coordinator.shard_down`, then :meth:`Coordinator.shard_restarted`); a
restarted server restores every saved session (:meth:`Coordinator.restore_all`). A session whose
part cannot be restored (a damaged checkpoint) is lost, with the reason.

Idle sessions: with a lease (:meth:`Coordinator.expire_idle`), a session no client pushed to,
committed on, pulled from or initialized for that long is closed, as its owner would close it.

Every session event is one log line (:mod:`~optserve.server.domain.events`):
``event=session_created``, ``session_closed``, ``session_expired``, ``session_lost``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Mapping, Optional, Protocol, Sequence

from optserve.server.compute.kernels import check_optimizer
from optserve.server.domain.clock import ClockStatus
from optserve.server.domain.config import Limits, Mode, PreconditionerOptions, SessionConfig, estimated_shard_bytes
from optserve.server.domain.errors import (AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, Unavailable,
                                           OptservError, PermissionDenied, SessionLost)
from optserve.server.domain.events import log_event
from optserve.server.domain.placement import place_tensors
from optserve.server.domain.shard_session import ShardSessionStatus

log = logging.getLogger(__name__)

_CLOSING_WAIT_S = 10.0  # how long a create waits for a closing session of its name to be gone
ADMIN_TENANT = "admin"  # the tenant whose token sees every tenant's figures in the server's status


@dataclasses.dataclass(frozen=True)
class Assignment:
    """Tensors of one session on one shard."""

    shard_index: int
    address: str
    tensor_names: tuple[str, ...]
    param_bytes: int


@dataclasses.dataclass(frozen=True)
class SessionRecord:
    """A session and where its tensors live (the first assignment is its home shard).

    Attributes:
      owner: the tenant that created it ("" on a server without tokens).
      creator: the creating client's identity (only it may send the initial values).
    """

    config: SessionConfig
    assignments: tuple[Assignment, ...]
    owner: str = ""
    creator: str = ""

    def to_json(self) -> dict:
        """The catalog entry of a durable session (addresses left out: they change at restarts)."""
        return {"config": self.config.to_json(), "owner": self.owner, "creator": self.creator,
                "placement": {str(a.shard_index): list(a.tensor_names) for a in self.assignments}}

    def on_shard(self, shard_index: int) -> bool:
        return any(a.shard_index == shard_index for a in self.assignments)

    def moved(self, shard_index: int, address: str) -> "SessionRecord":
        """The record with shard ``shard_index`` serving at ``address``."""
        return dataclasses.replace(self, assignments=tuple(
            dataclasses.replace(a, address=address) if a.shard_index == shard_index else a for a in self.assignments))


@dataclasses.dataclass(frozen=True)
class AttachExpectation:
    """What an attaching client expects of a session; None fields are not checked."""

    optimizer_name: Optional[str] = None
    optimizer_args: Optional[dict] = None
    preconditioners: Optional[PreconditionerOptions] = None
    mode: Optional[Mode] = None

    def differences(self, config: SessionConfig) -> list[str]:
        """How ``config`` differs from the expectation, one phrase per difference."""
        found = []
        if self.optimizer_name is not None and self.optimizer_name != config.optimizer_name:
            found.append(f"optimizer {config.optimizer_name!r}, not {self.optimizer_name!r}")
        elif self.optimizer_args is not None and self.optimizer_args != config.optimizer_args:
            keys = sorted(set(self.optimizer_args) | set(config.optimizer_args), key=str)
            for key in keys:
                has, wants = config.optimizer_args.get(key, "<unset>"), self.optimizer_args.get(key, "<unset>")
                if has != wants:
                    found.append(f"optimizer option {key!r} = {has!r}, not {wants!r}")
        if self.preconditioners is not None and self.preconditioners != config.preconditioners:
            found.append(f"preconditioners {config.preconditioners}, not {self.preconditioners}")
        if self.mode is not None and self.mode is not config.mode:
            found.append(f"mode {config.mode.name.lower()}, not {self.mode.name.lower()}")
        return found


@dataclasses.dataclass(frozen=True)
class ShardOpening:
    """What one shard needs to hold its part of a new session.

    Attributes:
      shard_index: the shard.
      config: the session.
      tensor_names: the tensors it holds.
      participants: shards holding the session (votes and sums wait for all of them).
      home_clock: the home shard's clock address; None on the home shard (it keeps the clock).
      owner / creator: as :class:`SessionRecord`.
    """

    shard_index: int
    config: SessionConfig
    tensor_names: tuple[str, ...]
    participants: int
    home_clock: Optional[str]
    owner: str = ""
    creator: str = ""


@dataclasses.dataclass(frozen=True)
class SessionStatus:
    """A session across its shards: the home shard's clock and each shard's own status."""

    record: SessionRecord
    clock: ClockStatus
    shards: tuple[ShardSessionStatus, ...]  # in assignment order
    rolled_back_from: int = 0  # the last restore brought the shards back below this logged version (0: no)

    @property
    def last_activity_unix_s(self) -> float:
        """When a client last used the session: a push decided, or a push, commit, pull or
        init on any of its shards (unix seconds)."""
        return max([self.clock.last_activity_unix_s] + [s.last_activity_unix_s for s in self.shards])


@dataclasses.dataclass(frozen=True)
class ShardSummary:
    """One shard actor as the server sees it now (``healthy`` False: it did not answer)."""

    index: int
    address: str
    node_id: str = ""
    sessions: int = 0
    param_bytes: int = 0
    resident_bytes: int = 0
    healthy: bool = False


class ShardFleet(Protocol):
    """The shard actors as the coordinator sees them. Calls run on all named shards at once and
    raise the first domain error any of them raised."""

    addresses: Sequence[str]  # data-plane "host:port" by shard index
    clock_addresses: Sequence[str]  # clock endpoints by shard index

    def open_session(self, openings: Sequence[ShardOpening]) -> None: ...

    def close_session(self, name: str, reason: str = "") -> None: ...  # on every shard (idempotent);
    # calls still waiting in the session fail with ``reason`` (a lost session's message) if given

    def session_status(self, name: str, shard_indices: Sequence[int]) -> list[ShardSessionStatus]: ...

    def shard_summaries(self) -> list[ShardSummary]: ...  # every shard, answering or not

    def session_series(self, name: str, shard_index: int): ...  # (accepted, refused) of the home shard

    def session_activity(self) -> Mapping[str, float]: ...  # session -> latest activity on any shard (unix s)

    # durable servers only
    def restore_session(self, opening: ShardOpening, upto: Optional[int] = None) -> int: ...  # opens + restores
    # one shard's part (to version ``upto``; None: all it logged); returns its version; raises SessionLost
    def reachable(self, opening: ShardOpening) -> tuple[int, int, str]: ...  # one shard's part on disk:
    # (checkpoint version, last logged version, checkpoint path), nothing loaded; raises SessionLost

    def peer_down(self, home_index: int, shard_index: int, names: Sequence[str]) -> None: ...

    def peer_up(self, home_index: int, shard_index: int, names: Sequence[str]) -> None: ...

    def set_home_clock(self, shard_index: int, name: str, address: str) -> None: ...

    def unload_session(self, name: str) -> None: ...  # checkpoint, then free it on every shard

    def recovered(self, shard_index: int) -> None: ...  # the shard answers for unknown sessions again


class SessionCatalog(Protocol):
    """Where a durable server keeps its sessions' definitions (one entry per session)."""

    def save(self, name: str, entry: dict) -> None: ...

    def remove(self, name: str) -> None: ...

    def entries(self) -> list[dict]: ...


class Coordinator:
    """Sessions on one server.

    Args:
      fleet: the shard actors.
      min_shard_bytes: see :func:`~optserve.server.domain.placement.place_tensors`.
      catalog: durable servers: where sessions' definitions are saved (None: not durable).
      limits: bounds a new session must keep (bytes, memory budget per shard, sessions per tenant).

    Locks: ``_lock`` guards the records and is held only briefly, so listing and status answer
    while a session is being created; ``_membership`` is held while sessions are added (the
    shards opening a new one) or a shard's sessions change hands (lost, down, restarted), so those
    never see a session half created.
    """

    def __init__(self, fleet: ShardFleet, *, min_shard_bytes: int = 0, catalog: Optional[SessionCatalog] = None,
                 limits: Optional[Limits] = None):
        self._fleet = fleet
        self._catalog = catalog
        self._min_shard_bytes = min_shard_bytes
        self.limits = limits or Limits()
        self._sessions: dict[str, SessionRecord] = {}
        self._estimated: dict[str, dict[int, int]] = {}  # session -> shard -> estimated bytes (budget)
        self._closing: set[str] = set()  # names whose shards are still closing: not yet reusable
        self._lost: dict[str, str] = {}  # lost session -> why (see the module docstring)
        self._rolled_back: dict[str, int] = {}  # session -> the version its last restore rolled back from
        self._unloaded: set[str] = set()  # durable sessions unloaded when idle (see expire_idle)
        self._lock = threading.Lock()
        self._closed = threading.Condition(self._lock)  # notified when a name leaves _closing
        self._membership = threading.Lock()

    def create_session(self, config: SessionConfig, owner: str = "", creator: str = "") -> SessionRecord:
        """Places and opens a session owned by tenant ``owner``, created by client ``creator``.

        Raises:
          ResourceExhausted: the session is larger than ``max_session_bytes``, its tensors would
            take a shard past its memory budget, or ``owner`` holds ``max_sessions_per_tenant``
            sessions (checked before any shard allocates anything).
          InvalidArgument: a bad optimizer option, or a shard refused to open its part: the
            optimizer cannot build its state for the shard's tensors (checked abstractly, before
            the shard holds anything). Either way nothing is left: no shard holds the session and
            its name is free.
        """
        limits = self.limits
        session_bytes = sum(t.nbytes for t in config.tensors)
        if session_bytes > limits.max_session_bytes:
            raise limits.exceeded("max_session_bytes", f"session {config.name!r}: {session_bytes} parameter bytes")
        try:
            check_optimizer(config.optimizer_name, config.optimizer_args)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        with self._membership:  # one create at a time; listing and status go on meanwhile
            with self._lock:
                # a name whose shards are still closing is free in a moment: wait for it, briefly
                self._closed.wait_for(lambda: config.name not in self._closing, timeout=_CLOSING_WAIT_S)
                if config.name in self._sessions or config.name in self._closing:
                    raise AlreadyExists(f"session {config.name!r} already exists: attach to it with "
                                        f"client.session({config.name!r}) to go on training it, or end it with "
                                        f"client.close_session({config.name!r}) to create it afresh")
                owned = sum(1 for record in self._sessions.values() if record.owner == owner)
                if owned >= limits.max_sessions_per_tenant:
                    raise limits.exceeded("max_sessions_per_tenant", f"tenant {owner!r}: {owned + 1} open sessions")
                num_shards = len(self._fleet.addresses)
                placement = place_tensors(config.tensors, num_shards, min_shard_bytes=self._min_shard_bytes,
                                          shard_loads=self._shard_loads_locked(num_shards))
                by_name = config.spec_by_name
                estimated = {i: estimated_shard_bytes(by_name[n] for n in names)
                             for i, names in enumerate(placement) if names}
                self._check_budget_locked(config.name, estimated, num_shards)
                assignments = tuple(
                    Assignment(i, self._fleet.addresses[i], tuple(names), sum(by_name[n].nbytes for n in names))
                    for i, names in enumerate(placement)
                    if names
                )
                home = assignments[0].shard_index
                home_clock = self._fleet.clock_addresses[home]
            record = SessionRecord(config, assignments, owner, creator)
            try:
                self._fleet.open_session([
                    ShardOpening(a.shard_index, config, a.tensor_names, len(assignments),
                                 None if a.shard_index == home else home_clock, owner, creator)
                    for a in assignments
                ])
                if self._catalog is not None:
                    try:
                        self._catalog.save(config.name, record.to_json())
                    except OSError as exc:
                        raise Unavailable(f"session {config.name!r}: {exc.strerror}; nothing was created, retry "
                                          f"once the disk takes writes again") from None
            except BaseException:
                self._fleet.close_session(config.name)
                if self._catalog is not None:
                    try:
                        self._catalog.remove(config.name)
                    except OSError:  # the disk that refused the entry: the next start sets the folder aside
                        log.exception("event=catalog_remove_failed session=%s", config.name)
                raise
            with self._lock:
                self._sessions[config.name] = record
                self._estimated[config.name] = estimated
        log_event(log, logging.INFO, "session_created", session=config.name, optimizer=config.optimizer_name,
                  mode=config.mode.name.lower(), tensors=len(config.tensors),
                  shards=",".join(str(a.shard_index) for a in assignments),
                  param_bytes=sum(a.param_bytes for a in assignments))
        return record

    def _check_budget_locked(self, name: str, estimated: dict[int, int], num_shards: int) -> None:
        """Raises ResourceExhausted if ``estimated`` bytes would take a shard past its budget."""
        budget = self.limits.shard_budget(num_shards)
        for shard, needed in sorted(estimated.items()):
            held = sum(e.get(shard, 0) for e in self._estimated.values())
            if held + needed > budget:
                raise self.limits.exceeded(
                    "shard_memory_bytes", f"session {name!r}: shard {shard} would hold an estimated {held + needed} "
                    f"bytes, {needed} of them this session's parameters, optimizer state and gradient buffer", budget)

    @property
    def durable(self) -> bool:
        return self._catalog is not None

    def _openings(self, record: SessionRecord) -> list[ShardOpening]:
        home = record.assignments[0].shard_index
        home_clock = self._fleet.clock_addresses[home]
        return [ShardOpening(a.shard_index, record.config, a.tensor_names, len(record.assignments),
                             None if a.shard_index == home else home_clock, record.owner, record.creator)
                for a in record.assignments]

    def restore_all(self) -> list[str]:
        """Durable servers, at start: restores every session of the catalog on the shards (its
        checkpoint and step log); returns their names. One that cannot be restored is lost."""
        with self._membership:
            return self._restore_all()

    def _restore_all(self) -> list[str]:
        restored = []
        num_shards = len(self._fleet.addresses)
        for entry in self._catalog.entries():
            config = SessionConfig.from_json(entry["config"])
            placement = sorted((int(i), tuple(names)) for i, names in entry["placement"].items())
            if placement[-1][0] >= num_shards:
                log.error("event=session_lost session=%s reason=needs_%d_shards shards=%d", config.name,
                          placement[-1][0] + 1, num_shards)
                continue
            by_name = config.spec_by_name
            record = SessionRecord(config, tuple(
                Assignment(i, self._fleet.addresses[i], names, sum(by_name[n].nbytes for n in names))
                for i, names in placement), entry.get("owner", ""), entry.get("creator", ""))
            with self._lock:
                self._sessions[config.name] = record
                self._estimated[config.name] = {a.shard_index: estimated_shard_bytes(by_name[n] for n in a.tensor_names)
                                                for a in record.assignments}
            why = self._restore_consistently(record)
            if why is not None:
                self._mark_lost({config.name: why})
                log.error("event=session_lost session=%s reason=%s", config.name, why)
            else:
                restored.append(config.name)
                log.warning("event=session_restored session=%s", config.name)
        return restored

    def _restore_consistently(self, record: SessionRecord) -> Optional[str]:
        """Restores a durable session on all its shards at one version: the highest version every
        shard reaches exactly (its checkpoint plus its log). Steps some shard logged past it were
        never acknowledged by every shard: they are rolled back (logged as ``session_rolled_back``).
        Returns why the session is lost (a damaged file, a shard whose checkpoint is past that
        version), or None once restored."""
        name = record.config.name
        openings = self._openings(record)
        reaches = {}
        for opening in openings:
            try:
                reaches[opening.shard_index] = self._fleet.reachable(opening)
            except SessionLost as exc:
                return str(exc)
            except OptservError as exc:
                return f"session {name!r} could not be restored on shard {opening.shard_index}: {exc}"
        common = min(logged for _, logged, _ in reaches.values())
        logged = max(logged for _, logged, _ in reaches.values())
        for index, (checkpoint, _, path) in sorted(reaches.items()):
            if checkpoint < 0 and logged >= 0:
                return (f"session {name!r} cannot be restored: shard {index} has no checkpoint in {path} (its "
                        f"manifest is missing) while its other shards have one")
        for index, (checkpoint, _, path) in sorted(reaches.items()):
            if checkpoint > common:
                shortest = min(reaches, key=lambda i: reaches[i][1])
                return (f"session {name!r} cannot be restored at one version on all its shards: shard {index}'s "
                        f"checkpoint {path} is at version {checkpoint}, but shard {shortest}'s checkpoint and log "
                        f"reach only version {common}")
        if logged > common:
            log_event(log, logging.WARNING, "session_rolled_back", session=name, version=common, logged=logged,
                      shards=",".join(f"{i}:{r[1]}" for i, r in sorted(reaches.items())))
            with self._lock:
                self._rolled_back[name] = logged
        for opening in openings:
            try:
                self._fleet.restore_session(opening, upto=common)
            except SessionLost as exc:
                return str(exc)
            except OptservError as exc:
                return f"session {name!r} could not be restored on shard {opening.shard_index}: {exc}"
        return None

    def shard_down(self, shard_index: int) -> list[str]:
        """Durable servers: shard ``shard_index`` died and is being restarted. Votes waiting for it
        on its sessions' home shards end now (the clients retry); returns those sessions."""
        with self._membership:
            by_home = self._sessions_on(shard_index)
        for home, names in by_home.items():
            if home != shard_index:
                self._fleet.peer_down(home, shard_index, names)
        return sorted(n for names in by_home.values() for n in names)

    def shard_restarted(self, shard_index: int) -> list[str]:
        """Durable servers: shard ``shard_index`` runs again (at ``fleet.addresses[shard_index]``):
        restores its part of each of its sessions, points peers at a moved home clock, and
        returns the sessions that could not be restored (now lost)."""
        with self._membership:
            return self._shard_restarted(shard_index)

    def _shard_restarted(self, shard_index: int) -> list[str]:
        address = self._fleet.addresses[shard_index]
        lost = {}
        for home, names in self._sessions_on(shard_index).items():
            for name in names:
                with self._lock:
                    record = self._sessions.get(name)
                    if record is None:
                        continue
                    record = self._sessions[name] = record.moved(shard_index, address)
                opening = next(o for o in self._openings(record) if o.shard_index == shard_index)
                try:
                    self._fleet.restore_session(opening)
                except OptservError as exc:
                    lost[name] = str(exc) if isinstance(exc, SessionLost) else (
                        f"session {name!r} could not be restored on shard {shard_index}: {exc}")
                    continue
                if home == shard_index:
                    for a in record.assignments[1:]:
                        self._fleet.set_home_clock(a.shard_index, name, self._fleet.clock_addresses[shard_index])
                else:
                    self._fleet.peer_up(home, shard_index, [name])
        self._fleet.recovered(shard_index)
        if lost:
            self._mark_lost(lost)
        return sorted(lost)

    def _sessions_on(self, shard_index: int) -> dict[int, list[str]]:
        """Home shard -> names of the live sessions with tensors on shard ``shard_index``."""
        out: dict[int, list[str]] = {}
        with self._lock:
            for name, record in self._sessions.items():
                if name not in self._lost and name not in self._unloaded and record.on_shard(shard_index):
                    out.setdefault(record.assignments[0].shard_index, []).append(name)
        return out

    def _mark_lost(self, lost: dict[str, str]) -> None:
        with self._lock:
            self._lost.update(lost)
        for name, why in lost.items():
            self._fleet.close_session(name, why)

    def _shard_loads_locked(self, num_shards: int) -> list[int]:
        """Parameter bytes each shard holds for the open sessions."""
        loads = [0] * num_shards
        for record in self._sessions.values():
            for a in record.assignments:
                loads[a.shard_index] += a.param_bytes
        return loads

    def get_session(self, name: str, tenant: str = "", expect: Optional[AttachExpectation] = None) -> SessionRecord:
        """The session, if ``tenant`` owns it, it is not lost and it is what the caller ``expect``s."""
        record = self._usable(name, tenant)
        differences = expect.differences(record.config) if expect is not None else []
        if differences:
            raise FailedPrecondition(f"session {name!r} is not the session you expect: it has "
                                     + "; ".join(differences))
        return record

    def _usable(self, name: str, tenant: str) -> SessionRecord:
        """The session, if ``tenant`` owns it (loaded back first if it was unloaded when idle);
        raises SessionLost if it is lost."""
        with self._lock:
            record = self._owned_locked(name, tenant)
            unloaded = name in self._unloaded
        if unloaded:
            self._reload(name)
        with self._lock:
            why = self._lost.get(name)
        if why is not None:
            raise SessionLost(why)
        return record

    def shard_lost(self, shard_index: int, address: str, cause: str) -> list[str]:
        """Shard ``shard_index`` (at ``address``) died of ``cause``: its sessions are lost.

        Drops their parts on the other shards (calls waiting there fail with the same message)
        and returns their names. Sessions already lost are left as they are.
        """
        with self._membership, self._lock:
            lost = {}
            for name, record in self._sessions.items():
                if name not in self._lost and name not in self._unloaded and record.on_shard(shard_index):
                    lost[name] = (f"session {name!r} is lost: shard {shard_index} ({address}), which held part of "
                                  f"it, died ({cause}) and the server keeps no copy of its state; close the "
                                  f"session and create it again")
        for name in lost:
            log_event(log, logging.ERROR, "session_lost", session=name, shard=shard_index, cause=cause)
        self._mark_lost(lost)
        return sorted(lost)

    def expire_idle(self, idle_s: float, now: Optional[float] = None) -> list[str]:
        """Ends every session idle longer than ``idle_s`` seconds at unix time ``now`` (default:
        now) and returns their names. A session's activity is the latest one any of its shards
        saw (:meth:`ShardFleet.session_activity`); a session no shard reported on is kept.

        Without durability an expired session is closed. A durable one is checkpointed and
        *unloaded*: its shards free it, it stays listed and on disk, and the next call naming it
        (attach, status, or a push whose shard no longer knows it) loads it back from its checkpoint.
        """
        activity = self._fleet.session_activity()
        now = time.time() if now is None else now
        expired = []
        with self._lock:
            for name in list(self._sessions):
                last = activity.get(name)
                if last is not None and now - last > idle_s and name not in self._unloaded:
                    if self._catalog is None:
                        del self._sessions[name]
                        self._lost.pop(name, None)
                        self._closing.add(name)
                    expired.append((name, now - last))
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
            with self._lock:
                if name not in self._sessions or name in self._lost:
                    return
                self._unloaded.add(name)
            self._fleet.unload_session(name)

    def _reload(self, name: str) -> None:
        """Loads an unloaded durable session back onto its shards (its checkpoint and step log)."""
        with self._membership:
            with self._lock:
                record = self._sessions.get(name)
                if name not in self._unloaded or record is None:
                    return  # loaded meanwhile, or closed
            why = self._restore_consistently(record)
            with self._lock:
                self._unloaded.discard(name)
            if why is not None:
                self._mark_lost({name: why})
            log_event(log, logging.INFO, "session_reloaded", session=name, lost=why is not None)

    def _drop(self, name: str) -> None:
        """Closes a session already taken out of ``_sessions`` (its name is in ``_closing``) on
        its shards and in the catalog; the name is free again after."""
        try:
            self._fleet.close_session(name)
            if self._catalog is not None:
                self._catalog.remove(name)
        finally:
            with self._lock:
                self._closing.discard(name)
                self._closed.notify_all()

    def lost_sessions(self) -> dict[str, str]:
        """Lost session -> why (operators' view)."""
        with self._lock:
            return dict(self._lost)

    def _owned_locked(self, name: str, tenant: str) -> SessionRecord:
        record = self._sessions.get(name)
        if record is None:
            raise NotFound(f"session {name!r} not found")
        if record.owner != tenant:
            raise PermissionDenied(f"session {name!r} belongs to another tenant")
        return record

    def list_sessions(self, tenant: str = "") -> list[str]:
        """The names of ``tenant``'s sessions."""
        with self._lock:
            return sorted(name for name, record in self._sessions.items() if record.owner == tenant)

    def list_all(self) -> list[str]:
        """Every open session's name (operators' view: metrics, server status)."""
        with self._lock:
            return sorted(self._sessions)

    def series(self, name: str, tenant: str = ""):
        """The session's ``(accepted, refused, rounds)`` records, kept by its home shard."""
        record = self._usable(name, tenant)
        return self._fleet.session_series(name, record.assignments[0].shard_index)

    def shards(self, tenant: Optional[str] = None) -> list[ShardSummary]:
        """Every shard actor, as tenant ``tenant`` may see it: its own sessions' count and bytes
        only, and no process memory (shared with the other tenants). None (a server without
        tenants, or its admin tenant :data:`ADMIN_TENANT`): everything."""
        summaries = self._fleet.shard_summaries()
        if tenant is None or tenant == ADMIN_TENANT:
            return summaries
        with self._lock:
            owned = [r for r in self._sessions.values() if r.owner == tenant]
        scoped = []
        for summary in summaries:
            mine = [a for r in owned for a in r.assignments if a.shard_index == summary.index]
            scoped.append(dataclasses.replace(summary, sessions=len(mine), param_bytes=sum(a.param_bytes for a in mine),
                                              resident_bytes=0))
        return scoped

    def close_session(self, name: str, tenant: str = "") -> None:
        """Closes ``tenant``'s session; its name is free again once every shard dropped it."""
        with self._lock:  # the owner check and the removal are one step: no other record can slip in
            self._owned_locked(name, tenant)
            del self._sessions[name]
            self._estimated.pop(name, None)
            self._lost.pop(name, None)
            self._unloaded.discard(name)
            self._closing.add(name)
        self._drop(name)
        log_event(log, logging.INFO, "session_closed", session=name)

    def status(self, name: str, tenant: str = "") -> SessionStatus:
        record = self._usable(name, tenant)
        shards = self._fleet.session_status(name, [a.shard_index for a in record.assignments])
        with self._lock:
            rolled_back_from = self._rolled_back.get(record.config.name, 0)
        # the home shard keeps the clock
        return SessionStatus(record, shards[0].clock, tuple(shards), rolled_back_from)
