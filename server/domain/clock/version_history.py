"""The record of each version a session's clock decided, in every mode: what ``Session.history``
answers and what replays a run.

A version's :class:`~optserve.protos.status_records.RoundRecord` lists the pushes its update
applied, in ticket order: each one's worker and client id, sequence number, staleness (so its base
version) and scale as the step used it. Sync sessions (plain and elastic) get one record per round,
async sessions one per applied push. The record is built from the tickets the clock decided
(:class:`OpenStep`), so it says exactly what every shard applied.

Where it is kept: by the session's clock on its home shard (:class:`VersionHistory`: the latest
:data:`MAX_VERSIONS_KEPT` versions, as rows of typed columns rather than objects; older ones are
forgotten, so a reader keeps up by asking with ``since``). Durable sessions keep it across a
restart: it is part of the clock state each checkpoint saves, and the versions after a checkpoint
are rebuilt from the ticket journal: an async record, or a sync step's of one push, is a function of
its tickets alone (the journal holds each ticket with its staleness and scale), and the record of a
sync round of several pushes or of an elastic round, whose duration and closing reason no ticket
holds, is journaled beside the ticket that closes it (see
:class:`~optserve.server.domain.clock.home_clock.HomeClock`).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Iterable, Optional, Sequence

from optserve.protos.status_records import RoundRecord
from optserve.server.domain.clock.clock_records import Ticket
from optserve.server.domain.clock.columns import Columns
from optserve.server.domain.config import worker_of

MAX_VERSIONS_KEPT = 4096  # versions whose record a session's clock keeps (as its tickets and hyperparameter changes)


def round_record(version: int, tickets: Sequence[Ticket], closed_by: str, duration_s: float,
                 late: Iterable[str] = ()) -> RoundRecord:
    """The record of ``version``, whose update applied the pushes of ``tickets`` (in order; a
    push-less round closer is no push)."""
    pushes = [t for t in tickets if not t.closes_round]
    # a history holds thousands of records naming the same few clients: one string object each
    clients = tuple(sys.intern(t.client_id) for t in pushes)
    return RoundRecord(version, tuple(sys.intern(worker_of(c)) for c in clients), tuple(t.scale for t in pushes),
                       tuple(late), duration_s, closed_by, clients,
                       tuple(t.sequence for t in pushes), tuple(t.staleness for t in pushes))


@dataclasses.dataclass
class OpenStep:
    """The pushes decided into the step that has not closed yet (``first_at``: when the first
    was, ``time.monotonic()`` seconds)."""

    tickets: list = dataclasses.field(default_factory=list)
    first_at: Optional[float] = None

    def add(self, ticket: Ticket, now: float) -> None:
        if self.first_at is None:
            self.first_at = now
        self.tickets.append(ticket)

    @property
    def workers(self) -> list[str]:
        """The workers that pushed into it, in ticket order."""
        return [worker_of(t.client_id) for t in self.tickets]

    def close(self, version: int, closed_by: str, now: float, late: Iterable[str] = ()) -> RoundRecord:
        """The step closed as ``version``: its record (and the next step opens empty)."""
        record = round_record(version, self.tickets, closed_by, now - (self.first_at if self.first_at is not None
                                                                        else now), late)
        self.tickets, self.first_at = [], None
        return record


_WHOLE, _NO_PUSH_IDS, _AS_OBJECT = 0, 1, 2  # how a version's record is kept (see VersionHistory)
_VERSION, _DURATION, _CLOSED_BY, _LATE, _KIND, _FIRST_PUSH = range(6)  # a version's fields
_PARTICIPANT, _CLIENT, _SEQUENCE, _STALENESS, _SCALE = range(5)  # a push's fields


class VersionHistory:
    """The records of a session's latest versions, in version order (not thread-safe: the session
    clock calls it under its lock). ``keep``: how many versions it holds.

    Records are kept as rows of :class:`~optserve.server.domain.clock.columns.Columns`, not as
    objects: one row per version (its version, duration, closing reason, late workers and where
    its pushes start) and one per push (worker, client, sequence, staleness, scale); a record is
    built when asked for. A record whose per-push fields do not all have one entry per push
    (written before clients were recorded: no clients, sequences or staleness) keeps that shape;
    any other shape is kept as the object itself.
    """

    def __init__(self, keep: int = MAX_VERSIONS_KEPT):
        self._keep = keep
        self._versions = Columns("qdOOBq")
        self._pushes = Columns("OOqqd")
        self._pushes_dropped = 0  # pushes forgotten from the front (a version's first push counts them)
        self._objects: dict[int, RoundRecord] = {}  # version -> record kept whole (_AS_OBJECT)

    def __len__(self) -> int:
        return len(self._versions)

    def keep(self, record: RoundRecord) -> None:
        """Files ``record`` in version order, replacing one of the same version (a journaled
        record is exact where one rebuilt from tickets lacks timings); the oldest beyond the
        bound are forgotten."""
        count = len(self._versions)
        if not count or self._versions.value(_VERSION, count - 1) < record.version:
            self._append(record)
        elif count >= self._keep and record.version < self._versions.value(_VERSION, 0):
            return  # older than every version kept, and none is forgotten for it
        else:
            at = self._versions.find(_VERSION, record.version)
            if not (at < count and self._versions.value(_VERSION, at) == record.version and self._replace(at, record)):
                later = [r for r in self._records(at) if r.version != record.version]
                self._forget_from(at)
                for kept in [record] + later:
                    self._append(kept)
        self._forget_first(len(self._versions) - self._keep)

    def _append(self, record: RoundRecord) -> None:
        """Adds ``record`` after the last version (as the object itself where a value does not
        fit the rows' fields)."""
        kind, first_push = _shape_of(record), self._pushes_dropped + len(self._pushes)
        if kind != _AS_OBJECT:
            try:
                for row in _push_rows(record, kind):
                    self._pushes.append(row)
                self._versions.append(self._version_row(record, kind, first_push))
                return
            except (OverflowError, TypeError, ValueError):
                self._pushes.keep_first(first_push - self._pushes_dropped)
        self._versions.append(self._version_row(record, _AS_OBJECT, first_push))
        self._objects[record.version] = record

    def _replace(self, at: int, record: RoundRecord) -> bool:
        """Puts ``record`` in place of the one at index ``at`` when it has as many pushes and
        neither is kept whole; returns whether it did."""
        kind, first_push = _shape_of(record), self._versions.value(_FIRST_PUSH, at)
        rows = _push_rows(record, kind)
        if kind == _AS_OBJECT or self._versions.value(_KIND, at) == _AS_OBJECT \
                or self._push_end(at) - first_push != len(rows) \
                or not (self._versions.fits(self._version_row(record, kind, first_push))
                        and all(map(self._pushes.fits, rows))):
            return False
        self._versions.replace(at, self._version_row(record, kind, first_push))
        for offset, row in enumerate(rows):
            self._pushes.replace(first_push - self._pushes_dropped + offset, row)
        return True

    @staticmethod
    def _version_row(record: RoundRecord, kind: int, first_push: int) -> tuple:
        return (record.version, record.duration_s, sys.intern(record.closed_by), tuple(record.late), kind, first_push)

    def _push_end(self, at: int) -> int:
        """One past the last push of the version at index ``at`` (counted as first_push is)."""
        return (self._versions.value(_FIRST_PUSH, at + 1) if at + 1 < len(self._versions)
                else self._pushes_dropped + len(self._pushes))

    def _forget_first(self, count: int) -> None:
        """Forgets the ``count`` oldest versions (and their pushes)."""
        if count <= 0:
            return
        for index in range(min(count, len(self._versions))):
            if self._versions.value(_KIND, index) == _AS_OBJECT:
                del self._objects[self._versions.value(_VERSION, index)]
        self._versions.drop_first(count)
        first_push = (self._versions.value(_FIRST_PUSH, 0) if len(self._versions)
                      else self._pushes_dropped + len(self._pushes))
        self._pushes.drop_first(first_push - self._pushes_dropped)
        self._pushes_dropped = first_push

    def _clear(self) -> None:
        self._forget_from(0)

    def _records(self, first: int) -> list[RoundRecord]:
        """The records from index ``first`` on, oldest first."""
        return self.view(first).records()

    def view(self, first: int) -> "HistoryView":
        """A copy of the rows from index ``first`` on, whose records are built without the lock."""
        versions = self._versions.columns(first)
        base = versions[_FIRST_PUSH][0] if versions[0] else self._pushes_dropped + len(self._pushes)
        objects = {v: self._objects[v] for v, k in zip(versions[_VERSION], versions[_KIND]) if k == _AS_OBJECT}
        return HistoryView(versions, self._pushes.columns(base - self._pushes_dropped), base, objects)

    def view_since(self, version: int) -> "HistoryView":
        """:meth:`view` of the versions after ``version`` (see :meth:`since`)."""
        return self.view(self._versions.find(_VERSION, version, after=True))

    @property
    def latest(self) -> Optional[RoundRecord]:
        return self._records(len(self._versions) - 1)[0] if len(self._versions) else None

    def forget_after(self, version: int) -> None:
        """A restore rolled the session back to ``version``: later records go."""
        self._forget_from(self._versions.find(_VERSION, version, after=True))

    def _forget_from(self, first_gone: int) -> None:
        """Forgets the versions from index ``first_gone`` on (and their pushes)."""
        if first_gone >= len(self._versions):
            return
        for index in range(first_gone, len(self._versions)):
            if self._versions.value(_KIND, index) == _AS_OBJECT:
                del self._objects[self._versions.value(_VERSION, index)]
        self._pushes.keep_first(self._versions.value(_FIRST_PUSH, first_gone) - self._pushes_dropped)
        self._versions.keep_first(first_gone)

    def since(self, version: int) -> list[RoundRecord]:
        """The records of the versions after ``version``, oldest first."""
        return self.view_since(version).records()

    def to_json(self) -> list:
        return self.view(0).to_json()

    def restore(self, data: Iterable[dict]) -> None:
        """Takes back the records of :meth:`to_json`."""
        self._clear()
        for record in data:
            self.keep(RoundRecord.from_json(record))


def _shape_of(record: RoundRecord) -> int:
    """Whether ``record``'s per-push fields fit the rows: all of them one entry per push
    (``_WHOLE``), only workers and scales (``_NO_PUSH_IDS``), or neither (``_AS_OBJECT``)."""
    pushes = len(record.participants)
    per_push = (record.clients, record.sequences, record.staleness)
    if len(record.scales) != pushes:
        return _AS_OBJECT
    if all(len(field) == pushes for field in per_push):
        return _WHOLE
    return _NO_PUSH_IDS if not any(per_push) else _AS_OBJECT


def _push_rows(record: RoundRecord, kind: int) -> list[tuple]:
    """The rows of ``record``'s pushes (none for a record kept whole)."""
    if kind == _AS_OBJECT:
        return []
    whole = kind == _WHOLE
    return [(sys.intern(record.participants[i]), sys.intern(record.clients[i]) if whole else "",
             record.sequences[i] if whole else 0, record.staleness[i] if whole else 0, record.scales[i])
            for i in range(len(record.participants))]


class HistoryView:
    """Rows of a :class:`VersionHistory` copied under the clock's lock, whose records are built
    after it is released (``versions`` / ``pushes``: the fields as lists; ``base``: the first
    push's number; ``objects``: the records kept whole, by version)."""

    def __init__(self, versions: list[list], pushes: list[list], base: int, objects: dict[int, RoundRecord]):
        self._versions = versions
        self._pushes = pushes
        self._base = base
        self._objects = objects

    def records(self) -> list[RoundRecord]:
        """The records, oldest first."""
        versions, durations, closed_by, lates, kinds, firsts = self._versions
        participants, clients, sequences, staleness, scales = self._pushes
        starts = [first - self._base for first in firsts]
        records = []
        for i, (version, duration_s, closed, late, kind, start) in enumerate(
                zip(versions, durations, closed_by, lates, kinds, starts)):
            if kind == _AS_OBJECT:
                records.append(self._objects[version])
                continue
            end = starts[i + 1] if i + 1 < len(starts) else len(participants)
            whole = kind == _WHOLE
            records.append(RoundRecord(version, tuple(participants[start:end]), tuple(scales[start:end]), late,
                                       duration_s, closed, tuple(clients[start:end]) if whole else (),
                                       tuple(sequences[start:end]) if whole else (),
                                       tuple(staleness[start:end]) if whole else ()))
        return records

    def to_json(self) -> list:
        return [r.to_json() for r in self.records()]
