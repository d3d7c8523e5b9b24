"""The nemesis's fault schedule, drawn once from ``random.Random(seed)`` before the run starts: the
same seed gives the same faults, in the same order, with the same targets, holds and gaps
(whichever of them a run of M minutes reaches). Kinds come in seeded permutations of
:data:`KINDS`, so every kind comes once before any comes twice."""

from __future__ import annotations

import dataclasses
import random

# What each kind does (bench/nemesis.py injects them):
KINDS = (
    "shard_kill",    # SIGKILL of one shard actor (Ray restarts it; it restores from its checkpoint and log)
    "server_kill",   # SIGKILL of the whole server tree, restarted on the same port and checkpoint directory
    "shard_stop",    # SIGSTOP of one shard actor for hold_s, then SIGCONT
    "worker_stop",   # SIGSTOP of one worker process for hold_s, then SIGCONT
    "disk_full",     # the checkpoint directory's filesystem filled for hold_s, then freed
    "write_error",   # the device under that filesystem fails its writes for hold_s, then recovers
    "rogue",         # a burst of garbage and oversize requests (bench/_nemesis_rogue.py)
    "worker_kill",   # SIGKILL of one worker process inside a push, restarted after hold_s as a new worker
)


@dataclasses.dataclass(frozen=True)
class PlannedFault:
    """One fault of the schedule.

    Attributes:
      index: its place in the schedule.
      kind: one of :data:`KINDS`.
      gap_s: seconds after the previous fault ended (its hold over, its restart listening).
      target: "shard 0" / "shard 1" (the shard actors by ascending pid), a worker slot
        ("sync/1"), or "" (the server, the disk, the rogue's targets: every session).
      hold_s: stops and disk faults: how long they last; worker_kill: the delay before the
        restart; otherwise 0.
      delay_ms: worker_kill: how far into the push the SIGKILL comes.
    """

    index: int
    kind: str
    gap_s: float
    target: str
    hold_s: float
    delay_ms: float

    def describe(self) -> str:
        target = f" {self.target}" if self.target else ""
        hold = f" hold {self.hold_s:.1f} s" if self.hold_s else ""
        delay = f" {self.delay_ms:.0f} ms into a push" if self.kind == "worker_kill" else ""
        return f"#{self.index:<3} +{self.gap_s:4.1f} s  {self.kind}{target}{hold}{delay}"


def plan(seed: int, count: int, worker_slots: list[str], gap_s: tuple[float, float] = (3.0, 7.0),
         only: tuple[str, ...] = KINDS) -> list[PlannedFault]:
    """``count`` faults drawn from ``random.Random(seed)`` (workers chosen among ``worker_slots``);
    ``only``: the kinds to draw from (to reproduce one kind's symptom alone)."""
    unknown = sorted(set(only) - set(KINDS))
    if unknown or not only:
        raise ValueError(f"unknown fault kinds {unknown}: the kinds are {', '.join(KINDS)}")
    rng = random.Random(seed)
    kinds: list[str] = []
    while len(kinds) < count:
        kinds += rng.sample(list(only), len(only))
    faults = []
    for index, kind in enumerate(kinds[:count]):
        gap = round(rng.uniform(*gap_s), 1)
        target, hold, delay = "", 0.0, 0.0
        if kind in ("shard_kill", "shard_stop"):
            target = f"shard {rng.randrange(2)}"
        if kind in ("worker_stop", "worker_kill"):
            target = rng.choice(worker_slots)
        if kind in ("shard_stop", "worker_stop", "disk_full", "write_error"):
            hold = round(rng.uniform(2.0, 5.0), 1)
        if kind == "worker_kill":
            hold, delay = round(rng.uniform(0.5, 2.0), 1), round(rng.uniform(0.0, 20.0), 1)
        faults.append(PlannedFault(index, kind, gap, target, hold, delay))
    return faults
