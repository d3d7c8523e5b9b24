"""One session on one shard: the step path, from a push's chunks to its applied update.

A push arrives as chunks; :meth:`ShardSession.push` assembles and validates them into pooled
buffers, stages them under the push's identity ``(client_id, sequence)`` and, with
``auto_commit``, votes at the session clock with the session's other shards. The clock issues a
*ticket* only when every shard staged its part; tickets are applied strictly in ordinal order
(so every shard applies the same pushes in the same order), and the updater
(:mod:`optserve.server.compute.updater`) runs the step. The client-driven two-phase path
(``stage`` then ``commit`` / ``abort``) reaches the same tickets without the vote.

Idempotency: a shard remembers each client's last applied sequence; a retry of an applied push
is answered from the clock's ticket and applies nothing twice.

Kernel failures: an optimizer whose step cannot run on a shard's tensors (it raises while traced)
is found before the push is staged, so it is refused (INVALID_ARGUMENT) before any vote: applied
on no shard, the clock unmoved. A failure only the run shows comes after the clock decided the
step (and the update donated the state): the session ends with one SessionLost naming it.
An optimizer that cannot build its state for the shard's tensors is refused when the session is
opened (its ``init`` traced abstractly: see ``ShardActor.open_session``); one whose real ``init``
still fails when the initial values arrive is answered INVALID_ARGUMENT, and nothing is installed.

:class:`ShardSession` is the facade the wire layer and the shard actor call: the receive side
(initial values, pushes assembled, validated and staged, votes and commits), reading and status.
It hands each job to a collaborator: :mod:`~optserve.server.domain.shard.staging` (staged pushes, their
expiry after ``staged_push_ttl_s``, ``max_staged_bytes``), :mod:`~optserve.server.domain.shard.step_runner`
(decided tickets applied in order through the apply queue, :mod:`~optserve.server.domain.shard.apply_queue`,
each update a step of :mod:`~optserve.server.domain.shard.step_journal`: log space, the log order, the
unlogged step and its recovery, checkpoints, restore) and :mod:`~optserve.server.domain.shard.refusals`:
every push refused or dropped is logged once on this module's logger (INFO, ``event=push_refused
session=... shard=... client=... sequence=... reason=...``; never values). Locks: the step
runner's ``cond`` guards the version, the apply queue, the journal and the updater's state; the
staging area's lock is taken alone or inside it.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable, Optional

import numpy as np

from optserve.server.compute.kernel_words import error_line, tensors_in_words
from optserve.server.compute.updater import Updater
from optserve.server.domain.clock import HomeCalls
from optserve.server.domain.config import Limits, SessionConfig, TensorSpec
from optserve.server.domain.shard.assembly import TensorAssembler
from optserve.server.domain.errors import (FailedPrecondition, InvalidArgument, OptservError, PermissionDenied,
                                           RejectReason, Replaced, ResourceExhausted, Unavailable)
from optserve.server.domain.shard import saved_state
from optserve.server.domain.shard.refusals import Refusals, StepCheck, log_value
from optserve.server.domain.shard.saved_state import StartState
from optserve.server.domain.shard.shard_records import PushHeader, Receipt, ShardSessionStatus, StepObserver
from optserve.server.domain.shard.device_plane import DevicePlane
from optserve.server.domain.shard.session_durability import SessionDurability
from optserve.server.domain.shard.staging import StagingArea
from optserve.server.domain.shard.step_runner import StepRunner
from optserve.server.domain.telemetry import SessionSeries
from optserve.server.domain.waits import Steps, drive, returns

__all__ = ["PushHeader", "Receipt", "ShardSession", "ShardSessionStatus", "StepObserver"]

_log = logging.getLogger(__name__)

_INIT_WAIT_S = 1.0  # longest in-thread wait for a new session's initial values (then UNAVAILABLE: retry)
_ANSWER_MARGIN_S = 1.0  # a wait bounded by the caller's deadline ends this much earlier, to answer in time


def _init_failure(config: SessionConfig, specs: dict[str, TensorSpec], shard_index: int,
                  exc: Exception) -> OptservError:
    """The optimizer raised while building its state from the initial values: a failure its
    abstract trace at open time did not show (see ``Updater.init_problem``). Nothing was
    installed (the session stays uninitialized; the creating client closes it). Logged with its
    traceback here; the caller hears one line: INVALID_ARGUMENT, or RESOURCE_EXHAUSTED when the
    device ran out of memory."""
    if isinstance(exc, OptservError):
        return exc
    _log.error("event=init_failed session=%s shard=%d optimizer=%s", log_value(config.name), shard_index,
               log_value(config.optimizer_name), exc_info=exc)
    tensors = tensors_in_words({n: (s.shape, s.dtype.numpy) for n, s in specs.items()}, list(specs))
    what = (f"session {config.name!r}: optimizer {config.optimizer_name!r} could not build its state "
            f"for {tensors} on shard {shard_index}: {error_line(exc)}")
    if "RESOURCE_EXHAUSTED" in str(exc):
        return ResourceExhausted(what)
    return InvalidArgument(what)


class ShardSession:
    """A session's tensors on one shard.

    Args:
      config: the session.
      tensor_names: the tensors this shard holds (a subset of ``config.tensors``, in order).
      shard_index: this shard's index (its vote and its part of cross-shard sums).
      clock: the session's :class:`~optserve.server.domain.clock.home_clock.Clock` (``is_home`` on its home
        shard: the one that keeps the session's order; a handle on that one elsewhere).
      updater: the compute side (parameters, optimizer state, the jitted step).
      step_timeout_s: longest wait for a sync barrier, a missing ticket or a reduction.
      vote_timeout_s: auto-commit: longest wait for the peer shards to stage a push.
      staged_push_ttl_s: two-phase path: a push staged without ``auto_commit`` and neither
        committed nor aborted within this long is dropped (rejection reason ABORTED).
      owner: the tenant the session belongs to ("" without tokens).
      creator: the creating client's identity; only it may send the initial values ("": anyone).
      observer: where the session reports what it does (metrics).
      limits: the server's limits (``max_staged_bytes`` bounds this session's staged pushes here).
    """

    def __init__(self, config: SessionConfig, tensor_names: list[str], shard_index: int, clock, updater: Updater,
                 step_timeout_s: float = 300.0, vote_timeout_s: float = 30.0, owner: str = "", creator: str = "",
                 observer: StepObserver = StepObserver(), staged_push_ttl_s: float = 60.0,
                 limits: Optional[Limits] = None):
        if not staged_push_ttl_s > 0:
            raise InvalidArgument(f"staged_push_ttl_s must be > 0, got {staged_push_ttl_s}")
        by_name = config.spec_by_name
        self.config = config
        self.owner = owner
        self.creator = creator
        self.observer = observer
        self._is_home = clock.is_home  # the home shard reports each accepted push once
        self.series: Optional[SessionSeries] = SessionSeries() if self._is_home else None
        self.specs: dict[str, TensorSpec] = {name: by_name[name] for name in tensor_names}
        self.shard_index = shard_index
        self.updater = updater
        self._clock = clock
        self._vote_timeout = vote_timeout_s
        self._refusals = Refusals(config.name, shard_index, observer, self.series, _log)
        self._staging = StagingArea(config.name, shard_index, self.specs, staged_push_ttl_s, limits or Limits(),
                                    self._refusals)
        self._steps = StepRunner(config, shard_index, self.specs, clock, updater, self._staging, observer, self.series,
                                 step_timeout_s)
        self._cond = self._steps.cond  # guards the version, the apply queue, the journal and the updater's state
        self.durability = SessionDurability(self._steps)  # store, checkpoint now, restore
        self.device_plane = DevicePlane(config, updater, self._steps, lambda: (self.touch(), self._require_initialized()))
        self.home = HomeCalls(config.name, shard_index, clock, self.touch, lambda: self.updater.optimizer,
                              config.is_elastic)
        self._step_check = StepCheck(self._cond, updater, self._refusals, config.name, shard_index)
        self.last_activity_unix_s = time.time()  # a client's last push, commit, pull or init here (see touch)
        self._ready = False  # seen initialized under the lock (an initialization over): for good

    @property
    def where(self) -> str:
        """"session 'name' on shard i", as messages name this session's part here."""
        return self._steps.where

    @property
    def version(self) -> int:
        """Steps applied here."""
        return self._steps.version

    def abandon(self, error: OptservError) -> None:
        """Ends the session on this shard: see :meth:`StepRunner.abandon`."""
        self._steps.abandon(error)

    def touch(self) -> None:
        """A client used the session on this shard now (its idle lease starts again)."""
        self.last_activity_unix_s = time.time()

    @property
    def clock(self):
        """The session's clock (``clock.is_home``: this shard keeps it; else a handle on the home one)."""
        return self._clock

    # ----------------------------------------------------------------- initial values
    @property
    def initialized(self) -> bool:
        return self.updater.initialized

    def check_creator(self, client_id: str) -> None:
        """Raises PermissionDenied unless ``client_id`` created the session (it alone sends the initial values)."""
        if self.creator and client_id != self.creator:
            raise PermissionDenied(f"session {self.config.name!r}: only the client that created it may send "
                                   f"its initial values")

    def initialize(self, chunks: Iterable, client_id: str = "", in_place: bool = False,
                   start: Optional[StartState] = None, state_chunks: Iterable = ()) -> int:
        """Installs the initial parameters from ``chunks`` (once), sent by client ``client_id``;
        returns the version (0, or ``start.version``). Only the session's creator may send them.
        ``in_place``: whole float32 tensors in a shared-memory region are read where they lie
        (copied once, onto the device) instead of into a host buffer first. ``start``: the
        session starts from a saved state whose optimizer-state leaves ``state_chunks`` carry
        (read after ``chunks``; see :mod:`~optserve.server.domain.shard.saved_state`): the state, the
        version and the hyperparameters are in place before any step runs.

        Raises:
          InvalidArgument: naming the tensor or the saved state's leaf that does not fit
            (nothing is installed).
        """
        self.touch()
        self.check_creator(client_id)
        if self.initialized:
            raise FailedPrecondition(f"session {self.config.name!r}: parameters are already initialized")
        # pages of a buffer a tensor read in place never uses are never touched (no memory)
        buffers = {s.name: np.empty(s.shape, s.dtype.numpy) for s in self.specs.values()}
        assembler = TensorAssembler(self.specs, buffers, check_finite=False, in_place=in_place)
        for chunk in chunks:
            assembler.add(chunk)
        values = assembler.finish()
        leaves = None
        if start is not None:
            leaves = saved_state.assemble_leaves(self.where, saved_state.expected_leaves(self.updater), state_chunks)
        with self._cond:
            if self.initialized:
                raise FailedPrecondition(f"session {self.config.name!r}: parameters are already initialized")
            try:
                # read in place from a client's region: the client writes there again
                self.updater.initialize(values, borrowed=[n for n, v in values.items() if v is not buffers[n]])
            except Exception as exc:  # noqa: BLE001 - OptservError passes through; the kernel's own failure
                raise _init_failure(self.config, self.specs, self.shard_index, exc) from None
            if start is not None:
                saved_state.start_from(self.updater, self._steps, self._clock, start, leaves)
            if self._steps.journal.enabled:  # the initial values are durable before they are acknowledged
                self._steps.journal.checkpoint(wait=True)
            self.durability.initialized()  # a standby asked for before starts from them
            self._cond.notify_all()  # pushes and pulls that arrived first (see _require_initialized)
            return self.version

    def export_state(self) -> saved_state.SavedState:
        """This shard's part of the session's state at its current version, between steps (a sync
        step's pushes still gathering, unacknowledged, are not in it; on a CPU, views kept intact)."""
        self.touch()
        self._require_initialized()
        with self._cond:
            return saved_state.read_state(self.updater, self.version, self.config.incarnation)

    def _require_initialized(self) -> None:
        """Waits a moment (at most :data:`_INIT_WAIT_S`) for the initial values, then refuses with
        Unavailable, which clients retry: a client that attaches right after the session was
        created may pull before its creator has sent them, and a wait here would hold one of the
        shard's threads that other sessions' calls need. Once seen ready: no lock."""
        if not self._ready:
            with self._cond:  # an initialization holds it to its end (or its failure)
                if not self._cond.wait_for(lambda: self.initialized or self._steps.abandoned,
                                           timeout=min(self._vote_timeout, _INIT_WAIT_S)):
                    raise Unavailable(f"session {self.config.name!r}: its initial values have not reached shard "
                                      f"{self.shard_index} yet (its creating client sends them); retry")
                self._ready = self.initialized
        self._steps.raise_if_abandoned()

    # ----------------------------------------------------------------- the step
    def push(self, header: PushHeader, chunks: Iterable, complete: Callable[[], bool] = lambda: True,
             wait_s: Optional[float] = None, in_place: bool = False) -> Receipt:
        """:meth:`push_steps`, waiting in this thread."""
        return drive(self.push_steps(header, chunks, complete, wait_s, in_place))

    def push_steps(self, header: PushHeader, chunks: Iterable, complete: Callable[[], bool] = lambda: True,
                   wait_s: Optional[float] = None, in_place: bool = False) -> Steps[Receipt]:
        """Receives one push and, with ``header.auto_commit``, applies it with the session's shards;
        its waits (the vote, its turn, its step) are yielded (:mod:`~optserve.server.domain.waits`).

        Args:
          header: the push's identity.
          chunks: ``TensorChunk``-like items covering this shard's tensors exactly once; a
            :class:`~optserve.server.domain.waits.Wait` among them (the next chunk on its way)
            is yielded like the other waits.
          complete: asked once the chunks ran out: False if the push's stream broke or ended
            early (nothing is then applied anywhere).
          wait_s: how long the caller waits for the answer (its deadline; None: unbounded). The
            wait for the push's step ends at ``step_timeout_s`` or shortly before this, whichever
            comes first, so the caller hears the shard's Timeout rather than its own deadline.
          in_place: the chunks' bytes stay unchanged until this push is answered (a shared-memory
            region, which its client writes only between steps): whole float32 tensors are read
            where they lie (see :class:`~optserve.server.domain.shard.assembly.TensorAssembler`).

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
        self._staging.expire()
        try:
            already_applied = yield from self._receive(header, chunks, complete, in_place)
        except BaseException:
            if header.auto_commit:  # tell the peers to drop their parts
                self._clock.vote(header.client_id, header.sequence, -1, self.shard_index, False, self._vote_timeout,
                                 header.attempt)
            raise
        if not header.auto_commit:
            return Receipt(self.version, already_applied, committed=False)
        ticket = yield from self._steps.decide_steps(header.client_id, header.sequence, lambda base: self._clock.vote_steps(
            header.client_id, header.sequence, base, self.shard_index, True, self._vote_timeout, header.attempt),
            until)
        return Receipt(ticket.target_version, already_applied, True, ticket.staleness, ticket.scale,
                       self._steps.journal.waiter(ticket.target_version))

    def commit(self, client_id: str, sequence: int, wait_s: Optional[float] = None) -> Receipt:
        """:meth:`commit_steps`, waiting in this thread."""
        return drive(self.commit_steps(client_id, sequence, wait_s))

    def commit_steps(self, client_id: str, sequence: int, wait_s: Optional[float] = None) -> Steps[Receipt]:
        """Two-phase path: applies a push staged without ``auto_commit``; returns once its step is
        applied here (``wait_s``: as for :meth:`push`); its waits are yielded.

        Raises:
          NotFound: nothing is staged under the identity and it was never applied (also when it
            expired: not committed within ``staged_push_ttl_s``; the message says so).
        """
        until = self._wait_until(wait_s)
        self.touch()
        self._staging.expire()
        staged, expired_at = self._staging.claim((client_id, sequence))  # a claimed push never expires
        if staged is None and not self._steps.queue.already_applied(client_id, sequence):
            raise self._staging.missing((client_id, sequence), expired_at)
        ticket = yield from self._steps.decide_steps(
            client_id, sequence, lambda base: returns(self._clock.commit(client_id, sequence, base)), until)
        return Receipt(ticket.target_version, staged is None, True, ticket.staleness, ticket.scale,
                       self._steps.journal.waiter(ticket.target_version))

    def abort(self, client_id: str, sequence: int) -> bool:
        """Two-phase path: drops a staged push (idempotent); returns whether one was dropped."""
        return self._staging.drop((client_id, sequence), RejectReason.ABORTED)

    def _wait_until(self, wait_s: Optional[float]) -> Optional[float]:
        """The monotonic time by which a wait must end to answer a caller that waits ``wait_s``."""
        return None if wait_s is None else time.monotonic() + wait_s - _ANSWER_MARGIN_S

    def _receive(self, header: PushHeader, chunks: Iterable, complete: Callable[[], bool],
                 in_place: bool = False) -> Steps[bool]:
        """Assembles and stages the push; returns True if it had been applied (nothing staged).
        Waits for chunks on their way are yielded."""
        self._require_initialized()
        if header.incarnation and self.config.incarnation and header.incarnation != self.config.incarnation:
            raise Replaced(f"session {self.config.name!r} was replaced after client {header.client_id!r} attached "
                           f"(closed and created again under its name, e.g. restored from a checkpoint at version "
                           f"{self.version}): its push {header.sequence} belongs to the former session and was "
                           f"applied nowhere; attach again and pull the parameters")
        unknown = sorted(header.without_gradient - set(self.config.spec_by_name))
        if unknown:
            raise InvalidArgument(f"{self.where}: push {header.sequence} of client {header.client_id!r} names "
                                  f"tensors without a gradient that the session does not have: {unknown[:5]}")
        self._step_check.require(header.client_id, header.sequence)
        self._staging.check_room(header.client_id, header.sequence)
        try:  # durable: the step log has room for this push's step (and those staged before it) on the disk
            if not self._steps.queue.already_applied(header.client_id, header.sequence):  # a retry logs nothing
                self._steps.journal.reserve(steps=self._staging.count + 1)
        except Unavailable:
            self._refusals.refuse(RejectReason.ABORTED, header.client_id, header.sequence, cause="disk")
            raise
        grads, received_bytes = yield from self._staging.assemble(header, chunks, complete,
                                                       check_finite=not self.config.allow_nonfinite,
                                                       in_place=in_place and header.auto_commit,
                                                       upload=self.device_plane.upload)
        self.observer.received(received_bytes)
        if self._steps.queue.already_applied(header.client_id, header.sequence):
            self._staging.release(grads)
            return True
        self._staging.stage((header.client_id, header.sequence), header.base_version, grads, header.telemetry,
                            header.auto_commit, header.without_gradient)  # a retry replaces what an earlier attempt staged
        return False

    # ----------------------------------------------------------------- reading
    def snapshot(self, evaluation: bool = False) -> tuple[int, dict[str, np.ndarray]]:
        """The current version and host views of the parameters (consistent with each other);
        ``evaluation``: the parameters to evaluate the model with (schedule-free optimizers: a
        fresh copy; for others, the trained ones)."""
        return drive(self.snapshot_steps(evaluation))

    def snapshot_steps(self, evaluation: bool = False, relayed_since: Optional[int] = None) -> Steps[tuple]:
        """:meth:`snapshot`, its wait for the session's lock (another step's update may hold it)
        yielded. With ``relayed_since``: ``(version, params, parts)``, ``parts`` the tensors a
        client whose parameters are of that version may get as the last step's sparse parts (see
        :mod:`~optserve.server.domain.shard.sparse_relay`)."""
        self.touch()
        self._require_initialized()
        with (yield from self._cond.hold_steps()):
            if relayed_since is not None:
                return self.version, self.updater.host_params(), self._steps.relay.parts_for(relayed_since,
                                                                                             self.version)
            evaluated = self.updater.evaluation_params() if evaluation else None
            return self.version, evaluated if evaluated is not None else self.updater.host_params()

    def status(self) -> ShardSessionStatus:
        """The session on this shard (expired staged pushes are dropped first, so counts are current)."""
        self._staging.expire()
        preconditioners = self.updater.preconditioners
        return ShardSessionStatus(
            version=self.version, initialized=self.initialized, rejected=dict(self._refusals.counts),
            device=str(self.updater.device), clock=self._clock.status(),
            preconditioners=preconditioners.status() if preconditioners is not None else None,
            state_bytes=self.updater.state_bytes(), last_activity_unix_s=self.last_activity_unix_s,
            hyperparams=tuple(self.updater.hyperparams_now(self.version)),
            durability=self._steps.journal.status())
