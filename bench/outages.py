"""How long each kind of fault kept the sessions from stepping (the chaos checker's
unavailability, :mod:`bench.checker`): from the faults injected and the clients' call records."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence


@dataclasses.dataclass(frozen=True)
class Unavailability:
    """The longest time from a fault of one kind to a session's next acknowledged step.

    ``recovered`` False: no acknowledged step followed before the run ended (``seconds``: until
    then). ``after_end_s``: the longest time from such a fault's end (a process continued, the
    disk freed, a restarted server listening) to a session's next acknowledged step (None: the
    faults of this kind have no end, or no step followed one). ``alone_s``: the longest such time
    over the faults of this kind that no other fault followed before the session's next step (the
    fault's own outage; None: every one was overlapped)."""

    seconds: float
    session: str
    fault_index: int
    recovered: bool
    after_end_s: Optional[float] = None
    alone_s: Optional[float] = None


def unavailability(faults: Sequence, calls: Sequence, sessions: Sequence[str],
                   run_ended: Optional[float] = None) -> dict:
    """Fault kind -> the longest :class:`Unavailability` after a fault of that kind: for each
    fault and session, the time from the injection to the session's next acknowledged push."""
    acks = {s: sorted(c.ended for c in calls if c.session == s and c.kind == "push" and c.outcome == "ok"
                      and c.ended is not None) for s in sessions}
    end = run_ended if run_ended is not None else max((c.ended or c.started for c in calls), default=0.0)

    def next_ack(times: list[float], t: float) -> Optional[float]:
        return next((a for a in times if a >= t), None)

    worst: dict = {}
    after_end: dict = {}
    alone: dict = {}
    injected = sorted(f.injected for f in faults)
    for index, fault in enumerate(faults):
        for session, times in acks.items():
            after = next_ack(times, fault.injected)
            u = Unavailability(max(0.0, (after if after is not None else end) - fault.injected), session, index,
                               after is not None)
            held = worst.get(fault.kind)
            if held is None or (not u.recovered, u.seconds) > (not held.recovered, held.seconds):
                worst[fault.kind] = u
            overlapped = any(fault.injected < t < (after if after is not None else end) for t in injected)
            if after is not None and not overlapped:
                alone[fault.kind] = max(alone.get(fault.kind, 0.0), u.seconds)
            lifted = next_ack(times, fault.ended) if fault.ended is not None else None
            if lifted is not None:
                after_end[fault.kind] = max(after_end.get(fault.kind, 0.0), lifted - fault.ended)
    return {kind: dataclasses.replace(u, after_end_s=after_end.get(kind), alone_s=alone.get(kind))
            for kind, u in worst.items()}
