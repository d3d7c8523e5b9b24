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

from optserve.server.compute.root_offload import RootInstall
from optserve.server.domain.durability import ShardProgress, StepRecord
from optserve.server.domain.errors import AlreadyExists, NotFound, OptservError, Unavailable

_log = logging.getLogger(__name__)


DIGEST_EVERY = 50
"""Every this many versions a shipped step carries its primary's parameters' digest
(:func:`params_digest`), which the standby compares with its own once it applied the step."""


class ReplicaGap(Unavailable):
    """A shipped step does not follow the last one the standby holds: a step went missing on the
    way, and the standby is no longer in sync (it is caught up from its primary's state)."""


class ReplicaDiverged(ReplicaGap):
    """The standby applied a step and its parameters differ from its primary's at that version
    (another program or kind of device, damaged memory): it must never serve in the primary's
    place, and is caught up from the primary's state."""


def params_digest(params: Mapping[str, np.ndarray], names: Sequence[str]) -> int:
    """CRC-32C of the parameters' bytes, tensor after tensor in ``names``' order (host arrays)."""
    from optserve.server.storage.checksums import crc32c_extend

    digest = 0
    for name in names:
        digest = crc32c_extend(digest, np.ascontiguousarray(params[name]).reshape(-1).view(np.uint8))
    return digest


@dataclasses.dataclass(frozen=True)
class StateLeaves:
    """An optimizer state as its leaves in its tree's order (how it crosses a network: the
    standby's own optimizer, built from the same config, gives the tree)."""

    leaves: tuple


@dataclasses.dataclass(frozen=True)
class ReplicaStart:
    """What a fresh standby starts from: its primary's state at ``progress.version`` (a step
    boundary; host arrays: on a CPU views of the live state, which later steps leave as they are,
    their buffers copied rather than donated while these are held; ``opt_state`` a tree, or
    :class:`StateLeaves` from a network), and the home clock's (None on other shards). The steps
    after it are shipped."""

    progress: ShardProgress
    params: dict
    opt_state: Any
    clock_state: Optional[dict]


class ReplicaPort(Protocol):
    """Where a primary shard session's steps go. Called with the session's lock held, in order:
    :meth:`start` first, then steps and clock entries as they come."""

    def start(self, start: ReplicaStart) -> None:
        """The state the standby starts from, before any step or clock entry after it. Called
        under the primary session's lock and its clock's: a port over a network only queues it
        as its stream's first message (it does not wait for the transfer)."""

    def ship(self, record: StepRecord, grads: Sequence[np.ndarray], roots: Sequence[RootInstall] = (),
             digest: Optional[int] = None) -> None:
        """Step ``record.version`` was applied with ``grads`` (the shard's tensors in order), after
        ``roots`` were installed (offloaded matrix roots, oldest first); ``digest``: the
        parameters' :func:`params_digest` after it (every :data:`DIGEST_EVERY` versions, else
        None). The arrays may be reused once this returns: what is kept is copied. Never raises:
        a standby that cannot take the step fails its held futures instead."""

    def held_future(self, version: int) -> Future:
        """Done (result None) once the standby holds step ``version``; failed when it never will."""

    @property
    def started(self) -> bool:
        """Whether the standby said it holds the start (it could serve in the primary's place);
        False again once it holds nothing more."""

    def clock_entry(self, entry) -> None:
        """The home clock's journal entry (a ticket's JSON, ``{"round"}``, ``{"hyper"}``,
        ``{"sum"}``), passed on before the ticket it carries is handed out.

        Raises:
          OSError: the standby cannot take it (it is out of sync from then on; the clock hands
            out nothing the entry carries).
        """


def ship_step(port: ReplicaPort, record: StepRecord, grads: Sequence[np.ndarray], owner) -> None:
    """Ships an applied step to ``port`` with what its standby needs beside the gradient: the
    roots ``owner`` (the part's ``JournalOwner``) installed before it and, every
    :data:`DIGEST_EVERY` versions, its parameters' digest (none for a port awaiting a standby)."""
    due = record.version % DIGEST_EVERY == 0 and not isinstance(port, NoStandby)
    port.ship(record, grads, owner.root_installs(), owner.params_digest() if due else None)


class HeldVersions:
    """Futures of step versions, done once a standby holds the version (versions are held in
    order); once failed, no later version is held."""

    def __init__(self, held: int = 0):
        self._lock = threading.Lock()
        self._held = held
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
        """Versions up to ``version`` are held (nothing, once failed)."""
        with self._lock:
            if self._failed is not None:
                return
            self._held = max(self._held, version)
            futures = [self._waiting.pop(v) for v in [v for v in self._waiting if v <= version]]
        for future in futures:
            future.set_result(None)

    def fail(self, error: BaseException) -> None:
        """No later version will be held: their futures fail with ``error``."""
        with self._lock:
            if self._failed is None:
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


