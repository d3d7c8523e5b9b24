"""What the session clock hands out and reports: a push's :class:`Ticket` and the clock's :class:`ClockStatus`.

A ticket is the clock's decision on one accepted push (or, with ``client_id ==``
:data:`ROUND_CLOSER`, on an elastic round that commits without a push); every shard of the
session applies tickets in their ``ordinal`` order. Tickets cross the wire between shards
(``wire/clock_service.py``) and are journaled as JSON (:meth:`Ticket.to_json`) by durable sessions.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from optserve.protos.status_records import ElasticStatus

ROUND_CLOSER = ""  # client_id of a ticket that commits an elastic round without a push (see Rounds.due)
MAX_WORKERS_REPORTED = 256  # workers a session's status lists (the most recent pushers)


@dataclasses.dataclass(frozen=True)
class Ticket:
    """An accepted push, in the order every shard applies it.

    Attributes:
      ordinal: 0, 1, 2, ... per session.
      client_id / sequence: the push.
      staleness / scale / closes_step: see :class:`optserve.server.domain.clock.staleness.Decision`.
      target_version: the version of the step this push belongs to (after it is applied).
        A ticket whose ``client_id`` is :data:`ROUND_CLOSER` carries no push: it commits an
        elastic round with the pushes decided into it so far.
      checkpoint: durable sessions: every shard checkpoints right after applying this step
        (set on the ticket that closes a step, by the session's checkpoint policy).
      hyperparams: JSON ``{group: {option: value}}``: the hyperparameters set since the previous
        ticket, in force from this ticket's step on ("": none changed; see
        :mod:`~optserve.server.domain.clock.hyperparam_book`).
    """

    ordinal: int
    client_id: str
    sequence: int
    staleness: int
    scale: float
    closes_step: bool
    target_version: int
    checkpoint: bool = False
    hyperparams: str = ""

    def to_json(self) -> list:
        """``[ordinal, client_id, sequence, staleness, scale, closes_step, target_version, checkpoint]``,
        then ``hyperparams`` when set."""
        return [self.ordinal, self.client_id, self.sequence, self.staleness, self.scale, self.closes_step,
                self.target_version, self.checkpoint] + ([self.hyperparams] if self.hyperparams else [])

    @classmethod
    def from_json(cls, data: list) -> "Ticket":
        o, c, s, st, sc, cl, tv, ck = data[:8]
        return cls(int(o), str(c), int(s), int(st), float(sc), bool(cl), int(tv), bool(ck),
                   str(data[8]) if len(data) > 8 else "")

    @property
    def closes_round(self) -> bool:
        """A push-less ticket that commits an elastic round."""
        return self.client_id == ROUND_CLOSER


@dataclasses.dataclass(frozen=True)
class ClockStatus:
    """A session clock's counters: ``version`` (steps decided), ``accepted`` pushes, ``stale``
    refusals; the accepted pushes' staleness (median and largest, versions); and when the clock
    last decided a push (``last_activity_unix_s``, 0: never); ``elastic``: membership and rounds
    (elastic sync sessions, else None); ``workers``: (worker id, when it last pushed), the most
    recent first, at most :data:`MAX_WORKERS_REPORTED`."""

    version: int
    accepted: int
    stale: int
    staleness_p50: int = 0
    staleness_max: int = 0
    last_activity_unix_s: float = 0.0
    elastic: Optional[ElasticStatus] = None
    workers: tuple = ()
