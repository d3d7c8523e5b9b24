"""One session on one shard: staging, idempotency, ticket order, sync averaging, rejections.

A push arrives as chunks; :meth:`ShardSession.push` assembles and validates them into pooled
buffers, stages them under the push's identity ``(client_id, sequence)`` and, with
``auto_commit``, votes at the session clock with the session's other shards. The clock issues a
*ticket* only when every shard staged its part; tickets are applied strictly in ordinal order
(so every shard applies the same pushes in the same order), and the updater
(:mod:`optserve.server.compute.updater`) runs the step. The client-driven two-phase path
(``stage`` then ``commit`` / ``abort``) reaches the same tickets without the vote.

Idempotency: a shard remembers each client's last applied sequence; a retry of an applied push
is answered from the clock's ticket and applies nothing twice.

A push staged for the two-phase path and never committed or aborted expires after
``staged_push_ttl_s``: checked lazily, when the session next receives a push or a commit (or is
asked for its status), so expiry costs no thread or timer.

Every push the shard refuses or drops is logged once (logger ``__name__``, INFO, ``key=value``:
``event=push_refused session=... shard=... client=... sequence=... reason=...``); never values.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Optional

import numpy as np

from optserve.server.compute.buffers import IO_ALIGNMENT, BufferPool, aligned_empty
from optserve.server.compute.updater import Updater
from optserve.server.domain.assembly import TensorAssembler
from optserve.server.domain.clock import ClockStatus, Ticket
from optserve.server.domain.config import Limits, Mode, SessionConfig, TensorSpec
from optserve.server.domain.durability import DurabilityStatus, SessionStore, ShardProgress, StepRecord
from optserve.server.domain.telemetry import SessionSeries, Telemetry
from optserve.server.domain.errors import (Cancelled, FailedPrecondition, InvalidArgument, NonFinite, NotFound,
                                           OptservError, PeerRefused, PermissionDenied, RejectReason, Stale, Timeout,
                                           Unavailable)

_log = logging.getLogger(__name__)

_GAP_POLL_S = 0.25
_ANSWER_MARGIN_S = 1.0  # a wait bounded by the caller's deadline ends this much earlier, to answer in time
_KEEP_EXPIRED = 1024  # expired staged pushes remembered (for a later Commit's message)


@dataclasses.dataclass(frozen=True)
class PushHeader:
    """Who pushes what: the push's identity and the version its gradients were computed from.

    Attributes:
      client_id: the pushing client (non-empty).
      sequence: the client's push number (>= 0); a retry reuses it.
      base_version: the session version the gradients were computed from.
      auto_commit: the shards commit among themselves once all staged (else the client commits).
      telemetry: the loss and scalars the client attached (kept in the session's series).
    """

    client_id: str
    sequence: int
    base_version: int
    auto_commit: bool = True
    telemetry: Telemetry = Telemetry()

    def validate(self) -> None:
        """Raises InvalidArgument naming what is wrong (called inside the push, so a bad header
        is a refusal that the session's other shards hear of)."""
        self.telemetry.validate()
        if not self.client_id:
            raise InvalidArgument("push header: client_id must be non-empty")
        if self.sequence < 0:
            raise InvalidArgument(f"push header: sequence must be >= 0, got {self.sequence}")


@dataclasses.dataclass(frozen=True)
class Receipt:
    """What a push came to on this shard.

    Attributes:
      version: after an applied push, the version of its step; otherwise the shard's version.
      already_applied: the push had been applied before (a retry): nothing was staged.
      committed: the push is applied (its step is complete on this shard).
      staleness / scale: the clock's decision (0 / 1.0 unless async).
      durable: returns once the push's step is in the step log (durable sessions; the answer that
        acknowledges the push waits for it, so nothing acknowledged can be lost). Raises if the
        log could not be written.
    """

    version: int
    already_applied: bool
    committed: bool
    staleness: int = 0
    scale: float = 1.0
    durable: Callable[[], None] = lambda: None


@dataclasses.dataclass(frozen=True)
class ShardSessionStatus:
    """A session on one shard.

    Attributes:
      version: steps applied on this shard.
      initialized: initial parameters received.
      rejected: pushes this shard refused, by reason.
      device: the JAX device holding the tensors.
      clock: the session clock's status (its home shard only, else None).
      preconditioners: Shampoo's root status on this shard (else None).
      node_id: the Ray node the shard runs on (set by the shard actor).
      state_bytes: bytes of the optimizer state this shard holds for the session.
      durability: durable sessions: checkpoint and log status on this shard (else None).
      last_activity_unix_s: when a client last pushed, committed, pulled or sent initial values
        on this shard (else when the session was opened here).
    """

    version: int
    initialized: bool
    rejected: Mapping[RejectReason, int]
    device: str
    clock: Optional[ClockStatus]
    preconditioners: Any = None
    node_id: str = ""
    state_bytes: int = 0
    durability: Optional[DurabilityStatus] = None
    last_activity_unix_s: float = 0.0


class StepObserver:
    """What a shard session reports as it works; the process host plugs in its metrics. The
    methods here do nothing (the default)."""

    def received(self, nbytes: int) -> None:
        """A push's tensor bytes were received and validated."""

    def rejected(self, reason: RejectReason) -> None:
        """This shard refused (or dropped) a push."""

    def accepted(self, staleness: int) -> None:
        """The session accepted a push (reported by its home shard only: once per push)."""

    def applied(self, seconds: float) -> None:
        """One update ran on this shard, taking ``seconds``."""

    def pushed(self, seconds: float) -> None:
        """The wire layer served one push (receive to answer)."""

    def sent(self, seconds: float, nbytes: int) -> None:
        """The wire layer sent parameters (a pull, or a step's answer)."""


class _Staged:
    """A staged push. ``expires_at``: monotonic time after which an uncommitted two-phase push is
    dropped (None: auto-commit, bounded by its vote); ``committing``: a Commit reached this shard,
    so it no longer expires."""

    __slots__ = ("base_version", "grads", "telemetry", "expires_at", "committing")

    def __init__(self, base_version: int, grads: dict[str, np.ndarray], telemetry: Telemetry,
                 expires_at: Optional[float] = None):
        self.base_version = base_version
        self.grads = grads
        self.telemetry = telemetry
        self.expires_at = expires_at
        self.committing = False


def _log_value(value) -> str:
    """A ``key=value`` log field's value: as is when plain, else JSON-quoted (spaces, quotes, '=')."""
    text = str(value)
    if text and all(c.isalnum() or c in "-_.:/@+" for c in text):
        return text
    return json.dumps(text)


class ShardSession:
    """A session's tensors on one shard.

    Args:
      config: the session.
      tensor_names: the tensors this shard holds (a subset of ``config.tensors``, in order).
      shard_index: this shard's index (its vote and its part of cross-shard sums).
      clock: the session's clock (:class:`~optserve.server.domain.clock.LocalClock` in its home
        shard, a remote handle with the same methods elsewhere).
      updater: the compute side (parameters, optimizer state, the jitted step).
      step_timeout_s: longest wait for a sync barrier, a missing ticket or a reduction.
      vote_timeout_s: auto-commit: longest wait for the peer shards to stage a push; also how
        long a push waits for the creator's initial values.
      staged_push_ttl_s: two-phase path: a push staged without ``auto_commit`` and neither
        committed nor aborted within this long is dropped (rejection reason ABORTED).
      owner: the tenant the session belongs to ("" without tokens).
      creator: the creating client's identity; only it may send the initial values ("": anyone).
      observer: where the session reports what it does (metrics).
      store: durable sessions: where steps are logged and checkpoints written (None: not durable).
      limits: the server's limits (``max_staged_bytes`` bounds this session's staged pushes here).
    """

    def __init__(self, config: SessionConfig, tensor_names: list[str], shard_index: int, clock, updater: Updater,
                 step_timeout_s: float = 300.0, vote_timeout_s: float = 30.0, owner: str = "", creator: str = "",
                 observer: StepObserver = StepObserver(), staged_push_ttl_s: float = 60.0,
                 store: Optional[SessionStore] = None, limits: Optional[Limits] = None):
        if not staged_push_ttl_s > 0:
            raise InvalidArgument(f"staged_push_ttl_s must be > 0, got {staged_push_ttl_s}")
        by_name = config.spec_by_name
        self.config = config
        self.owner = owner
        self.creator = creator
        self.observer = observer
        self._is_home = clock.status() is not None  # the home shard reports each accepted push once
        self.series: Optional[SessionSeries] = SessionSeries() if self._is_home else None
        self.specs: dict[str, TensorSpec] = {name: by_name[name] for name in tensor_names}
        self.shard_index = shard_index
        self.updater = updater
        self.version = 0
        self._clock = clock
        self._timeout = step_timeout_s
        self._vote_timeout = vote_timeout_s
        self._staged_ttl = staged_push_ttl_s
        self._expired: dict[tuple[str, int], float] = {}  # identity -> when it expired (time.time())
        self._rejected = {reason: 0 for reason in RejectReason}
        self._pool = BufferPool([(s.name, s.shape) for s in self.specs.values()])
        self._staged: dict[tuple[str, int], _Staged] = {}
        self._staged_lock = threading.Lock()
        self._applied_sequence: dict[str, int] = {}
        self._cond = threading.Condition()
        self._next_ordinal = 0
        self._arrived: dict[int, Ticket] = {}
        self._sum: Optional[dict[str, np.ndarray]] = None
        self._summed = 0
        self._abandoned: Optional[OptservError] = None  # set by abandon(): every wait raises it
        self._step_clients: list[str] = []  # sync: clients whose pushes the open step holds here
        self._step_tickets: list[tuple[int, str, int]] = []  # sync: (ordinal, client, sequence) of those pushes
        self._store = store
        self._limits = limits or Limits()
        self._push_bytes = sum(spec.size * 4 for spec in self.specs.values())  # one push's float32 buffers
        self.last_activity_unix_s = time.time()  # a client's last push, commit, pull or init here (see touch)

    def touch(self) -> None:
        """A client used the session on this shard now (its idle lease starts again)."""
        self.last_activity_unix_s = time.time()

    # ----------------------------------------------------------------- initial values
    @property
    def initialized(self) -> bool:
        return self.updater.initialized

    def initialize(self, chunks: Iterable, client_id: str = "") -> int:
        """Installs the initial parameters from ``chunks`` (once), sent by client ``client_id``;
        returns the version (0). Only the session's creator may send them."""
        self.touch()
        if self.creator and client_id != self.creator:
            raise PermissionDenied(f"session {self.config.name!r}: only the client that created it may send "
                                   f"its initial values")
        if self.initialized:
            raise FailedPrecondition(f"session {self.config.name!r}: parameters are already initialized")
        buffers = {s.name: np.empty(s.shape, s.dtype.numpy) for s in self.specs.values()}
        assembler = TensorAssembler(self.specs, buffers, check_finite=False)
        for chunk in chunks:
            assembler.add(chunk)
        values = assembler.finish()
        with self._cond:
            if self.initialized:
                raise FailedPrecondition(f"session {self.config.name!r}: parameters are already initialized")
            self.updater.initialize(values)
            if self._store is not None:  # the initial values are durable before they are acknowledged
                self._checkpoint(wait=True)
            self._cond.notify_all()  # pushes and pulls that arrived first (see _require_initialized)
            return self.version

    def _require_initialized(self) -> None:
        """Waits up to ``vote_timeout_s`` for the initial values: a client that attaches right after
        the session was created may pull before its creator has sent them."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.initialized or self._abandoned, timeout=self._vote_timeout):
                raise FailedPrecondition(
                    f"session {self.config.name!r}: initial values were not sent to shard {self.shard_index} "
                    f"(waited {self._vote_timeout:g} s for the creating client)")
            self._raise_if_abandoned()

    # ----------------------------------------------------------------- the step
    def push(self, header: PushHeader, chunks: Iterable, complete: Callable[[], bool] = lambda: True,
             wait_s: Optional[float] = None, in_place: bool = False) -> Receipt:
        """Receives one push and, with ``header.auto_commit``, applies it with the session's shards.

        Args:
          header: the push's identity.
          chunks: ``TensorChunk``-like items covering this shard's tensors exactly once.
          complete: asked once the chunks ran out: False if the push's stream broke or ended
            early (nothing is then applied anywhere).
          wait_s: how long the caller waits for the answer (its deadline; None: unbounded). The
            wait for the push's step ends at ``step_timeout_s`` or shortly before this, whichever
            comes first, so the caller hears the shard's Timeout rather than its own deadline.
          in_place: the chunks' bytes stay unchanged until this push is answered (a shared-memory
            region, which its client writes only between steps): whole float32 tensors are read
            where they lie (see :class:`~optserve.server.domain.assembly.TensorAssembler`).

        Returns:
          auto_commit: the applied push's receipt; else the staged push's (``committed=False``).

        Raises:
          InvalidArgument / NonFinite: a bad chunk or value (nothing staged, the peers drop theirs).
          Cancelled: the stream ended early.
          Stale / PeerRefused / Timeout: the push was refused or its step never completed (a sync
            step's Timeout names how many of num_workers pushes arrived, and from which clients).
        """
        until = self._wait_until(wait_s)
        self.touch()
        self._expire_staged()
        try:
            already_applied = self._receive(header, chunks, complete, in_place)
        except BaseException:
            if header.auto_commit:  # tell the peers to drop their parts
                self._clock.vote(header.client_id, header.sequence, -1, self.shard_index, False, self._vote_timeout)
            raise
        if not header.auto_commit:
            return Receipt(self.version, already_applied, committed=False)
        ticket = self._decide(header.client_id, header.sequence, lambda base: self._clock.vote(
            header.client_id, header.sequence, base, self.shard_index, True, self._vote_timeout), until)
        return Receipt(ticket.target_version, already_applied, True, ticket.staleness, ticket.scale,
                       self._durable(ticket.target_version))

    def commit(self, client_id: str, sequence: int, wait_s: Optional[float] = None) -> Receipt:
        """Two-phase path: applies a push staged without ``auto_commit``; returns once its step is
        applied here (``wait_s``: as for :meth:`push`).

        Raises:
          NotFound: nothing is staged under the identity and it was never applied (also when it
            expired: not committed within ``staged_push_ttl_s``; the message says so).
        """
        until = self._wait_until(wait_s)
        self.touch()
        self._expire_staged()
        key = (client_id, sequence)
        with self._staged_lock:
            entry = self._staged.get(key)
            if entry is not None:
                entry.committing = True  # from now on it waits for its ticket, never expires
            expired_at = self._expired.get(key)
        if entry is None and not self._already_applied(client_id, sequence):
            if expired_at is not None:
                raise NotFound(f"session {self.config.name!r}: staged push {sequence} from client {client_id!r} "
                               f"expired on shard {self.shard_index}: not committed within "
                               f"staged_push_ttl_s={self._staged_ttl:g} s, so it was dropped")
            raise NotFound(f"session {self.config.name!r}: no staged push {sequence} from client {client_id!r}")
        ticket = self._decide(client_id, sequence, lambda base: self._clock.commit(client_id, sequence, base), until)
        return Receipt(ticket.target_version, entry is None, True, ticket.staleness, ticket.scale,
                       self._durable(ticket.target_version))

    def abort(self, client_id: str, sequence: int) -> bool:
        """Two-phase path: drops a staged push (idempotent); returns whether one was dropped."""
        return self._drop(client_id, sequence, RejectReason.ABORTED)

    def _wait_until(self, wait_s: Optional[float]) -> Optional[float]:
        """The monotonic time by which a wait must end to answer a caller that waits ``wait_s``."""
        return None if wait_s is None else time.monotonic() + wait_s - _ANSWER_MARGIN_S

    def _expire_staged(self) -> None:
        """Drops two-phase pushes staged longer than ``staged_push_ttl_s`` without a Commit or
        Abort: their buffers return to the pool, each counts as an ABORTED refusal."""
        now = time.monotonic()
        with self._staged_lock:
            keys = [key for key, entry in self._staged.items()
                    if entry.expires_at is not None and not entry.committing and entry.expires_at <= now]
            expired = [(key, self._staged.pop(key)) for key in keys]
            for key, _ in expired:
                self._expired[key] = time.time()
            while len(self._expired) > _KEEP_EXPIRED:
                del self._expired[next(iter(self._expired))]
        for (client_id, sequence), entry in expired:
            self._pool.release(entry.grads)
            self._refuse(RejectReason.ABORTED, client_id, sequence,
                         cause=f"not committed within staged_push_ttl_s={self._staged_ttl:g}")

    def _receive(self, header: PushHeader, chunks: Iterable, complete: Callable[[], bool],
                 in_place: bool = False) -> bool:
        """Assembles and stages the push; returns True if it had been applied (nothing staged)."""
        self._require_initialized()
        with self._staged_lock:
            staged = len(self._staged)
        if (staged + 1) * self._push_bytes > self._limits.max_staged_bytes:
            self._refuse(RejectReason.ABORTED, header.client_id, header.sequence, cause="max_staged_bytes")
            raise self._limits.exceeded("max_staged_bytes", f"session {self.config.name!r} on shard "
                                        f"{self.shard_index}: {staged} pushes staged and not yet applied, "
                                        f"{self._push_bytes} bytes each")
        buffers = self._pool.acquire()
        assembler = TensorAssembler(self.specs, buffers, check_finite=not self.config.allow_nonfinite,
                                    in_place=in_place and header.auto_commit)
        try:
            header.validate()
            for chunk in chunks:
                assembler.add(chunk)
            grads = assembler.finish()
            if not complete():
                raise Cancelled(f"push {header.sequence} from client {header.client_id!r}: the call ended early")
        except BaseException as exc:
            self._pool.release(buffers)
            self._refuse(RejectReason.NONFINITE if isinstance(exc, NonFinite) else
                         RejectReason.INVALID if isinstance(exc, InvalidArgument) else RejectReason.ABORTED,
                         header.client_id, header.sequence)
            raise
        self.observer.received(assembler.received_bytes)
        if self._already_applied(header.client_id, header.sequence):
            self._pool.release(buffers)
            return True
        expires_at = None if header.auto_commit else time.monotonic() + self._staged_ttl
        with self._staged_lock:  # a retry replaces what an earlier attempt staged
            old = self._staged.pop((header.client_id, header.sequence), None)
            self._staged[(header.client_id, header.sequence)] = _Staged(header.base_version, grads, header.telemetry,
                                                                        expires_at)
            self._expired.pop((header.client_id, header.sequence), None)
        if old is not None:
            self._pool.release(old.grads)
        return False

    def _already_applied(self, client_id: str, sequence: int) -> bool:
        last = self._applied_sequence.get(client_id)
        return last is not None and last >= sequence

    def _drop(self, client_id: str, sequence: int, reason: RejectReason) -> bool:
        with self._staged_lock:
            staged = self._staged.pop((client_id, sequence), None)
        if staged is None:
            return False
        self._refuse(reason, client_id, sequence)
        self._pool.release(staged.grads)
        return True

    def _refuse(self, reason: RejectReason, client_id: str, sequence: int, cause: str = "") -> None:
        """Counts (status, metrics, series) and logs one push this shard refused or dropped."""
        self._rejected[reason] += 1
        self.observer.rejected(reason)
        if self.series is not None:
            self.series.refused(reason)
        _log.info("event=push_refused session=%s shard=%d client=%s sequence=%d reason=%s%s",
                  _log_value(self.config.name), self.shard_index, _log_value(client_id), sequence, reason.name,
                  f" cause={_log_value(cause)}" if cause else "")

    def _decide(self, client_id: str, sequence: int, ask: Callable[[int], Ticket],
                until: Optional[float] = None) -> Ticket:
        """Gets the push's ticket (``ask(base_version)``), then applies tickets up to it (waiting
        until ``until`` at most, see :meth:`_run_through`)."""
        with self._staged_lock:
            entry = self._staged.get((client_id, sequence))
        try:
            ticket = ask(entry.base_version if entry is not None else -1)
        except Stale:
            self._drop(client_id, sequence, RejectReason.STALE)
            raise
        except (PeerRefused, Unavailable):
            self._drop(client_id, sequence, RejectReason.ABORTED)
            raise
        self._run_through(ticket, until)
        return ticket

    def _run_through(self, ticket: Ticket, until: Optional[float] = None) -> None:
        """Applies tickets in ordinal order up to ``ticket``, then waits for its step: for
        ``step_timeout_s`` at most, or until the monotonic time ``until`` (the caller's deadline)."""
        started = time.monotonic()
        deadline = started + self._timeout if until is None else min(started + self._timeout, until)
        with self._cond:
            if ticket.ordinal >= self._next_ordinal:  # else: a retry of a push applied already
                self._arrived[ticket.ordinal] = ticket
                self._cond.notify_all()
            while self._next_ordinal <= ticket.ordinal:
                pending = self._arrived.pop(self._next_ordinal, None)
                if pending is not None and self._awaits_resend(pending):
                    self._arrived[pending.ordinal] = pending  # applied once its client sends it again
                    pending = None
                if pending is not None:
                    self._apply_ticket(pending)
                    self._cond.notify_all()
                    continue
                self._raise_if_abandoned()
                if not self._cond.wait(timeout=_GAP_POLL_S):
                    self._raise_if_abandoned()
                    missing = self._clock.ticket(self._next_ordinal)
                    if missing is not None:
                        self._arrived.setdefault(missing.ordinal, missing)
                if time.monotonic() > deadline:
                    waiting = self._arrived.get(self._next_ordinal)
                    if waiting is not None:
                        raise Timeout(f"session {self.config.name!r}: push {waiting.sequence} of client "
                                      f"{waiting.client_id!r} (ticket {waiting.ordinal}) was decided before shard "
                                      f"{self.shard_index} restarted and its client has not sent it again")
                    raise Timeout(f"session {self.config.name!r}: ticket {self._next_ordinal} never arrived on "
                                  f"shard {self.shard_index}")
            while self.version < ticket.target_version:
                self._raise_if_abandoned()
                if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise Timeout(self._step_timeout_message(ticket, time.monotonic() - started))

    def _awaits_resend(self, ticket: Ticket) -> bool:
        """A durable session's ticket whose push is not staged here: it was decided before this
        shard restarted (its staged copy died with the process) and is applied once its client,
        retrying, sends it again. (Without durability such a ticket is a fault: see _apply_ticket.)"""
        if self._store is None:
            return False
        with self._staged_lock:
            return (ticket.client_id, ticket.sequence) not in self._staged

    def _step_timeout_message(self, ticket: Ticket, waited_s: float) -> str:
        """Why ``ticket``'s step did not complete: in sync mode, which pushes of it arrived (call
        with ``_cond`` held; this shard applied every ticket up to ``ticket``, so it knows them)."""
        message = f"session {self.config.name!r}: step {ticket.target_version} did not complete within {waited_s:.1f} s"
        workers = self.config.num_workers
        if self.config.mode is not Mode.SYNC or workers <= 1:
            return message
        arrived = self._step_clients
        return (f"{message}: {len(arrived)} of num_workers={workers} pushes arrived for the step (from clients "
                f"{', '.join(repr(c) for c in arrived)}); waiting for {workers - len(arrived)} more "
                f"(step_timeout_s={self._timeout:g})")

    def abandon(self, error: OptservError) -> None:
        """Ends the session on this shard (it was closed, or lost a peer shard): every call
        waiting in it, and every later one, raises ``error``; its clock's waits end too."""
        with self._cond:
            self._abandoned = error
            self._cond.notify_all()
        abandon_clock = getattr(self._clock, "abandon", None)  # the home shard's LocalClock
        if abandon_clock is not None:
            abandon_clock(error)

    def _raise_if_abandoned(self) -> None:
        if self._abandoned is not None:
            raise self._abandoned

    def _apply_ticket(self, ticket: Ticket) -> None:
        with self._staged_lock:
            staged = self._staged.pop((ticket.client_id, ticket.sequence), None)
        self._next_ordinal = ticket.ordinal + 1
        if staged is None:
            raise Timeout(
                f"session {self.config.name!r}: push {ticket.sequence} of client {ticket.client_id!r} was "
                f"committed but never staged on shard {self.shard_index}"
            )
        self._applied_sequence[ticket.client_id] = ticket.sequence
        if self._is_home:
            self.observer.accepted(ticket.staleness)
            self.series.accepted(ticket.target_version, ticket.staleness, staged.telemetry)
        grads = staged.grads
        if self.config.mode is Mode.SYNC and self.config.num_workers > 1:
            self._add_to_sum(grads)
            self._pool.release(grads)
            if not ticket.closes_step:
                self._step_clients.append(ticket.client_id)
                self._step_tickets.append((ticket.ordinal, ticket.client_id, ticket.sequence))
                return
            grads = {name: np.divide(s, np.float32(self._summed), out=s) for name, s in self._sum.items()}
            tickets = tuple(self._step_tickets) + ((ticket.ordinal, ticket.client_id, ticket.sequence),)
            self._sum, self._summed = None, 0
            self._step_clients, self._step_tickets = [], []
            self._update(grads, ticket, tickets)
            return
        self._update(grads, ticket, ((ticket.ordinal, ticket.client_id, ticket.sequence),),
                     release=lambda: self._pool.release(grads))

    def _add_to_sum(self, grads: dict[str, np.ndarray]) -> None:
        """Sync mode: accumulates one push of the step (the mean is taken when the step closes)."""
        if self._sum is None:
            self._sum = {name: aligned_empty(g.shape, g.dtype, IO_ALIGNMENT) for name, g in grads.items()}
            for name, g in grads.items():
                np.copyto(self._sum[name], g)
        else:
            for name, g in grads.items():
                self._sum[name] += g
        self._summed += 1

    def _update(self, grads: dict[str, np.ndarray], ticket: Ticket, tickets: tuple,
                release: Optional[Callable[[], None]] = None) -> None:
        """Applies one step, then ``release()`` (the gradient buffers may be reused). A durable
        session also logs the step (in the background: its answers wait for it, see
        :class:`Receipt`) and checkpoints after it when the ticket says so."""
        start = time.perf_counter()
        if self._store is not None:  # the gradient goes to the log while the update runs
            self._store.begin_step([grads[name] for name in self.specs])
        try:
            global_stat = self.updater.apply(grads, ticket.scale, lambda partial: self._clock.reduce_sum(
                ticket.target_version, self.shard_index, partial))
        except BaseException:
            if self._store is not None:
                self._store.abort_step()
            raise
        if self._store is not None:
            self._store.end_step(StepRecord(ticket.target_version, tickets, ticket.scale, global_stat), release)
        elif release is not None:
            release()
        self.version = ticket.target_version
        self.observer.applied(time.perf_counter() - start)
        if ticket.checkpoint and self._store is not None:
            self._checkpoint()

    # ----------------------------------------------------------------- durability
    def _durable(self, version: int) -> Callable[[], None]:
        """What waits for step ``version`` to be logged (nothing when not durable)."""
        store = self._store
        return (lambda: store.wait_logged(version)) if store is not None else (lambda: None)

    def _progress(self) -> ShardProgress:
        return ShardProgress(self.version, self._next_ordinal, dict(self._applied_sequence))

    def _checkpoint(self, wait: bool = False) -> bool:
        """Snapshots the state at the current version into the store (call with ``_cond`` held,
        between steps). The home shard adds its clock's state."""
        clock_state = getattr(self._clock, "durable_state", None) if self._is_home else None
        return self._store.checkpoint(self._progress(), self.updater.params, self.updater.opt_state, clock_state,
                                      wait=wait)

    def checkpoint_now(self) -> bool:
        """A checkpoint of the current state, written before this returns (server shutdown);
        False when there is nothing new since the last one or nothing to save."""
        with self._cond:
            if self._store is None or not self.initialized or self.version <= self._store.durable_version:
                return False
            if self._sum is not None:  # a sync step is half gathered: its log position is not a step boundary
                return False
            return self._checkpoint(wait=True)

    def restore(self, store, read_log, journal_tickets: Callable[[Optional[dict]], list]) -> int:
        """Durable sessions, at recovery: loads the latest checkpoint and replays the step log.

        Args:
          store: the session's store on this shard (also where later steps are logged).
          read_log: ``(segment_path, arrays) -> iterator of (record_json, grads)``.
          journal_tickets: ``manifest -> [entry]``: the clock journal after the checkpoint (home shard).

        Returns the version reached: exactly the last step this shard logged (acknowledged or not).
        """
        manifest = store.latest()
        with self._cond:
            if manifest is not None:
                restored = store.restore_arrays(manifest, self.updater.abstract_state())
                self.updater.restore(restored["params"], restored["opt_state"])
                progress = ShardProgress.from_json(manifest["progress"])
                for segment in store.log_segments(manifest):
                    for header, grads in read_log(segment, self._fresh_gradient_buffers):
                        record = StepRecord.from_json(header)
                        if record.version <= progress.version:
                            continue
                        self.updater.apply(grads, record.scale, lambda _partial, s=record.global_stat: s)
                        progress = progress.after(record)
                self.version, self._next_ordinal = progress.version, progress.next_ordinal
                self._applied_sequence = dict(progress.applied_sequence)
                if self._is_home:
                    self._clock.restore(manifest.get("clock"), journal_tickets(manifest))
            store.start_logs(manifest, self.version)
            store.recoveries += 1
            self._store = store
            self._cond.notify_all()
            return self.version

    def _durability_status(self) -> Optional[DurabilityStatus]:
        store = self._store
        if store is None:
            return None
        return DurabilityStatus(store.durable_version, store.log_records, store.log_bytes, store.recoveries,
                                store.checkpoint_seconds, store.checkpoints_written, store.checkpoint_writing,
                                store.log_writes_direct)

    def attach_store(self, store: SessionStore) -> None:
        """Makes a new session durable: its steps are logged to ``store`` from now on."""
        self._store = store

    def close_store(self) -> None:
        """Finishes a checkpoint being written and closes the log (the session is closing)."""
        if self._store is not None:
            self._store.close()

    @property
    def clock(self):
        """The session's clock (a LocalClock on the home shard, a handle on it elsewhere)."""
        return self._clock

    def _fresh_gradient_buffers(self) -> dict[str, np.ndarray]:
        return {name: aligned_empty(spec.shape, np.float32) for name, spec in self.specs.items()}

    # ----------------------------------------------------------------- reading
    def snapshot(self) -> tuple[int, dict[str, np.ndarray]]:
        """The current version and host views of the parameters (consistent with each other)."""
        self.touch()
        with self._cond:
            self._require_initialized()
            return self.version, self.updater.host_params()

    def status(self) -> ShardSessionStatus:
        """The session on this shard (expired staged pushes are dropped first, so counts are current)."""
        self._expire_staged()
        preconditioners = self.updater.preconditioners
        return ShardSessionStatus(
            version=self.version, initialized=self.initialized, rejected=dict(self._rejected),
            device=str(self.updater.device), clock=self._clock.status(),
            preconditioners=preconditioners.status() if preconditioners is not None else None,
            state_bytes=self.updater.state_bytes(), last_activity_unix_s=self.last_activity_unix_s,
            durability=self._durability_status())


class ShardRegistry:
    """The sessions one shard holds, by name (thread-safe)."""

    def __init__(self, recovering: bool = False):
        self._sessions: dict[str, ShardSession] = {}
        self._lock = threading.Lock()
        self.recovering = recovering  # sessions are being restored: an unknown name may come back

    def add(self, session: ShardSession) -> None:
        with self._lock:
            self._sessions[session.config.name] = session

    def remove(self, name: str) -> bool:
        with self._lock:
            return self._sessions.pop(name, None) is not None

    def get(self, name: str, tenant: Optional[str] = None) -> ShardSession:
        """The session, if tenant ``tenant`` owns it (None: a caller inside the server, unchecked)."""
        with self._lock:
            session = self._sessions.get(name)
        if session is None:
            if self.recovering:
                raise Unavailable(f"session {name!r}: this shard is restoring its sessions; retry")
            raise NotFound(f"session {name!r} not found on this shard")
        if tenant is not None and session.owner != tenant:
            raise PermissionDenied(f"session {name!r} belongs to another tenant")
        return session

    def find(self, name: str) -> Optional[ShardSession]:
        """The session, or None (callers inside the server)."""
        with self._lock:
            return self._sessions.get(name)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._sessions)

    def sessions(self) -> list[ShardSession]:
        with self._lock:
            return list(self._sessions.values())

    def activity(self) -> dict[str, float]:
        """Session name -> its last activity on this shard (unix seconds, see ``ShardSession.touch``)."""
        with self._lock:
            return {name: session.last_activity_unix_s for name, session in self._sessions.items()}
