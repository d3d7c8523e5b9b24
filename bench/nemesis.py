"""A seeded nemesis: a durable multi-client workload against a real server, faults mixed in on a
schedule, and the checker's verdict at the end.

    .venv/bin/python -m bench.nemesis --minutes 3 --seed 1
    .venv/bin/python -m bench.nemesis --minutes 1 --seed 2 --kinds disk_full   # one kind alone
    .venv/bin/python -m bench.nemesis --seed 2 --dir /tmp/run   # keep the logs (kept anyway when not clean)

The folder keeps ``server.log``, each worker's call log (``WORKER.jsonl``), and for a closer look
``faults.jsonl``, ``calls.jsonl``, ``history-SESSION.jsonl`` and ``final-SESSION.npz``.

The server is ``optserve serve --checkpoint-dir DIR`` in its own process tree (2 shards; DIR on a
small filesystem of its own when this machine can mount one: bench/_nemesis_disk.py). Three
durable sessions train at once (a few KB of parameters each):

- ``sync``: plain sync, 2 workers (adam);
- ``async``: async, staleness policy SCALE, 2 workers (adam);
- ``elastic``: elastic sync (``num_workers=3, min_workers=1, max_workers=8, lease_s=3``, late
  gradients dropped), 3 workers (SGD with momentum);

each worker a NumPy client in its own process (bench/_nemesis_worker.py), some moving tensor bytes
through shared memory, the others over gRPC, logging every call it makes.

The faults (bench/_nemesis_schedule.py) are drawn from ``random.Random(seed)`` before the run and
printed: the same seed gives the same schedule. They come one at a time, each ``gap_s`` after the
previous one ended, while the run's minutes last: SIGKILL of a shard actor, SIGKILL of the whole
server tree and a restart on the same port and directory, SIGSTOP/SIGCONT of a shard and of a
worker, a full disk, a failing disk, a rogue client's garbage (bench/_nemesis_rogue.py), and a
worker SIGKILLed inside a push (restarted as a new worker). A kind whose rig cannot be built here
is skipped, with the reason printed.

Meanwhile each session's ``history()`` is followed (its home shard keeps only the latest versions).
After a quiet ``settle_s``, the workers stop, the final parameters are pulled, and the checker
(bench/checker.py) proves from the workers' call logs and the histories that no acknowledged push
was lost or applied twice, that the versions are contiguous, that the parameters equal a replay,
and that every call ended with a documented status in time; it prints the faults, the steps, and
the longest unavailability after each kind of fault. Exit status 1 when the report is not clean.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Optional, TextIO, Union

import numpy as np

from bench import _nemesis_disk
from bench._nemesis_rogue import Rogue
from bench._nemesis_schedule import KINDS, PlannedFault, plan
from bench._nemesis_server import NemesisServer
from bench._termination import exit_on_termination
from bench._nemesis_workers import Slot, Workers, load_calls
from bench.checker import CheckReport, FaultRecord, HistoryFollower, SessionRun, check, print_report, shard_map

SHAPES = {"w": (16, 12), "b": (12,), "v": (40,)}
MAX_SESSION_BYTES = 1 << 20  # the rogue's oversize session passes it


@dataclasses.dataclass(frozen=True)
class SessionPlan:
    """A session of the workload: its optimizer and options, and one worker per ``shm`` entry
    (True: shared memory, False: gRPC bytes)."""

    name: str
    kind: str  # "sync", "async" or "elastic"
    optimizer: dict
    options: dict
    shm: tuple[bool, ...]

    @property
    def mode(self) -> str:
        return "async" if self.kind == "async" else "sync"


SESSIONS = (
    SessionPlan("sync", "sync", {"name": "adam", "args": {"learning_rate": 0.01}}, {"mode": "sync", "num_workers": 2},
                (True, False)),
    SessionPlan("async", "async", {"name": "adam", "args": {"learning_rate": 0.01}},
                {"mode": "async", "staleness_policy": "scale"}, (True, False)),
    SessionPlan("elastic", "elastic", {"name": "sgd", "args": {"learning_rate": 0.05, "momentum": 0.9}},
                {"mode": "sync", "num_workers": 3, "min_workers": 1, "max_workers": 8, "lease_s": 3.0, "late": "drop"},
                (True, False, True)),
)


def initial_params(seed: int, session: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([seed, sum(map(ord, session))])
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


@dataclasses.dataclass
class Options:
    minutes: float
    seed: int
    gap_s: tuple[float, float] = (3.0, 7.0)
    settle_s: float = 10.0
    timeout_s: float = 30.0
    pace_s: float = 0.05
    kinds: tuple[str, ...] = KINDS
    folder: Optional[str] = None
    out: TextIO = sys.stdout


class Nemesis:
    """One run (see the module docstring): :meth:`run` returns the checker's report."""

    def __init__(self, options: Options):
        self.o = options
        self.folder = options.folder or tempfile.mkdtemp(prefix="optserve-nemesis-")
        os.makedirs(self.folder, exist_ok=True)
        self.slots = [Slot(f"{p.name}/{i}", p.name, shm) for p in SESSIONS for i, shm in enumerate(p.shm)]
        count = int(options.minutes * 60 / options.gap_s[0]) + 8
        self.schedule = plan(options.seed, count, [s.name for s in self.slots], options.gap_s, options.kinds)
        self.faults: list[FaultRecord] = []
        self.skipped: dict[str, str] = {}
        self.followers = {p.name: HistoryFollower() for p in SESSIONS}
        self._stop_following = threading.Event()
        self._started = time.time()
        self.server: Optional[NemesisServer] = None
        self.rig: Union[_nemesis_disk.DiskRig, str] = "not built"
        self.workers: Optional[Workers] = None
        self.rogue: Optional[Rogue] = None

    def say(self, text: str) -> None:
        self.o.out.write(f"[{time.time() - self._started:7.1f} s] {text}\n")
        self.o.out.flush()

    # ------------------------------------------------------------------ the run
    def run(self) -> CheckReport:
        self.say(f"nemesis seed {self.o.seed}, {self.o.minutes:g} min, folder {self.folder}; schedule:")
        for fault in self.schedule:
            self.o.out.write(f"    {fault.describe()}\n")
        log = open(os.path.join(self.folder, "server.log"), "a")
        try:
            self.rig = _nemesis_disk.build(os.path.join(self.folder, "rig"))
            if isinstance(self.rig, str):
                for kind in ("disk_full", "write_error"):
                    self.skipped[kind] = f"no disk rig: {self.rig}"
                checkpoints = os.path.join(self.folder, "ckpt")
            else:
                checkpoints = os.path.join(self.rig.mount, "ckpt")
            self.server = NemesisServer(self._server_args(checkpoints), log)
            self.server.start()
            self.say(f"server listening on {self.server.address}")
            self._create_sessions()
            self.workers = Workers(self.server.address, self.folder, self.slots, self.o.timeout_s, self.o.pace_s,
                                   self.o.seed)
            self.rogue = Rogue(self.server.address, {p.name: p.kind for p in SESSIONS}, MAX_SESSION_BYTES,
                               random.Random(self.o.seed + 1))
            self.workers.start_all()
            following = threading.Thread(target=self._follow, daemon=True)
            following.start()
            self._inject_until(time.monotonic() + self.o.minutes * 60)
            self.say(f"faults over; settling {self.o.settle_s:g} s")
            time.sleep(self.o.settle_s)
            self.server.dump_stacks()  # into server.log: where a session that stalled waits
            self.workers.stop_all(2 * self.o.timeout_s + 15)
            run_ended = time.time()
            self._stop_following.set()
            following.join(timeout=60)
            runs = self._final_runs()
            calls = load_calls(self.workers.logs) + self.rogue.records
            self._save(calls, runs)
            self.say(f"checking {len(calls)} calls")
            return check(runs, calls, self.faults, self.skipped, run_ended=run_ended)
        finally:
            if self.workers is not None:
                for slot in self.workers.slots.values():
                    if slot.process is not None and slot.process.poll() is None:
                        slot.process.kill()
            if self.server is not None:
                self.server.stop()
            if not isinstance(self.rig, str):
                self.rig.close()
            log.close()

    def _server_args(self, checkpoints: str) -> list[str]:
        """``optserve serve``'s flags beyond the port and the shards."""
        return ["--checkpoint-dir", checkpoints, "--checkpoint-every-steps", "25",
                "--max-session-bytes", str(MAX_SESSION_BYTES)]

    def _save(self, calls, runs: list[SessionRun]) -> None:
        """For a closer look, beside the workers' logs: the faults injected and every call (JSON
        lines), each session's history (``history-NAME.jsonl``) and final parameters (``final-NAME.npz``)."""
        for name, records in (("faults.jsonl", self.faults), ("calls.jsonl", calls)):
            with open(os.path.join(self.folder, name), "w") as fh:
                for record in records:
                    fh.write(json.dumps(dataclasses.asdict(record)) + "\n")
        for run in runs:
            with open(os.path.join(self.folder, f"history-{run.name}.jsonl"), "w") as fh:
                for record in run.history:
                    fh.write(json.dumps(record.to_json() if hasattr(record, "to_json")
                                        else dataclasses.asdict(record)) + "\n")
            np.savez(os.path.join(self.folder, f"final-{run.name}.npz"), **run.final)

    def _create_sessions(self) -> None:
        from optserve.client import Client

        with Client(self.server.address, timeout=60.0) as client:
            for p in SESSIONS:
                client.create_session(p.name, initial_params(self.o.seed, p.name), p.optimizer,
                                      **p.options).detach()

    def _follow(self) -> None:
        """Follows every session's history (every 2 s) until the run ends."""
        from optserve.client import Client

        with Client(self.server.address, timeout=10.0) as client:
            sessions: dict = {}
            while not self._stop_following.wait(2.0):
                for name, follower in self.followers.items():
                    try:
                        if name not in sessions:
                            sessions[name] = client.session(name, worker_id="nemesis-history")
                        follower.add(sessions[name].history(since=follower.since))
                    except Exception:  # the server may be down: the next round asks again
                        pass

    def _final_runs(self) -> list[SessionRun]:
        """Each session's final version, parameters and whole followed history."""
        from optserve.client import Client

        runs = []
        with Client(self.server.address, timeout=60.0) as client:
            for p in SESSIONS:
                session = client.session(p.name, worker_id="nemesis-final")
                follower = self.followers[p.name]
                follower.add(session.history(since=follower.since))
                follower.settle(session.history(since=0))  # the home shard's word on every version it holds
                final = session.pull()
                status = client.session_status(p.name)
                version = status.version
                if session.version != version:
                    follower.conflicts.append(f"pulled version {session.version} != status version {version}")
                runs.append(SessionRun(p.name, p.mode, p.optimizer, initial_params(self.o.seed, p.name), final,
                                       version, list(follower.records), tuple(follower.conflicts),
                                       tuple(follower.rollbacks), shard_map(status)))
                session.detach()
        return runs

    # ------------------------------------------------------------------ the faults
    def _inject_until(self, end: float) -> None:
        for fault in self.schedule:
            if time.monotonic() + fault.gap_s >= end:
                self.say(f"time is up: faults #{fault.index} on not reached")
                return
            time.sleep(fault.gap_s)
            if fault.kind in self.skipped:
                self.say(f"#{fault.index} {fault.kind}: skipped ({self.skipped[fault.kind]})")
                continue
            record = getattr(self, f"_{fault.kind}")(fault)
            if record is None:
                self.say(f"#{fault.index} {fault.kind}: not injected (no shard process found within a minute)")
                continue
            self.faults.append(record)
            self.say(f"#{fault.index} {fault.kind} {record.target} {record.note}".rstrip())
        self.say("schedule exhausted")

    def _shard_pid(self, fault: PlannedFault) -> Optional[int]:
        """The target shard's pid (shards by ascending pid), waiting for both to run (None: none runs)."""
        deadline = time.monotonic() + 60
        pids = self.server.shard_pids()
        while len(pids) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
            pids = self.server.shard_pids()
        return pids[int(fault.target.split()[1]) % len(pids)] if pids else None

    def _shard_kill(self, fault: PlannedFault) -> Optional[FaultRecord]:
        pid = self._shard_pid(fault)
        if pid is None:
            return None
        injected = time.time()
        os.kill(pid, signal.SIGKILL)
        return FaultRecord(fault.kind, f"{fault.target} (pid {pid})", injected)

    def _server_kill(self, fault: PlannedFault) -> FaultRecord:
        injected = time.time()
        self.server.kill_tree()
        listening = self.server.start()
        return FaultRecord(fault.kind, "server", injected, listening,
                           note=f"listening again {listening - injected:.1f} s after the kill")

    def _shard_stop(self, fault: PlannedFault) -> Optional[FaultRecord]:
        pid = self._shard_pid(fault)
        if pid is None:
            return None
        injected = time.time()
        os.kill(pid, signal.SIGSTOP)
        time.sleep(fault.hold_s)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        return FaultRecord(fault.kind, f"{fault.target} (pid {pid})", injected, time.time())

    def _worker_stop(self, fault: PlannedFault) -> FaultRecord:
        slot = self.workers.slots[fault.target]
        injected = time.time()
        self.workers.signal(fault.target, signal.SIGSTOP)
        time.sleep(fault.hold_s)
        self.workers.signal(fault.target, signal.SIGCONT)
        return FaultRecord(fault.kind, slot.worker_id, injected, time.time(), stopped=(slot.worker_id,))

    def _disk(self, fault: PlannedFault, fill) -> FaultRecord:
        injected = time.time()
        fill()
        time.sleep(fault.hold_s)
        self.rig.free()
        return FaultRecord(fault.kind, "checkpoint disk", injected, time.time())

    def _disk_full(self, fault: PlannedFault) -> FaultRecord:
        return self._disk(fault, self.rig.fill_disk)

    def _write_error(self, fault: PlannedFault) -> FaultRecord:
        return self._disk(fault, self.rig.fail_writes)

    def _rogue(self, fault: PlannedFault) -> FaultRecord:
        injected = time.time()
        before = len(self.rogue.records)
        try:
            self.rogue.burst()
            note = f"{len(self.rogue.records) - before} requests"
        except Exception as error:  # the session lookup before the garbage failed: nothing sent to check
            note = f"burst cut short: {type(error).__name__}: {str(error)[:120]}"
        return FaultRecord(fault.kind, "every session", injected, time.time(), note=note)

    def _worker_kill(self, fault: PlannedFault) -> FaultRecord:
        injected = time.time()
        victim, inside = self.workers.kill_in_push(fault.target, fault.delay_ms)
        time.sleep(fault.hold_s)
        self.workers.spawn(fault.target)
        return FaultRecord(fault.kind, victim, injected, victims=(victim,),
                           note="inside a push" if inside else "between pushes (none started within 3 s)")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.nemesis", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0, help="how long faults are injected")
    parser.add_argument("--small", action="store_true", help="a one-minute run (as `python -m bench --small` asks)")
    parser.add_argument("--seed", type=int, default=0, help="draws the fault schedule (same seed, same schedule)")
    parser.add_argument("--gap", type=float, nargs=2, default=(3.0, 7.0), metavar=("MIN_S", "MAX_S"),
                        help="seconds between one fault's end and the next fault")
    parser.add_argument("--settle", type=float, default=10.0, help="quiet seconds after the last fault")
    parser.add_argument("--timeout", type=float, default=30.0, help="the workers' Client timeout")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help="the fault kinds to draw from, comma-separated (default: all)")
    parser.add_argument("--dir", default=None, help="folder for logs and checkpoints (default: a temporary one)")
    args = parser.parse_args(argv)
    logging.getLogger("optserve.client").setLevel(logging.ERROR)  # the history follower's retries during outages
    options = Options(1.0 if args.small else args.minutes, args.seed, tuple(args.gap), args.settle, args.timeout,
                      kinds=tuple(k for k in args.kinds.split(",") if k), folder=args.dir)
    nemesis = Nemesis(options)
    with exit_on_termination():
        report = nemesis.run()
    print_report(report)
    if report.clean and args.dir is None:
        shutil.rmtree(nemesis.folder, ignore_errors=True)
    else:
        print(f"logs: {nemesis.folder} (server.log, one .jsonl call log per worker)")
    return 0 if report.clean else 1


if __name__ == "__main__":
    sys.exit(main())
