"""The client side of ``python -m bench.crowd``: one process of client threads, each client with
its own ``Client`` (its own connections) and its own worker identity in a session.

A process creates the asynchronous sessions it hosts (every worker of such a session lives in
the same process), attaches each client, reports ready, waits for the go, and then every client
pauses (uniformly 0 to ``2 * mean_pause_s``; the first pause from :func:`first_pause`) and does a
``push_pull`` step, again and again until ``duration_s`` has passed. The sync session's workers
(one per process, the session created by the bench) pause 0 to ``2 * sync_pause_s``: a sync step
waits for all of its workers, so a long pause would be the round's time, not the server's.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import threading
import time
from typing import Optional

import numpy as np

SHAPES = {"w": (64, 32), "b": (32,)}  # small tensors, spread over both shards (min_shard_bytes=0)
ADAM = {"name": "adam", "args": {"learning_rate": 0.01}}
GRACE_S = 90.0  # how long a step in flight at the end may still take before its client counts as unfinished
SLOW_S = 1.0  # a step at least this long is noted with its start (when in the phase the slow ones come)


@dataclasses.dataclass(frozen=True)
class ClientPlan:
    """One client: the session it steps in, its worker id, whether that session is the sync one."""

    session: str
    worker_id: str
    sync: bool = False


@dataclasses.dataclass(frozen=True)
class ProcessPlan:
    """What one process runs: ``creates`` (async sessions it creates before attaching), its
    ``clients``, their mean pauses, and how long they step."""

    address: str
    creates: tuple[str, ...]
    clients: tuple[ClientPlan, ...]
    mean_pause_s: float
    sync_pause_s: float
    duration_s: float
    seed: int
    shared_memory: bool = False
    stream_idle_s: Optional[float] = None  # the clients' ``Client(stream_idle_s=...)`` (None: its default)


@dataclasses.dataclass
class ProcessResult:
    """What one process measured: step times (seconds) of async and sync steps that started
    before the end, errors by type, clients still in a step ``GRACE_S`` after the end, the
    process's CPU seconds from the go until its clients finished, and the steps they did."""

    async_times: list[float] = dataclasses.field(default_factory=list)
    sync_times: list[float] = dataclasses.field(default_factory=list)
    sync_marks: list[tuple] = dataclasses.field(default_factory=list)  # (version, started, ended): monotonic s
    slow_starts: list[float] = dataclasses.field(default_factory=list)  # seconds from the go, of steps >= SLOW_S
    errors: dict[str, int] = dataclasses.field(default_factory=dict)
    first_error: dict[str, str] = dataclasses.field(default_factory=dict)  # type -> its first message
    unfinished: int = 0
    idle_clients: int = 0  # clients without a single step done
    cpu_s: float = 0.0
    failure: Optional[str] = None  # set up failed (a session not created, a client not attached)


def first_pause(rng: random.Random, longest_s: float) -> float:
    """A client's pause before its first step, so that the crowd offers its rate from the go.

    Pauses between steps are uniform on [0, L]. Had every client also waited a uniform pause
    before its first step, all would have started their cycles together, and the steps offered per
    second would overshoot near t = L (at L, 1.3x the rate) before settling: a burst that the
    bench would time as the server's. Each client's first pause is instead the time left of a
    pause already under way, whose density is 2 (L - x) / L**2 on [0, L]: the steps then arrive
    at the steady rate from the start."""
    return longest_s * (1.0 - math.sqrt(rng.random()))


def _grads() -> dict[str, np.ndarray]:
    return {name: np.full(shape, 0.01, np.float32) for name, shape in SHAPES.items()}


