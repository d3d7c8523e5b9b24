"""The coordinator's sessions: one entry per session name, each in one explicit state.

Every change of a session's state is a method of :class:`SessionTable` (its transitions), made
under the table's lock, so that close, expiry, shard loss and restore never leave a session half
in one state and half in another::

    create:   OPENING --opened--> LIVE            (abandoned: gone, when a shard refused)
    restore:  --------restored--> LIVE
              LIVE --lost--> LOST                 (a shard holding part of it died, or a restore failed)
              LIVE --unloaded--> UNLOADED --reloaded--> LIVE or LOST   (durable, idle)
              LIVE / LOST / UNLOADED --closing--> CLOSING --dropped--> gone   (closed or expired)

Calls find and listing shows the *listed* states (LIVE, LOST, UNLOADED); an OPENING or CLOSING
session is not found, but its name is taken. The memory budget, placement and the tenant's
session count also count OPENING sessions (*held*): creates run at once, each counting the others. A session's last
restore may have rolled it back below what one of its shards logged: that is a fact its status
reports (:attr:`SessionEntry.rolled_back_from`), not a state, since the session is then live,
unloaded or lost like any other.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from typing import Mapping, Optional

from optserve.server.domain.errors import AlreadyExists, NotFound, PermissionDenied
from optserve.server.domain.sessions.session_records import SessionRecord


class SessionState(enum.Enum):
    OPENING = "opening"  # its shards are opening it
    LIVE = "live"  # clients use it
    LOST = "lost"  # every call naming it is refused with why (SessionLost) until its owner closes it
    UNLOADED = "unloaded"  # durable, idle: its shards freed it; the next call naming it loads it back
    CLOSING = "closing"  # its shards are dropping it; its name is free once they did


LISTED = frozenset({SessionState.LIVE, SessionState.LOST, SessionState.UNLOADED})
HELD = LISTED | {SessionState.OPENING}  # what the shards hold or are opening: memory, placement, quota


@dataclasses.dataclass
class SessionEntry:
    """One session in the table.

    Attributes:
      record: its definition and placement.
      state: where it is in its life.
      estimated: shard index -> bytes the session is estimated to hold there (the memory budget).
      why_lost: LOST: the message every call naming it is refused with.
      rolled_back_from: the logged version its last restore rolled it back from (0: none).
    """

    record: SessionRecord
    state: SessionState
    estimated: dict[int, int]
    why_lost: str = ""
    rolled_back_from: int = 0


class SessionTable:
    """The sessions of one coordinator, by name. Thread-safe; every method holds the lock briefly."""

    def __init__(self):
        self._entries: dict[str, SessionEntry] = {}
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)  # notified when an OPENING or CLOSING name settles

    # transitions

    def wait_until_free(self, name: str, closing_s: float, opening_s: float) -> None:
        """Waits up to ``closing_s`` for a CLOSING session of this name to be gone, and up to
        ``opening_s`` for an OPENING one to be opened or abandoned (a create of the same name
        then finds the session, or the name free).

        Raises:
          AlreadyExists: a session of this name exists (or is still closing or opening).
        """
        now = time.monotonic()
        deadlines = {SessionState.OPENING: now + opening_s, SessionState.CLOSING: now + closing_s}
        with self._lock:  # a name can go from CLOSING to OPENING (another create): wait for each in turn
            while (state := self._state(name)) in deadlines and time.monotonic() < deadlines[state]:
                self._settled.wait(deadlines[state] - time.monotonic())
            self._refuse_taken(name)

    def opening(self, record: SessionRecord, estimated: dict[int, int]) -> None:
        """A new session whose shards are opening it (its name is taken from now on).

        Raises:
          AlreadyExists: the name was taken meanwhile (after :meth:`wait_until_free`).
        """
        with self._lock:
            self._refuse_taken(record.config.name)
            self._entries[record.config.name] = SessionEntry(record, SessionState.OPENING, estimated)

    def opened(self, name: str) -> None:
        """OPENING -> LIVE: every shard holds its part."""
        with self._lock:
            if self._state(name) is SessionState.OPENING:
                self._entries[name].state = SessionState.LIVE
            self._settled.notify_all()

    def abandoned(self, name: str) -> None:
        """OPENING -> gone: a shard refused to open it (what the others opened is closed)."""
        with self._lock:
            if self._state(name) is SessionState.OPENING:
                del self._entries[name]
            self._settled.notify_all()

    def restored(self, record: SessionRecord, estimated: dict[int, int]) -> None:
        """A durable session of the catalog, at start: LIVE while its shards restore it."""
        with self._lock:
            self._entries[record.config.name] = SessionEntry(record, SessionState.LIVE, estimated)

    def moved(self, name: str, shard_index: int, address: str) -> Optional[SessionRecord]:
        """A listed session's shard ``shard_index`` now serves at ``address``; returns its record
        (None: the session is gone or closing)."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None or entry.state not in LISTED:
                return None
            entry.record = entry.record.moved(shard_index, address)
            return entry.record

    def lost(self, why: Mapping[str, str]) -> None:
        """LIVE -> LOST, each session of ``why`` with its message (others are left as they are)."""
        with self._lock:
            for name, message in why.items():
                entry = self._entries.get(name)
                if entry is not None and entry.state is SessionState.LIVE:
                    entry.state, entry.why_lost = SessionState.LOST, message

    def rolled_back(self, name: str, logged: int) -> None:
        """The session's restore rolled it back below version ``logged`` (kept for its status)."""
        with self._lock:
            if name in self._entries:
                self._entries[name].rolled_back_from = logged

    def unloaded(self, name: str) -> bool:
        """LIVE -> UNLOADED; False (nothing changed) when the session is not live."""
        return self._move(name, (SessionState.LIVE,), SessionState.UNLOADED)

    def reloaded(self, name: str, why_lost: Optional[str]) -> None:
        """UNLOADED -> LIVE, or LOST with ``why_lost`` when it could not be restored."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is not None and entry.state is SessionState.UNLOADED:
                entry.state = SessionState.LIVE if why_lost is None else SessionState.LOST
                entry.why_lost = why_lost or ""

    def closing(self, name: str, tenant: str) -> None:
        """A listed session of ``tenant`` -> CLOSING (the owner check and the change are one step).

        Raises:
          NotFound, PermissionDenied: as :meth:`owned`.
        """
        with self._lock:
            self._owned_locked(name, tenant).state = SessionState.CLOSING

    def expired(self, activity: Mapping[str, float], now: float, idle_s: float, close: bool) -> list[tuple[str, float]]:
        """The LIVE and LOST sessions idle longer than ``idle_s`` at ``now``, with how long (a
        session without ``activity`` is kept); with ``close`` they are CLOSING from now on."""
        expired = []
        with self._lock:
            for name, entry in self._entries.items():
                last = activity.get(name)
                if entry.state in (SessionState.LIVE, SessionState.LOST) and last is not None and now - last > idle_s:
                    expired.append((name, now - last))
                    if close:
                        entry.state = SessionState.CLOSING
        return expired

    def dropped(self, name: str) -> None:
        """CLOSING -> gone: every shard dropped it; its name is free."""
        with self._lock:
            if self._state(name) is SessionState.CLOSING:
                del self._entries[name]
            self._settled.notify_all()

    # queries

    def owned(self, name: str, tenant: str) -> SessionEntry:
        """The listed session (a copy of its entry), if ``tenant`` owns it.

        Raises:
          NotFound: no listed session of this name.
          PermissionDenied: another tenant's.
        """
        with self._lock:
            return dataclasses.replace(self._owned_locked(name, tenant))

    def entry(self, name: str) -> Optional[SessionEntry]:
        """The session's entry in any state (a copy; None: no such session)."""
        with self._lock:
            entry = self._entries.get(name)
            return dataclasses.replace(entry) if entry is not None else None

    def records(self, tenant: Optional[str] = None) -> dict[str, SessionRecord]:
        """Name -> record of the listed sessions (``tenant``'s only, unless None)."""
        with self._lock:
            return {name: e.record for name, e in self._entries.items()
                    if e.state in LISTED and (tenant is None or e.record.owner == tenant)}

    def state_of(self, name: str) -> Optional[SessionState]:
        """The session's state (None: no such session)."""
        with self._lock:
            return self._state(name)

    def held_by(self, tenant: str) -> int:
        """How many sessions ``tenant`` holds (listed or opening: its quota counts them)."""
        with self._lock:
            return sum(1 for e in self._entries.values() if e.state in HELD and e.record.owner == tenant)

    def why_lost(self, name: str) -> Optional[str]:
        """The message calls naming a LOST session are refused with (None: it is not lost)."""
        with self._lock:
            entry = self._entries.get(name)
            return entry.why_lost if entry is not None and entry.state is SessionState.LOST else None

    def lost_sessions(self) -> dict[str, str]:
        """LOST session -> the message its calls are refused with."""
        with self._lock:
            return {name: e.why_lost for name, e in self._entries.items() if e.state is SessionState.LOST}

    def rolled_back_from(self, name: str) -> int:
        """The logged version the session's last restore rolled it back from (0: none, or no such session)."""
        with self._lock:
            entry = self._entries.get(name)
            return entry.rolled_back_from if entry is not None else 0

    def live_on(self, shard_index: int) -> dict[int, list[str]]:
        """Home shard -> names of the LIVE sessions with tensors on shard ``shard_index``."""
        out: dict[int, list[str]] = {}
        with self._lock:
            for name, entry in self._entries.items():
                if entry.state is SessionState.LIVE and entry.record.on_shard(shard_index):
                    out.setdefault(entry.record.home, []).append(name)
        return out

    def shard_loads(self, num_shards: int) -> list[int]:
        """Parameter bytes each shard holds (or is opening) for the held sessions."""
        loads = [0] * num_shards
        with self._lock:
            for entry in self._entries.values():
                if entry.state in HELD:
                    for a in entry.record.assignments:
                        loads[a.shard_index] += a.param_bytes
        return loads

    def estimated_on(self, shard_index: int) -> int:
        """Bytes the held sessions (listed or opening) are estimated to hold on shard ``shard_index``."""
        with self._lock:
            return sum(e.estimated.get(shard_index, 0) for e in self._entries.values() if e.state in HELD)

    def _state(self, name: str) -> Optional[SessionState]:
        entry = self._entries.get(name)
        return entry.state if entry is not None else None

    def _move(self, name: str, sources: tuple[SessionState, ...], target: SessionState) -> bool:
        with self._lock:
            entry = self._entries.get(name)
            if entry is None or entry.state not in sources:
                return False
            entry.state = target
            return True

    def _refuse_taken(self, name: str) -> None:
        if name in self._entries:
            raise AlreadyExists(f"session {name!r} already exists: attach to it with client.session({name!r}) "
                                f"to go on training it, or end it with client.close_session({name!r}) "
                                f"(`optserve sessions close {name}`) to create it afresh, or pick a new name")

    def _owned_locked(self, name: str, tenant: str) -> SessionEntry:
        entry = self._entries.get(name)
        if entry is None or entry.state not in LISTED:
            raise NotFound(f"session {name!r} not found")
        if entry.record.owner != tenant:
            raise PermissionDenied(f"session {name!r} belongs to another tenant")
        return entry
