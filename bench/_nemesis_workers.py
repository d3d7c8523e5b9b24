"""The nemesis's worker processes (``python -m bench._nemesis_worker``), one per slot ("sync/0",
...): started, signalled, killed inside a push and restarted as a new worker (a fresh worker id
and call log per incarnation), and stopped at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent


class Slot:
    """One worker slot: its session, its data path, and the process now filling it."""

    def __init__(self, name: str, session: str, shm: bool):
        self.name, self.session, self.shm = name, session, shm
        self.incarnation = 0
        self.process: Optional[subprocess.Popen] = None
        self.worker_id = ""
        self.log = ""


class Workers:
    """The worker processes of a run; their call logs live in ``folder``."""

    def __init__(self, address: str, folder: str, slots: list[Slot], timeout_s: float, pace_s: float, seed: int):
        self.address, self.folder, self.timeout_s, self.pace_s, self.seed = address, folder, timeout_s, pace_s, seed
        self.slots = {slot.name: slot for slot in slots}
        self.stop_path = os.path.join(folder, "stop")
        self.logs: list[str] = []
        self.unstopped: list[str] = []

    def start_all(self) -> None:
        for slot in self.slots.values():
            self.spawn(slot.name)

    def spawn(self, name: str) -> None:
        slot = self.slots[name]
        slot.incarnation += 1
        slot.worker_id = f"{name.replace('/', '-')}-{slot.incarnation}"
        slot.log = os.path.join(self.folder, f"{slot.worker_id}.jsonl")
        self.logs.append(slot.log)
        command = [sys.executable, "-m", "bench._nemesis_worker", self.address, slot.session, slot.worker_id,
                   slot.log, self.stop_path, "--timeout", str(self.timeout_s), "--pace", str(self.pace_s),
                   "--seed", str(self.seed * 1000 + len(self.logs))] + (["--shm"] if slot.shm else [])
        with open(os.path.join(self.folder, f"{slot.worker_id}.out"), "w") as out:
            slot.process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)

    def signal(self, name: str, sig: int) -> bool:
        process = self.slots[name].process
        if process is None or process.poll() is not None:
            return False
        os.kill(process.pid, sig)
        return True

    def kill_in_push(self, name: str, delay_ms: float, within_s: float = 3.0) -> tuple[str, bool]:
        """SIGKILL of the slot's process ``delay_ms`` after a push of it starts (the last line of
        its log is a push without an outcome), or at ``within_s`` if none starts by then; returns
        (its worker id, whether it was inside a push)."""
        slot = self.slots[name]
        deadline = time.monotonic() + within_s
        inside = False
        while time.monotonic() < deadline:
            if _last_call_open(slot.log):
                inside = True
                break
            time.sleep(0.002)
        time.sleep(delay_ms / 1000.0)
        self.signal(name, signal.SIGKILL)
        slot.process.wait(timeout=30)
        return slot.worker_id, inside

    def stop_all(self, timeout_s: float) -> None:
        """Asks every worker to stop (the stop file) and waits; one still running after
        ``timeout_s`` is SIGKILLed and named in :attr:`unstopped` (its open call counts as a hang)."""
        Path(self.stop_path).touch()
        deadline = time.monotonic() + timeout_s
        for slot in self.slots.values():
            process = slot.process
            if process is None:
                continue
            process.send_signal(signal.SIGCONT)  # a stopped one could never see the file
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.unstopped.append(slot.worker_id)
                process.kill()
                process.wait(timeout=30)


def _last_call_open(path: str) -> bool:
    """True when the last complete line of a worker's log is a push it has not answered yet."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 4096))
            tail = fh.read()
    except OSError:
        return False
    lines = tail.rstrip(b"\n").split(b"\n")
    if not tail.endswith(b"\n") or not lines:
        return False
    try:
        record = json.loads(lines[-1])
    except ValueError:
        return False
    return record.get("kind") == "push" and record.get("ended") is None


def load_calls(paths: list[str]) -> list:
    """The :class:`bench.checker.CallRecord` of every call in the logs: each call's last line (its
    outcome, or the line written before it when its process died inside it); a torn last line
    is skipped."""
    from bench.checker import CallRecord

    fields = set(CallRecord.__dataclass_fields__)
    calls: dict[str, dict] = {}
    for path in paths:
        try:
            with open(path) as fh:
                lines = fh.read().splitlines()
        except FileNotFoundError:
            continue
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            calls[record["id"]] = record
    return [CallRecord(**{k: v for k, v in r.items() if k in fields}) for r in calls.values()]
