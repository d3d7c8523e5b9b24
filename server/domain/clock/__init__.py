"""The session clock: the one ordering authority of a session, kept on its home shard.

It decides every push's ticket (ordinal, version, staleness, scale) once every shard staged its
part (votes), closes sync and elastic rounds, sums cross-shard statistics, holds the
hyperparameters pending until the next ticket carries them, and keeps each version's record
(the history). Other shards reach it through the ``Clock`` protocol (``wire/clock_service.py``).

Exports: ``Clock`` and ``HomeClock`` (the clock), ``Ticket`` and ``ClockStatus`` (its records),
``HomeCalls`` (what only the home shard answers: membership, history, hyperparameter changes).
"""

from optserve.server.domain.clock.clock_records import ClockStatus, Ticket
from optserve.server.domain.clock.home_calls import HomeCalls
from optserve.server.domain.clock.home_clock import Clock, HomeClock

__all__ = ["Clock", "ClockStatus", "HomeCalls", "HomeClock", "Ticket"]
