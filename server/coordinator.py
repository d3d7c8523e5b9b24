"""Domain layer of the coordinator: sessions, placement, and the shard actors behind them.

The coordinator never sees tensor values: it validates a session's configuration, places its
tensors (:func:`~optserve.server.placement.place_tensors`), creates the per-shard state over Ray
and answers with the shard map; clients then talk to the shards directly.
"""

from __future__ import annotations

import dataclasses
import threading

from optserve.server.config import SessionConfig
from optserve.server.errors import AlreadyExists, NotFound, unwrap
from optserve.server.placement import place_tensors


@dataclasses.dataclass(frozen=True)
class Assignment:
    """Tensors of one session on one shard."""

    shard_index: int
    address: str
    tensor_names: tuple[str, ...]
    param_bytes: int


@dataclasses.dataclass(frozen=True)
class SessionRecord:
    config: SessionConfig
    assignments: tuple[Assignment, ...]


class Coordinator:
    """Sessions on one server.

    Args:
      shards: shard actor handles, index = position.
      addresses: their data-plane addresses ("host:port").
      clock_addresses: their clock endpoints' addresses (a session's clock lives in its home
        shard, the first of its shard map; :mod:`optserve.server.clock`).
      min_shard_bytes: see :func:`~optserve.server.placement.place_tensors`.
    """

    def __init__(self, shards: list, addresses: list[str], clock_addresses: list[str], *, min_shard_bytes: int = 0):
        self._shards = shards
        self._min_shard_bytes = min_shard_bytes
        self._addresses = addresses
        self._clock_addresses = clock_addresses
        self._sessions: dict[str, SessionRecord] = {}
        self._lock = threading.Lock()

    def create_session(self, config: SessionConfig) -> SessionRecord:
        config.validate_optimizer()
        with self._lock:
            if config.name in self._sessions:
                raise AlreadyExists(f"session {config.name!r} already exists")
            placement = place_tensors(config.tensors, len(self._shards), min_shard_bytes=self._min_shard_bytes,
                                      shard_loads=self._shard_loads_locked())
            by_name = config.spec_by_name
            assignments = tuple(
                Assignment(i, self._addresses[i], tuple(names), sum(by_name[n].nbytes for n in names))
                for i, names in enumerate(placement)
                if names
            )
            home = assignments[0].shard_index
            try:
                _ray_get([
                    self._shards[a.shard_index].create_session.remote(
                        config, list(a.tensor_names), len(assignments),
                        None if a.shard_index == home else self._clock_addresses[home])
                    for a in assignments
                ])
            except BaseException:
                self._close_everywhere(config.name)
                raise
            record = SessionRecord(config, assignments)
            self._sessions[config.name] = record
            return record

    def _shard_loads_locked(self) -> list[int]:
        """Parameter bytes each shard holds for the open sessions."""
        loads = [0] * len(self._shards)
        for record in self._sessions.values():
            for a in record.assignments:
                loads[a.shard_index] += a.param_bytes
        return loads

    def get_session(self, name: str) -> SessionRecord:
        with self._lock:
            record = self._sessions.get(name)
        if record is None:
            raise NotFound(f"session {name!r} not found")
        return record

    def list_sessions(self) -> list[str]:
        with self._lock:
            return sorted(self._sessions)

    def close_session(self, name: str) -> None:
        with self._lock:
            if self._sessions.pop(name, None) is None:
                raise NotFound(f"session {name!r} not found")
        self._close_everywhere(name)

    def _close_everywhere(self, name: str) -> None:
        import ray

        ray.get([s.close_session.remote(name) for s in self._shards])

    def status(self, name: str) -> tuple[SessionRecord, dict, list[dict]]:
        """(record, clock status {version, accepted, stale}, per-assignment shard status)."""
        record = self.get_session(name)
        shards = _ray_get([self._shards[a.shard_index].session_status.remote(name) for a in record.assignments])
        return record, shards[0]["clock"], shards  # the home shard's clock


def _ray_get(refs):
    import ray

    try:
        return ray.get(refs)
    except Exception as exc:  # re-raise the domain error inside a RayTaskError
        raise unwrap(exc) from None
