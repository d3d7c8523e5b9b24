"""A session's hyperparameter changes, as its home clock orders them among the pushes.

``set_hyperparams`` asks the home clock to change hyperparameters (``{group: {option: value}}``);
the change is *pending* until the clock decides its next ticket, which carries the values in
force from then on (:attr:`~optserve.server.domain.clock.clock_records.Ticket.hyperparams`), so every
shard applies it at the same ticket, between the same two pushes. The step that ticket belongs
to is the first to run with the new values: its version is where the change takes effect.
Asking for values already in force (or already pending) changes nothing: however many workers
ask, a change is applied once. Durable sessions journal each pending change and the tickets
that carry them, so a restart keeps both.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Mapping, Optional

Values = dict  # {group: {option: float}}
MAX_CHANGES_KEPT = 4096  # applied changes a session remembers for its history (a per-step scheduler makes one a step)


@dataclasses.dataclass(frozen=True)
class HyperparamChange:
    """One applied change: from the step producing ``version`` on, ``values`` (``{group:
    {option: value}}``, only what changed) are in force."""

    version: int
    values: dict

    def to_json(self) -> dict:
        return {"version": self.version, "values": self.values}

    @classmethod
    def from_json(cls, data: dict) -> "HyperparamChange":
        return cls(int(data["version"]), _values(data["values"]))


class HyperparamBook:
    """The home clock's record of one session's hyperparameters (not thread-safe: the clock's lock).

    Attributes:
      current: the values set so far that tickets carried (``{group: {option: value}}``; options
        never set are absent: they have the optimizer's own values).
      pending: the values to carry on the next ticket (None: no change waiting).
      changes: every applied change, oldest first.
    """

    def __init__(self) -> None:
        self.current: Values = {}
        self.pending: Optional[Values] = None
        self.pending_since = 0  # the version at which the pending change was asked for
        self.changes: list[HyperparamChange] = []

    def request(self, values: Mapping[str, Mapping[str, float]], version: int) -> tuple[int, bool]:
        """Asks for ``values`` while the session is at ``version``; returns ``(the version from
        which they are in force, whether anything changed)``."""
        base = self.pending if self.pending is not None else self.current
        target = _merged(base, values)
        if target == base:
            return (version + 1 if self.pending is not None else self._since(values)), False
        self.pending, self.pending_since = target, version
        return version + 1, True

    def take(self, target_version: int) -> str:
        """The JSON the next ticket (of the step producing ``target_version``) carries ("" when
        nothing is pending); the pending values become current."""
        if self.pending is None:
            return ""
        self.applied(target_version, self.pending)
        self.pending = None
        return json.dumps(self.current, sort_keys=True)

    def applied(self, version: int, values: Values) -> None:
        """A ticket of the step producing ``version`` carried ``values`` (decided now, or read
        back from the journal)."""
        delta = {group: {o: v for o, v in options.items() if self.current.get(group, {}).get(o) != v}
                 for group, options in values.items()}
        delta = {group: options for group, options in delta.items() if options}
        self.current = _merged(self.current, values)
        if delta:
            self.changes.append(HyperparamChange(version, delta))
            del self.changes[:-MAX_CHANGES_KEPT]

    def settle(self) -> None:
        """A pending change equal to the values in force is none (after a restore)."""
        if self.pending is not None and self.pending == self.current:
            self.pending = None

    def since(self, version: int) -> list[HyperparamChange]:
        """The changes in force from a version after ``version``."""
        return [c for c in self.changes if c.version > version]

    def forget_after(self, version: int) -> None:
        """A restore rolled the session back to ``version``: later changes were never applied
        (their values stay requested: they are pending again)."""
        later = [c for c in self.changes if c.version > version]
        if not later:
            return
        self.changes = [c for c in self.changes if c.version <= version]
        kept: Values = {}
        for change in self.changes:
            kept = _merged(kept, change.values)
        self.pending = _merged(self.pending or self.current, {})
        self.current = kept

    def _since(self, values: Mapping[str, Mapping[str, float]]) -> int:
        """The version from which ``values`` (in force already) have been in force."""
        for change in reversed(self.changes):
            if any(o in change.values.get(g, {}) for g, options in values.items() for o in options):
                return change.version
        return 0

    def to_json(self) -> dict:
        return {"current": self.current, "pending": self.pending, "changes": [c.to_json() for c in self.changes]}

    def restore(self, data: Optional[dict]) -> None:
        data = data or {}
        self.current = _values(data.get("current") or {})
        self.pending = _values(data["pending"]) if data.get("pending") is not None else None
        self.changes = [HyperparamChange.from_json(c) for c in data.get("changes", [])]


def _merged(base: Mapping[str, Mapping[str, float]], values: Mapping[str, Mapping[str, float]]) -> Values:
    merged = {group: dict(options) for group, options in base.items()}
    for group, options in values.items():
        merged.setdefault(group, {}).update({option: float(value) for option, value in options.items()})
    return merged


def _values(data: Mapping) -> Values:
    return {str(g): {str(o): float(v) for o, v in options.items()} for g, options in data.items()}
