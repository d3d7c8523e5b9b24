"""The nemesis (bench/nemesis.py): its schedule is the seed's, its call logs read back as the
workers wrote them, and a short run against a real durable server (sync, async and elastic
sessions, worker processes over shared memory and gRPC, faults of every kind the machine can
rig) ends with the checker's report clean: nothing acknowledged lost, nothing applied twice, the
parameters equal to a replay of the histories, every call ended with a documented status."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from bench._nemesis_schedule import KINDS, plan
from bench._nemesis_workers import load_calls
from bench.checker import print_report


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLOTS = ["sync/0", "sync/1", "async/0", "elastic/0"]
SEED = 5


def test_the_same_seed_gives_the_same_schedule_and_every_kind_comes_before_any_comes_twice():
    first, again, other = plan(SEED, 24, SLOTS), plan(SEED, 24, SLOTS), plan(SEED + 1, 24, SLOTS)
    assert first == again and first != other
    assert sorted(f.kind for f in first[:len(KINDS)]) == sorted(KINDS)
    assert all(f.target in SLOTS for f in first if f.kind in ("worker_stop", "worker_kill"))
    assert [f.kind for f in plan(SEED, 6, SLOTS, only=("rogue",))] == ["rogue"] * 6
    with pytest.raises(ValueError, match="unknown fault kinds"):
        plan(SEED, 3, SLOTS, only=("meteor",))


def test_call_logs_read_back_each_calls_last_line_and_skip_a_line_torn_by_a_kill(tmp_path):
    def line(outcome, ended):
        return json.dumps({"id": "w-1#1", "session": "s", "worker": "w-1", "client_id": "w-1/x", "sequence": 1,
                           "seed": 7, "kind": "push", "started": 1.0, "ended": ended, "outcome": outcome,
                           "version": 3 if outcome == "ok" else None, "deadline_s": 68.0, "detail": ""})

    answered, killed = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    answered.write_text(line("", None) + "\n" + line("ok", 2.0) + "\n")
    killed.write_text(line("", None).replace("w-1", "w-2") + "\n" + '{"id": "w-2#2", "sess')  # torn by SIGKILL
    calls = sorted(load_calls([str(answered), str(killed), str(tmp_path / "never-written.jsonl")]),
                   key=lambda c: c.worker)
    assert [(c.worker, c.outcome, c.ended, c.version) for c in calls] == [("w-1", "ok", 2.0, 3),
                                                                         ("w-2", "", None, None)]


@pytest.mark.slow
def test_a_one_minute_nemesis_run_loses_nothing_duplicates_nothing_and_answers_every_call_as_documented(tmp_path):
    """Every fault kind within a minute: no acknowledged push lost or applied twice, every call
    ended with a documented status in time, every rogue request refused as documented, and the
    parameters equal to a replay of each session's history (versions a restore rolled back, which
    no acknowledgement covered, followed as the server decided them again)."""
    from bench.nemesis import Nemesis, Options

    out = io.StringIO()  # faults 2-4 s apart: every kind comes within the minute
    nemesis = Nemesis(Options(minutes=1.0, seed=SEED, gap_s=(2.0, 4.0), settle_s=8.0, folder=str(tmp_path / "run"),
                              out=out))
    report = nemesis.run()
    print_report(report, out)
    text = out.getvalue() + f"\nlogs: {nemesis.folder}"
    assert len(report.faults) + len(report.skipped_faults) >= len(KINDS) - 2, text  # (nearly) every kind came
    assert report.lost == 0 and report.duplicated == 0, text
    assert not report.undocumented and not report.hangs and not report.rogue_unexpected, text
    assert report.clean, text  # the replays and the histories too


def _sessions_naming(text: str) -> set[int]:
    """The process sessions of every live process whose command line contains ``text``."""
    sessions = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if text.encode() in fh.read():
                    sessions.add(os.getsid(int(pid)))
        except (OSError, ProcessLookupError):
            pass
    return sessions


def _live_in(sessions: set[int]) -> list[str]:
    live = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(pid)) in sessions:
                with open(f"/proc/{pid}/stat") as fh:
                    if fh.read().rsplit(")", 1)[1].split()[0] != "Z":
                        live.append(pid)
        except (OSError, ProcessLookupError):
            pass
    return live


def _left_behind(folder: str, sessions: set[int]) -> tuple[list[str], list[str], list[str]]:
    """What is still there of a run in ``folder``: live processes of ``sessions``, mounts and
    loop devices under ``folder``."""
    mounts = [line.split()[1] for line in open("/proc/self/mounts") if folder in line.split()[1]]
    loops = [line.split(":")[0] for line in subprocess.run(["losetup", "-a"], capture_output=True,
                                                            text=True).stdout.splitlines() if folder in line]
    return _live_in(sessions), mounts, loops


def _clear(processes: list[str], mounts: list[str], loops: list[str]) -> None:
    """Kills ``processes`` and undoes ``mounts`` and ``loops`` (a failed test leaves nothing behind)."""
    for pid in processes:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    for mount in sorted(mounts, key=len, reverse=True):  # the disk before the tmpfs under it
        subprocess.run(["umount", "-l", mount], capture_output=True)
    for loop in loops:
        subprocess.run(["losetup", "-d", loop], capture_output=True)


@pytest.mark.slow
def test_a_nemesis_stopped_by_sigterm_unmounts_its_disk_and_leaves_no_process_behind(tmp_path):
    """``kill`` of a running ``python -m bench.nemesis`` tears down what it built, as Ctrl-C does:
    exit status 143, its disk rig unmounted and its loop device detached, its worker processes
    and the server's whole process tree gone."""
    folder = str(tmp_path / "run")
    output = tmp_path / "nemesis.out"
    with open(output, "w") as out:
        nemesis = subprocess.Popen([sys.executable, "-m", "bench.nemesis", "--minutes", "5", "--seed", str(SEED),
                                    "--kinds", "rogue", "--dir", folder], cwd=ROOT, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    sessions = {nemesis.pid}
    try:
        deadline = time.monotonic() + 180
        while not any(n.endswith(".jsonl") and os.path.getsize(os.path.join(folder, n))
                      for n in (os.listdir(folder) if os.path.isdir(folder) else ())):
            assert nemesis.poll() is None and time.monotonic() < deadline, output.read_text()[-3000:]
            time.sleep(0.5)  # until a worker logged its first call: server, sessions and workers all up
        sessions |= _sessions_naming(folder)  # the server's tree is a session of its own
        rigged = any(folder in line for line in open("/proc/self/mounts"))
        nemesis.send_signal(signal.SIGTERM)
        nemesis.wait(timeout=180)
    finally:
        left = _left_behind(folder, sessions | _sessions_naming(folder))
        _clear(*left)
    said = output.read_text()[-3000:]
    assert nemesis.returncode == 128 + signal.SIGTERM, said
    assert left == ([], [], []), (rigged, left, said)
    assert len(sessions) >= 2, said  # the workers' and the server's were both looked at