class NoStandby:
    """The port of a replicated part that has one copy in sync and refuses to acknowledge with it
    (``--on-one-replica refuse``) until a fresh standby starts: it holds nothing, so each step
    applied meanwhile waits for that standby (its client's retry is answered once it holds it),
    and a home clock's new ticket is refused once decided (the fresh standby's start holds it).

    Args:
      why: what the refused calls say (UNAVAILABLE), naming the session and shard.
    """

    def __init__(self, why: str):
        self.why = why

    def start(self, start: ReplicaStart) -> None:
        pass

    def ship(self, record: StepRecord, grads: Sequence[np.ndarray], roots: Sequence[RootInstall] = (),
             digest: Optional[int] = None) -> None:
        pass

    def held_future(self, version: int) -> Future:
        return _done(Unavailable(self.why))

    started = False

    def clock_entry(self, entry) -> None:
        raise OSError(self.why)


class StandbyFollower:
    """The standby's side of one session on one shard: it starts from its primary's state, then
    holds shipped steps on receipt and applies them in version order on a thread of its own.

    Args:
      start_from: ``(ReplicaStart) -> None`` installs the primary's state
        (``SessionDurability.start_from``).
      follow: ``(record, grads by name, roots, digest) -> bool`` applies one step to the standby's
        state, the primary's root installs first, and compares the parameters' digest if one came
        (``SessionDurability.follow``; False: held already; raises :class:`ReplicaDiverged`).
      clock: the standby's home clock (its ``follow(entries)``, ``set_following(bool)``), on the
        session's home shard; None on the others.
      names: the shard's tensors, in the order their gradients are shipped.
      where: how log lines and errors name the session's part ("session 'x' on shard 0").
    """

    def __init__(self, start_from: Callable[[ReplicaStart], None],
                 follow: Callable[[StepRecord, Mapping[str, np.ndarray]], bool], clock, names: Sequence[str],
                 where: str):
        self._start_from = start_from
        self._follow = follow
        self._clock = clock
        self._names = tuple(names)
        self.where = where
        self.held = HeldVersions()
        self.applied = 0  # the last version applied here
        self.error: Optional[OptservError] = None  # why it stopped following (None: it did not)
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._started = False
        self._promoting = False  # being promoted: nothing more is held (promote may be asked again)
        self._stopping = False  # promoted or closed: nothing more is held
        self._closed = False
        self._thread = threading.Thread(target=self._apply_in_order, name="optserve-standby", daemon=True)
        self._thread.start()

    def start(self, start: ReplicaStart) -> None:
        """Installs the primary's state (its clock's too, which follows, passive, from now on)."""
        with self._cond:
            self._check_following()
            if self._started:
                raise ValueError(f"{self.where}: the standby was started already")
            self._start_from(start)
            if self._clock is not None:
                self._clock.set_following(True)
            self.held = HeldVersions(start.progress.version)
            self.applied = start.progress.version
            self._started = True

    @property
    def started(self) -> bool:
        """Whether it holds its primary's start and still follows."""
        with self._cond:
            return self._started and self.error is None and not self._stopping

    def receive(self, record: StepRecord, grads: Sequence[np.ndarray], roots: Sequence[RootInstall] = (),
                digest: Optional[int] = None) -> None:
        """A shipped step (``grads`` and ``roots``, the roots its primary installed before it: this
        follower's own arrays now; ``digest``: see :meth:`ReplicaPort.ship`). Held at once when it
        follows the last one held (a step held already is ignored).

        Raises:
          ReplicaGap: it does not follow the last one held, or came before the start (nothing
            later is held from then on).
          Unavailable: the standby follows no more (it stopped, was promoted or closed).
        """
        with self._cond:
            self._check_following()
            held = self.held.held
            if record.version <= held:
                return
            if not self._started or record.version != held + 1 or len(grads) != len(self._names):
                self._stop(ReplicaGap(f"{self.where}: the standby holds steps up to version {held} "
                                      f"({'started' if self._started else 'not started'}) and was shipped version "
                                      f"{record.version} with {len(grads)} of {len(self._names)} gradients"),
                           drop_queued=False)  # the steps held so far are still applied
                raise self.error
            self._queue.append((record, dict(zip(self._names, grads)), tuple(roots), digest))
            self.held.hold(record.version)
            self._cond.notify_all()

    def clock_entries(self, entries: list) -> None:
        """The home clock's journal entries, applied to the standby's clock at once (in order).

        Raises:
          ReplicaGap / Unavailable: as :meth:`receive`; also a ticket that does not follow the
            clock's last one.
        """
        with self._cond:
            self._check_following()
            try:
                if self._clock is None or not self._started:
                    raise ReplicaGap(f"{self.where}: clock entries shipped to a standby that is not started or not "
                                     f"the session's home")
                self._clock.follow(entries)
            except Exception as exc:  # noqa: BLE001 - an entry it could not book: out of sync from now on
                error = exc if isinstance(exc, OptservError) else Unavailable(
                    f"{self.where}: the standby's clock could not book an entry: {exc!r}")
                self._stop(error, drop_queued=False)
                raise error from None

    def _check_following(self) -> None:
        """Raises why the standby takes nothing more (condition held)."""
        if self.error is not None:
            raise self.error
        if self._stopping or self._promoting:
            raise Unavailable(f"{self.where}: the standby follows its primary no more (promoted or closed)")

    def wait_applied(self, version: int, timeout_s: Optional[float] = None) -> bool:
        """Whether every step up to ``version`` was applied here within ``timeout_s``."""
        with self._cond:
            self._cond.wait_for(lambda: self.applied >= version or (self.error is not None and not self._queue),
                                timeout_s)
            return self.applied >= version

    def promote(self, timeout_s: Optional[float] = None) -> int:
        """The primary is gone and this standby serves the session from now on: it takes nothing
        more, applies every step it holds (those acknowledged among them), and its clock decides
        again. Returns the version reached.

        Raises:
          OptservError: the standby stopped following (it is not in sync: it must not serve).
          TimeoutError: the steps held were not all applied within ``timeout_s``.
        """
        with self._cond:
            if self.error is not None:
                raise self.error
            if self._stopping:
                raise Unavailable(f"{self.where}: the standby was closed")
            if not self._started:
                raise ReplicaGap(f"{self.where}: the standby was never started")
            self._promoting = True  # asked again after a timeout, it goes on from here
            held = self.held.held
        if not self.wait_applied(held, timeout_s):
            if self.error is not None:
                raise self.error
            raise TimeoutError(f"{self.where}: the standby applied {self.applied} of the {held} steps it holds")
        self.close()
        if self._clock is not None:
            self._clock.set_following(False)
        return self.applied

    def close(self) -> None:
        """Stops following: nothing more is held (waiters for later steps fail), steps still queued
        are dropped."""
        with self._cond:
            self._stopping = self._closed = True
            self._cond.notify_all()
        self.held.fail(Unavailable(f"{self.where}: the standby was closed"))
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
                record, grads, roots, digest = self._queue[0]
            try:
                self._follow(record, grads, roots, digest)
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
    copied, the start and the entries passed on directly."""

    def __init__(self, follower: StandbyFollower):
        self._follower = follower

    def start(self, start: ReplicaStart) -> None:
        self._follower.start(start)

    def ship(self, record: StepRecord, grads: Sequence[np.ndarray], roots: Sequence[RootInstall] = (),
             digest: Optional[int] = None) -> None:
        try:
            self._follower.receive(record, [np.array(g, copy=True) for g in grads], roots, digest)
        except Exception as exc:  # noqa: BLE001 - out of sync: held_future says so to the waiters
            self._follower.held.fail(exc)

    def held_future(self, version: int) -> Future:
        return self._follower.held.future(version)

    @property
    def started(self) -> bool:
        return self._follower.started

    def clock_entry(self, entry) -> None:
        try:
            self._follower.clock_entries([entry])
        except Exception as exc:  # noqa: BLE001 - the clock hands out nothing the entry carries
            raise OSError(f"the standby cannot take the clock's entry: {exc}") from exc


class Standbys:
    """The session parts a shard process is a standby for (thread-safe): name -> (its shard
    session, not served to clients, and the follower that keeps it in step), until promoted or
    closed."""

    def __init__(self):
        self._lock = threading.Lock()
        self._parts: dict[str, tuple[Any, StandbyFollower]] = {}

    def add(self, name: str, session, follower: StandbyFollower) -> None:
        """Raises AlreadyExists when this process is ``name``'s standby already."""
        with self._lock:
            if name in self._parts:
                raise AlreadyExists(f"session {name!r} has a standby on this shard already")
            self._parts[name] = (session, follower)

    def follower(self, name: str) -> StandbyFollower:
        """Raises NotFound when this process is no standby of ``name``."""
        with self._lock:
            part = self._parts.get(name)
        if part is None:
            raise NotFound(f"session {name!r} has no standby on this shard")
        return part[1]

    def take(self, name: str) -> tuple[Any, StandbyFollower]:
        """``(session, follower)`` of ``name``, no longer a standby's here (NotFound: none)."""
        with self._lock:
            part = self._parts.pop(name, None)
        if part is None:
            raise NotFound(f"session {name!r} has no standby on this shard")
        return part

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._parts)