class _Stepper:
    """One client's loop; ``times`` and ``errors`` are read once its thread ended (or not)."""

    def __init__(self, plan: ClientPlan, process: ProcessPlan, rng: random.Random):
        from optserve.client import Client

        self.plan = plan
        self.times: list[float] = []
        self.sync_marks: list[tuple] = []  # sync steps: (version, started, ended), time.monotonic() seconds
        self.slow_starts: list[float] = []  # seconds from the go
        self.errors: dict[str, int] = {}
        self.first_error: dict[str, str] = {}
        self._pause = process.sync_pause_s if plan.sync else process.mean_pause_s
        self._rng = rng
        idle = {} if process.stream_idle_s is None else {"stream_idle_s": process.stream_idle_s}
        self.client = Client(process.address, timeout=120.0, shared_memory=process.shared_memory, **idle)
        self.session = self.client.session(plan.session, worker_id=plan.worker_id)
        if plan.sync:  # an elastic member: in the rounds from its join until it detaches
            self.session.join()
        self.session.pull()

    def run(self, end_at: float, go_at: float) -> None:
        grads = _grads()
        time.sleep(first_pause(self._rng, 2.0 * self._pause))
        while True:
            if time.monotonic() >= end_at:
                if self.plan.sync:  # the others' last rounds close without it
                    self.session.detach()
                return
            started, started_at = time.perf_counter(), time.monotonic()
            try:
                self.session.push_pull(grads)
            except Exception as error:  # noqa: BLE001 - counted by type and reported, never hidden
                name = type(error).__name__
                self.errors[name] = self.errors.get(name, 0) + 1
                self.first_error.setdefault(name, str(error)[:300])
                time.sleep(self._rng.uniform(0.0, 2.0 * self._pause))
                continue
            took = time.perf_counter() - started
            self.times.append(took)
            if self.plan.sync and self.session.last_step.version is not None:  # the version its push went into
                self.sync_marks.append((self.session.last_step.version, started_at, time.monotonic()))
            if took >= SLOW_S:
                self.slow_starts.append(started - go_at)
            time.sleep(self._rng.uniform(0.0, 2.0 * self._pause))


def run_process(plan: ProcessPlan, ready, go, abort, results) -> None:
    """A spawned process's body: sets up, puts ``"ready"`` (or why not) on ``ready``, waits for
    ``go`` (an event), steps, then puts its :class:`ProcessResult` on ``results``. It leaves
    without stepping once ``abort`` is set or its parent is gone; what it created is closed on
    every way out."""
    from optserve.client import Client

    parent = os.getppid()
    result = ProcessResult()
    owner = None
    created = []
    steppers: list[_Stepper] = []
    try:
        try:
            owner = Client(plan.address, timeout=120.0, shared_memory=plan.shared_memory)
            params = {name: np.zeros(shape, np.float32) for name, shape in SHAPES.items()}
            for name in plan.creates:
                created.append(owner.create_session(name, params, ADAM, mode="async"))
            rng = random.Random(plan.seed)
            for client in plan.clients:
                steppers.append(_Stepper(client, plan, random.Random(rng.random())))
        except Exception as error:  # noqa: BLE001 - the bench reports it and stops
            result.failure = f"{type(error).__name__}: {error}"
        ready.put(result.failure or "ready")
        if result.failure is not None:
            return
        while not go.wait(timeout=1.0):
            if abort.is_set() or os.getppid() != parent:
                return
        _step(steppers, plan.duration_s, result)
        results.put(result)
    finally:
        for stepper in steppers:
            stepper.client.close()
        for session in created:
            try:
                session.close()
            except Exception:  # noqa: BLE001 - the server's teardown removes it anyway
                pass
        if owner is not None:
            owner.close()


def _step(steppers: list[_Stepper], duration_s: float, result: ProcessResult) -> None:
    """Runs every client's loop for ``duration_s`` and gathers what they measured into ``result``."""
    cpu_at_go = time.process_time()
    go_at = time.perf_counter()
    end_at = time.monotonic() + duration_s
    threads = [threading.Thread(target=s.run, args=(end_at, go_at), daemon=True) for s in steppers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=max(0.0, end_at + GRACE_S - time.monotonic()))
    result.cpu_s = time.process_time() - cpu_at_go
    for stepper, thread in zip(steppers, threads):
        (result.sync_times if stepper.plan.sync else result.async_times).extend(stepper.times)
        result.sync_marks.extend(stepper.sync_marks)
        result.slow_starts.extend(stepper.slow_starts)
        for name, count in stepper.errors.items():
            result.errors[name] = result.errors.get(name, 0) + count
            result.first_error.setdefault(name, stepper.first_error[name])
        result.unfinished += thread.is_alive()
        result.idle_clients += not stepper.times


def after_last_push(marks: list[tuple]) -> list[float]:
    """Each sync step's time from its round's last push (the latest start among the steps that
    produced its version) to its own end, in seconds: the server's part of a sync step, without
    the wait for the round's other workers. ``marks``: ``(version, started, ended)`` of every
    sync step, from all processes (``time.monotonic()`` is one clock for the machine)."""
    last_start: dict[int, float] = {}
    for version, started, _ in marks:
        last_start[version] = max(started, last_start.get(version, started))
    return [max(0.0, ended - last_start[version]) for version, _, ended in marks]
