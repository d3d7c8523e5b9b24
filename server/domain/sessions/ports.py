"""What the coordinator's sessions are served by: the shard actors (:class:`ShardFleet`) and, on a
durable server, the catalog of sessions' definitions (:class:`SessionCatalog`). The process hosts
implement them (``server/shard_fleet.py`` over Ray, ``server/storage/catalog.py`` on disk)."""

from __future__ import annotations

from typing import Mapping, Optional, Protocol, Sequence

from optserve.server.domain.sessions.session_records import ShardOpening, ShardSummary
from optserve.server.domain.shard import ShardSessionStatus


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

    # hot standbys (--replicas 2)
    replicated: bool  # the shards have standbys

    def has_standby(self, shard_index: int) -> bool: ...

    def start_standbys(self, name: str, openings: Sequence[ShardOpening], only: Optional[int] = None,
                       replace: bool = False) -> list[int]: ...
    # each part's standby (``only``: that shard's) holds it and its primary streams to it from its state now;
    # returns the shards that had no standby then (their parts await one)

    def add_standby(self, shard_index: int) -> None: ...  # a fresh standby for a shard without one

    def promote(self, shard_index: int, names: Sequence[str], timeout_s: float = 30.0) -> dict[str, Optional[str]]: ...
    # the shard's standby serves ``names`` in its dead primary's place (and becomes the shard, at new addresses);
    # session -> None, or why it could not be promoted

    # durable servers only
    def restore_session(self, opening: ShardOpening, upto: Optional[int] = None) -> int: ...  # opens + restores
    # one shard's part (to version ``upto``; None: all it logged); returns its version; raises SessionLost
    def reachable(self, opening: ShardOpening) -> tuple[int, int, str, int, int]: ...  # one shard's part on disk:
    # (checkpoint version, last logged version, checkpoint path, fallback version, fallback reach), nothing
    # loaded; raises SessionLost

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
