"""A session's steps mirrored on a standby (active replication, ``docs/plans/hot_standby.md``).

The primary applies each step as it always does, then hands its standby the step's record (the
tickets, the scale, the cross-shard statistic, the hyperparameters, the tensors without a
gradient: :class:`~optserve.server.domain.durability.StepRecord`) with the gradient the update ran
with: what a durable session writes to its step log. The standby applies the records in version
order as a restore replays a log, with the statistic it was shipped (no peer is asked), so at each
version its parameters and optimizer state equal the primary's bit for bit (one program on one
kind of device). On the home shard the clock's entries (each ticket before it is handed out, the
records of sync rounds, hyperparameter requests, cross-shard sums) go to the standby's clock too.

A step is acknowledged once its standby holds it (:meth:`ReplicaPort.held_future`), beside its
log record when the session is durable.

- :class:`ReplicaPort`: the primary's side (what :class:`~.step_journal.StepJournal` ships to).
- :class:`StandbyFollower`: the standby's side: takes shipped steps, tells which versions it holds
  and applies them in order on a thread of its own.
- :class:`LocalLink`: a port whose standby is in this process.
- :class:`ReplicaStart`: what a fresh standby starts from (its primary's state in memory, not a
  checkpoint on disk); the steps after it are shipped.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from concurrent.futures import Future
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

import numpy as np

from optserve.server.domain.durability import ShardProgress, StepRecord
from optserve.server.domain.errors import OptservError, Unavailable

_log = logging.getLogger(__name__)


class ReplicaGap(Unavailable):
    """A shipped step does not follow the last one the standby holds: a step went missing on the
    way, and the standby is no longer in sync (it is caught up from its primary's state)."""


@dataclasses.dataclass(frozen=True)
class ReplicaStart:
    """What a fresh standby starts from: its primary's state at ``progress.version`` (a step
    boundary; host arrays: on a CPU views of the live state, which later steps leave as they are,
    their buffers copied rather than donated while these are held), and the home clock's (None on
    other shards). The steps after it are shipped."""

    progress: ShardProgress
    params: dict
    opt_state: Any
    clock_state: Optional[dict]


class ReplicaPort(Protocol):
    """Where a primary shard session's steps go. Called with the session's lock held, in step
    order."""

    def ship(self, record: StepRecord, grads: Sequence[np.ndarray]) -> None:
        """Step ``record.version`` was applied with ``grads`` (the shard's tensors in order). The
        arrays may be reused once this returns: what is kept is copied."""

    def held_future(self, version: int) -> Future:
        """Done (result None) once the standby holds step ``version``; failed when it never will."""

    def clock_entry(self, entry) -> None:
        """The home clock's journal entry (a ticket's JSON, ``{"round"}``, ``{"hyper"}``,
        ``{"sum"}``), passed on before the ticket it carries is handed out.

        Raises:
          OSError: the standby cannot take it (the clock then hands nothing out).
        """


class HeldVersions:
    """Futures of step versions, done once a standby holds the version (versions are held in order)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._held = 0
        self._failed: Optional[BaseException] = None
        self._waiting: dict[int, Future] = {}

    @property
    def held(self) -> int:
        """The last version held."""
        return self._held

    def future(self, version: int) -> Future:
        with self._lock:
            if version <= self._held or self._failed is not None:
                return _done(self._failed if version > self._held else None)
            return self._waiting.setdefault(version, Future())

    def hold(self, version: int) -> None:
        """Versions up to ``version`` are held."""
        with self._lock:
            self._held = max(self._held, version)
            done = [v for v in self._waiting if v <= version]
            futures = [self._waiting.pop(v) for v in done]
        for future in futures:
            future.set_result(None)

    def fail(self, error: BaseException) -> None:
        """No later version will be held: their futures fail with ``error``."""
        with self._lock:
            self._failed = error
            futures, self._waiting = list(self._waiting.values()), {}
        for future in futures:
            future.set_exception(error)


def _done(error: Optional[BaseException]) -> Future:
    future = Future()
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
    return future


class StandbyFollower:
    """The standby's side of one session on one shard: shipped steps are held on receipt and
    applied in version order on a thread of its own.

    Args:
      follow: ``(record, grads by name) -> bool`` applies one step to the standby's state
        (``SessionDurability.follow``; False: held already).
      clock: the standby's home clock (its ``follow(entries)``), on the session's home shard; None
        on the others.
      names: the shard's tensors, in the order their gradients are shipped.
      where: how log lines and errors name the session's part ("session 'x' on shard 0").
    """

    def __init__(self, follow: Callable[[StepRecord, Mapping[str, np.ndarray]], bool], clock,
                 names: Sequence[str], where: str):
        self._follow = follow
        self._clock = clock
        self._names = tuple(names)
        self.where = where
        self.held = HeldVersions()
        self.applied = 0  # the last version applied here
        self.error: Optional[OptservError] = None  # why it stopped following (None: it did not)
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._closed = False
        self._thread = threading.Thread(target=self._apply_in_order, name="optserve-standby", daemon=True)
        self._thread.start()

    def receive(self, record: StepRecord, grads: Sequence[np.ndarray]) -> None:
        """A shipped step (``grads``: this follower's own arrays now). Held at once when it follows
        the last one held (a step held already is ignored).

        Raises:
          ReplicaGap: it does not follow the last one held (nothing later is held from then on).
        """
        if len(grads) != len(self._names):
            raise ValueError(f"{self.where}: a shipped step has {len(grads)} gradients for {len(self._names)} tensors")
        with self._cond:
            if self.error is not None:
                raise self.error
            held = self.held.held
            if record.version <= held:
                return
            if record.version != held + 1:  # the steps held so far are still applied
                self._stop(ReplicaGap(f"{self.where}: the standby holds steps up to version {held} and was "
                                      f"shipped version {record.version}"), drop_queued=False)
                raise self.error
            self._queue.append((record, dict(zip(self._names, grads))))
            self._cond.notify_all()
        self.held.hold(record.version)

    def clock_entries(self, entries: list) -> None:
        """The home clock's journal entries, applied to the standby's clock at once (in order)."""
        if self._clock is None:
            raise ValueError(f"{self.where}: clock entries shipped to a shard that is not the session's home")
        self._clock.follow(entries)

    def wait_applied(self, version: int, timeout_s: Optional[float] = None) -> bool:
        """Whether every step up to ``version`` was applied here within ``timeout_s``."""
        with self._cond:
            self._cond.wait_for(lambda: self.applied >= version or (self.error is not None and not self._queue),
                                timeout_s)
            return self.applied >= version

    def promote(self, timeout_s: Optional[float] = None) -> int:
        """The primary is gone and this standby serves the session from now on: every step it
        holds is applied first (those acknowledged among them), then it follows no more. Returns
        the version reached.

        Raises:
          OptservError: the standby stopped following before it applied every step it holds (it
            is not in sync: it must not serve).
          TimeoutError: the steps held were not all applied within ``timeout_s``.
        """
        held = self.held.held
        if not self.wait_applied(held, timeout_s):
            if self.error is not None:
                raise self.error
            raise TimeoutError(f"{self.where}: the standby applied {self.applied} of the {held} steps it holds")
        self.close()
        return self.applied

    def close(self) -> None:
        """Stops applying (steps still queued are dropped)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def _stop(self, error: OptservError, drop_queued: bool = True) -> None:
        """Follows no more (condition held): later steps are neither held nor applied; those
        queued are dropped too with ``drop_queued`` (the state can no longer take them)."""
        self.error = error
        if drop_queued:
            self._queue.clear()
        self._cond.notify_all()
        self.held.fail(error)
        _log.error("event=standby_out_of_sync %s error=%s", self.where, error)

    def _apply_in_order(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed or self.error is not None)
                if self._closed or not self._queue:  # closed, or stopped with nothing left to apply
                    return
                record, grads = self._queue[0]
            try:
                self._follow(record, grads)
            except Exception as exc:  # noqa: BLE001 - its state no longer follows the primary's
                error = exc if isinstance(exc, OptservError) else Unavailable(
                    f"{self.where}: the standby failed applying version {record.version}: {exc!r}")
                with self._cond:
                    self._stop(error)
                return
            with self._cond:
                if self._queue and self._queue[0][0] is record:
                    self._queue.popleft()
                self.applied = record.version
                self._cond.notify_all()


class LocalLink:
    """A :class:`ReplicaPort` whose standby (``follower``) is in this process: shipped gradients are
    copied, entries passed on directly."""

    def __init__(self, follower: StandbyFollower):
        self._follower = follower

    def ship(self, record: StepRecord, grads: Sequence[np.ndarray]) -> None:
        try:
            self._follower.receive(record, [np.array(g, copy=True) for g in grads])
        except OptservError:  # the follower is out of sync: held_future says so to the waiters
            pass

    def held_future(self, version: int) -> Future:
        return self._follower.held.future(version)

    def clock_entry(self, entry) -> None:
        self._follower.clock_entries([entry])
