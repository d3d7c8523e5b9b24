"""The records of the durable step, shared by the journal (``step_journal``) and its recovery of
an unlogged step (``log_recovery``): a step as logged, a step whose record failed, and what the
journal asks of the shard session it serves."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Protocol

from optserve.server.domain.clock import Ticket
from optserve.server.domain.durability import ShardProgress, StepRecord


class JournaledStep(NamedTuple):
    """One step as the journal logs it.

    Attributes:
      ticket: the ticket that runs the step (its ``target_version`` is the step's version).
      tickets: ``(ordinal, client_id, sequence)`` of every push the step applies, in order.
      scale: the step's scale.
      hyper: the hyperparameters it runs with (``{group: {option: value}}``).
      absent: the tensors without a gradient in this step (left alone), sorted.
    """

    ticket: Ticket
    tickets: tuple
    scale: float
    hyper: dict
    absent: tuple = ()

    def record(self, global_stat: float) -> StepRecord:
        """The step's log record, once its cross-shard statistic is known."""
        return StepRecord(self.ticket.target_version, self.tickets, self.scale, global_stat, self.hyper, self.absent)


class UnloggedStep(NamedTuple):
    """Write-ahead order: a step whose log record could not be written, so applied nowhere here
    yet; its tickets are taken, and it is applied (logged first) before any later step."""

    grads: dict  # the shard's own copy (the push's buffers went back when it was answered)
    step: JournaledStep
    global_stat: float  # the cross-shard statistic it was decided with


class JournalOwner(Protocol):
    """What the journal asks of the shard session whose steps it makes durable."""

    where: str  # "session 'name' on shard i", for messages
    version: int  # steps applied here
    initialized: bool  # the initial values are installed
    half_gathered: bool  # a sync step is gathering its pushes here (not a step boundary)

    def checkpoint_state(self) -> tuple[ShardProgress, dict, Any, Optional[Callable], bool]:
        """``(progress, params, opt_state, clock_state_fn, copied)`` at the current version
        (``clock_state_fn``: the home clock's ``durable_state``, None elsewhere; ``copied``: the
        arrays are a host copy, not views of the live state)."""

    def root_installs(self) -> list:
        """The offloaded roots installed since the last call, oldest first (``RootInstall``\\ s,
        kept while the part has a standby: they are shipped with the step they came before)."""

    def params_digest(self) -> int:
        """The parameters' ``params_digest`` now (a step boundary)."""

    def recover_log(self) -> bool:
        """Takes the session's lock and :meth:`StepJournal.recover`\\ s (raising if the session ended)."""

    def reapply(self, unlogged: UnloggedStep) -> None:
        """Runs the step whose record failed again, through :meth:`StepJournal.run`."""
