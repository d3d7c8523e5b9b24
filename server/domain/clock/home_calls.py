"""What only a session's home shard answers: elastic membership, the session's history, and
hyperparameter changes (each goes through the session clock that lives there)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Optional

from optserve.server.domain.config import worker_of
from optserve.server.domain.errors import FailedPrecondition, InvalidArgument


class HomeCalls:
    """A session's home-shard calls on one shard (refused with FAILED_PRECONDITION elsewhere).

    Args:
      session: the session's name (for messages).
      shard_index: this shard's index.
      clock: the session's clock (``is_home`` on the home shard).
      touch: marks the session active (a client called).
      optimizer: ``() -> BuiltOptimizer`` of the session (checks hyperparameter values).
      elastic: the session is elastic sync (it has a membership).
    """

    def __init__(self, session: str, shard_index: int, clock, touch: Callable[[], None], optimizer: Callable,
                 elastic: bool = False):
        self._session = session
        self._elastic = elastic
        self._shard_index = shard_index
        self._clock = clock
        self._touch = touch
        self._optimizer = optimizer

    def membership(self, worker: str, action: str) -> tuple[int, list[str], float]:
        """Elastic sync: ``worker`` joins, renews its lease or leaves ("join" / "renew" / "leave");
        returns the version, the members and the lease in seconds."""
        self._touch()
        return self._home_clock("membership").membership(worker, action)

    def history(self, since: int) -> list:
        """The :class:`~optserve.protos.status_records.RoundRecord` of each version after
        ``since``, oldest first, in every mode (sync: one per round; async: one per push; see
        :mod:`~optserve.server.domain.clock.version_history`)."""
        return self._home_clock("history").history(since)

    def hyperparam_history(self, since: int) -> list:
        """The hyperparameter changes in force from a version after ``since``, oldest first
        (:class:`~optserve.server.domain.clock.hyperparam_book.HyperparamChange`), with the options a
        caller can set only (a decay rate's complement, which the kernel carries beside it, is
        left out)."""
        settable = {option for group in self._optimizer().groups for option in group.hyper}
        changes = self._home_clock("history").hyperparam_history(since)
        return [dataclasses.replace(change, values={group: {o: v for o, v in values.items() if o in settable}
                                                    for group, values in change.values.items()})
                for change in changes]

    def set_hyperparams(self, values: Mapping[str, float], group: Optional[str] = None) -> tuple[int, bool]:
        """Changes hyperparameters ``{option: value}`` of ``group`` (None: every group having
        them) from the session's next step on; returns ``(version of that step, changed)``.

        Raises:
          InvalidArgument: an unknown group, an option that cannot be set, a value breaking its
            rule (named in the message; nothing changes).
        """
        self._touch()
        clock = self._home_clock("setting hyperparameters")
        try:
            checked = self._optimizer().checked_hyperparams(values, group)
        except ValueError as exc:
            raise InvalidArgument(f"session {self._session!r}: {exc}") from None
        return clock.set_hyperparams(checked)

    def disconnected(self, client_id: str) -> None:
        """The connection that carried ``client_id``'s pushes dropped: in an elastic session its
        worker leaves now (the home shard keeps the membership; elsewhere nothing to do)."""
        if self._elastic and self._clock.is_home:
            self._clock.disconnected(worker_of(client_id))

    def _home_clock(self, what: str):
        if not self._clock.is_home:
            raise FailedPrecondition(f"session {self._session!r}: {what} is kept by its home shard (the first "
                                     f"shard of its shard map), not shard {self._shard_index}")
        return self._clock
