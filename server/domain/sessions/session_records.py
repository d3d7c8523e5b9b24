"""What the coordinator knows of a session and hands to its shards, as plain records.

A :class:`SessionRecord` is a session's definition and its placement (one :class:`Assignment`
per shard holding tensors of it, the home shard first). From it come, each built in one place:
the :class:`ShardOpening` each of its shards opens it with (:meth:`SessionRecord.openings`) and
its memory estimate per shard (:meth:`SessionRecord.estimated_bytes`). The other records cross
from the coordinator to the wire (:class:`SessionStatus`, :class:`ShardSummary`) or from the wire
to the coordinator (:class:`AttachExpectation`).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Optional, Sequence

from optserve.server.compute.devices import DeviceReport
from optserve.server.domain.clock import ClockStatus
from optserve.server.domain.config import Mode, PreconditionerOptions, SessionConfig
from optserve.server.domain.sessions.memory_estimate import MemoryEstimate, estimate
from optserve.server.domain.shard import ShardSessionStatus


@dataclasses.dataclass(frozen=True)
class Assignment:
    """Tensors of one session on one shard.

    Attributes:
      shard_index: the shard.
      address: its data-plane "host:port" (changes when the shard is restarted elsewhere).
      tensor_names: the session's tensors it holds.
      param_bytes: their parameter bytes, as stored.
    """

    shard_index: int
    address: str
    tensor_names: tuple[str, ...]
    param_bytes: int


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
      memory_left: bytes of the shard's memory budget left beyond this part's estimate (the
        shard refuses the part if its step's working memory, measured by compiling it, needs
        more); None: not checked (a restore).
    """

    shard_index: int
    config: SessionConfig
    tensor_names: tuple[str, ...]
    participants: int
    home_clock: Optional[str]
    owner: str = ""
    creator: str = ""
    memory_left: Optional[int] = None


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

    @classmethod
    def placed(cls, config: SessionConfig, placement: Iterable[tuple[int, Sequence[str]]], addresses: Sequence[str],
               owner: str = "", creator: str = "") -> "SessionRecord":
        """The record of ``config`` placed as ``placement``: ``(shard index, tensor names)`` pairs
        in assignment order (home shard first, shards holding nothing left out), each shard at
        ``addresses[shard index]``."""
        by_name = config.spec_by_name
        return cls(config, tuple(Assignment(i, addresses[i], tuple(names), sum(by_name[n].nbytes for n in names))
                                 for i, names in placement), owner, creator)

    def to_json(self) -> dict:
        """The catalog entry of a durable session (addresses left out: they change at restarts)."""
        return {"config": self.config.to_json(), "owner": self.owner, "creator": self.creator,
                "placement": {str(a.shard_index): list(a.tensor_names) for a in self.assignments}}

    @property
    def home(self) -> int:
        """The home shard's index (it keeps the session's clock)."""
        return self.assignments[0].shard_index

    def on_shard(self, shard_index: int) -> bool:
        return any(a.shard_index == shard_index for a in self.assignments)

    def moved(self, shard_index: int, address: str) -> "SessionRecord":
        """The record with shard ``shard_index`` serving at ``address``."""
        return dataclasses.replace(self, assignments=tuple(
            dataclasses.replace(a, address=address) if a.shard_index == shard_index else a for a in self.assignments))

    def openings(self, clock_addresses: Sequence[str],
                 memory_left: Optional[Mapping[int, int]] = None) -> list[ShardOpening]:
        """What each of its shards opens it with (in assignment order); ``clock_addresses`` are
        the shards' clock endpoints by shard index (the home shard's is where the others vote);
        ``memory_left``: shard index -> :attr:`ShardOpening.memory_left` (None: unchecked)."""
        home_clock = clock_addresses[self.home]
        left = memory_left or {}
        return [ShardOpening(a.shard_index, self.config, a.tensor_names, len(self.assignments),
                             None if a.shard_index == self.home else home_clock, self.owner, self.creator,
                             left.get(a.shard_index))
                for a in self.assignments]

    def memory_estimates(self, workers: bool) -> dict[int, MemoryEstimate]:
        """Shard index -> what its part is estimated to hold (what the memory budget counts);
        ``workers``: the server has preconditioner workers (see :func:`estimate`)."""
        return {a.shard_index: estimate(self.config, a.tensor_names, workers) for a in self.assignments}

    def estimated_bytes(self, workers: bool) -> dict[int, int]:
        """Shard index -> the total of :meth:`memory_estimates`."""
        return {index: found.total for index, found in self.memory_estimates(workers).items()}


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
class StandbySummary:
    """A shard's hot standby as the server sees it now: its Ray node, whether it answered, and
    how many of the shard's sessions it holds in sync (every acknowledged step), of the
    ``replicated`` ones kept with a standby (a session may ask for one copy)."""

    node_id: str = ""
    healthy: bool = False
    in_sync: int = 0
    replicated: int = 0


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
    device: Optional[DeviceReport] = None  # where its JAX runs; None: it did not answer
    standby: Optional["StandbySummary"] = None  # --replicas 2: its hot standby (None: it has none)

    def seen_by(self, owned: Sequence[SessionRecord]) -> "ShardSummary":
        """This shard as the tenant whose sessions are ``owned`` may see it: their count and
        parameter bytes only, and no process memory (shared with the other tenants)."""
        mine = [a for r in owned for a in r.assignments if a.shard_index == self.index]
        return dataclasses.replace(self, sessions=len(mine), param_bytes=sum(a.param_bytes for a in mine),
                                   resident_bytes=0)
