"""What a shard session takes in and hands out: push headers, receipts, status, its observer.

Plain values, no behaviour beyond validation; :mod:`optserve.server.domain.shard.shard_session`
re-exports them (callers import them from there).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

from optserve.server.domain.clock import ClockStatus
from optserve.server.domain.durability import DurabilityStatus
from optserve.server.domain.errors import InvalidArgument, RejectReason
from optserve.server.domain.telemetry import Telemetry
from optserve.server.domain.waits import Steps, drive, returns


@dataclasses.dataclass(frozen=True)
class PushHeader:
    """Who pushes what: the push's identity and the version its gradients were computed from.

    Attributes:
      client_id: the pushing client (non-empty).
      sequence: the client's push number (>= 0); a retry reuses it.
      base_version: the session version the gradients were computed from.
      auto_commit: the shards commit among themselves once all staged (else the client commits).
      telemetry: the loss and scalars the client attached (kept in the session's series).
      without_gradient: the tensors the push has no gradient for (see ``StagedPush``).
      attempt: the client's try of this push (1, 2, ...; 0: unnumbered): each try is voted on
        apart (:class:`~optserve.server.domain.clock.votes.ShardVotes`).
      incarnation: the session's incarnation the client attached to ("": any).
    """

    client_id: str
    sequence: int
    base_version: int
    auto_commit: bool = True
    telemetry: Telemetry = Telemetry()
    without_gradient: frozenset = frozenset()
    attempt: int = 0
    incarnation: str = ""

    def validate(self) -> None:
        """Raises InvalidArgument naming what is wrong (called inside the push, so a bad header
        is a refusal that the session's other shards hear of)."""
        self.telemetry.validate()
        if not self.client_id:
            raise InvalidArgument("push header: client_id must be non-empty")
        if self.sequence < 0:
            raise InvalidArgument(f"push header: sequence must be >= 0, got {self.sequence}")
        if self.base_version < 0:
            raise InvalidArgument(f"push header: base_version must be >= 0, got {self.base_version}")


@dataclasses.dataclass(frozen=True)
class Receipt:
    """What a push came to on this shard.

    Attributes:
      version: after an applied push, the version of its step; otherwise the shard's version.
      already_applied: the push had been applied before (a retry): nothing was staged.
      committed: the push is applied (its step is complete on this shard).
      staleness / scale: the clock's decision (0 / 1.0 unless async).
      durable_steps: a generator of waits (:mod:`~optserve.server.domain.waits`) that ends once
        the push's step is in the step log (durable sessions; the answer that acknowledges the
        push waits for it, so nothing acknowledged can be lost); raises if the log could not be
        written. :meth:`durable` waits for it in this thread.
    """

    version: int
    already_applied: bool
    committed: bool
    staleness: int = 0
    scale: float = 1.0
    durable_steps: Callable[[], Steps[None]] = lambda: returns(None)

    def durable(self) -> None:
        """Returns once the push's step is in the step log (see ``durable_steps``)."""
        drive(self.durable_steps())


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
      hyperparams: ``(group, option, value, scheduled)`` of the next step on this shard.
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
    hyperparams: tuple = ()


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
