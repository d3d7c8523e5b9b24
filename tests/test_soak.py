"""A short soak (bench/soak.py): the nemesis's durable sessions without faults, elastic members
leaving and joining, and a crowd creating, training and closing sessions of its own beside them,
against a real server (its own process tree, 2 shard actors). Nothing acknowledged is lost or
applied twice, the closed sessions leave no folder, and every process of the server is sampled."""

from __future__ import annotations

import io
import time

import pytest

from bench.checker import print_report
from bench.soak import SoakOptions, print_between, print_samples, run


@pytest.mark.slow
def test_a_short_soak_loses_nothing_and_the_crowds_closed_sessions_leave_no_folder(tmp_path):
    out = io.StringIO()
    report, soak = run(SoakOptions(minutes=0.5, crowd=6, crowd_steps=4, pause_s=0.5, rejoin_s=12.0, sample_s=5.0,
                                   warmup_s=5.0, settle_s=5.0, folder=str(tmp_path / "run")), out)
    print_samples(soak.samples, out)
    print_between(soak.between, out)
    print_report(report, out)
    text = out.getvalue()
    assert report.clean and not soak.crowd_errors, text + "\n" + "\n".join(soak.crowd_errors)
    assert soak.crowd_rounds >= 1 and soak.crowd_times, text
    assert report.faults.get("worker_kill", 0) >= 1, text  # an elastic member left and a new one joined
    last = soak.samples[-1]
    assert last.session_folders == 3, text  # the nemesis's three; the crowd's closed sessions left none
    titles = [name.split()[0] for name in last.processes]
    assert titles.count("ray::ShardActor") == 2 and "optserve.server.cli" in titles, text
    assert "ray::ShardActor" in text and "session folders: " in text
    assert set(last.heap) == {"coordinator", "shard-0", "shard-1"} and all(u > 0 for u, _ in last.heap.values()), text
    assert "malloc heap of shard-0: in use MB" in text, text
    # the crowd's clients (threads of this process) hold connections to the server: they are told apart
    assert any(kinds["from_here"] > 0 for s in soak.samples for kinds in s.descriptors.values()), text
    assert "fds of ray::ShardActor" in text and "less the crowd's connections" in text, text
    assert soak.between and "between rounds: fds of ray::ShardActor" in text, text  # sampled with no crowd session


def test_the_printed_figures_are_each_windows_peak_so_a_samples_phase_does_not_read_as_growth():
    from bench.soak import Sample, windows

    def sample(at_s, rss_mb, threads):
        return Sample(at_s, {"ray::ShardActor 7": (rss_mb << 20, threads, 40)}, 0, 0, 3)

    # a crowd's bursts: threads 100 between rounds, 140 inside one; memory flat at 400 MB
    samples = [sample(t, 400, 140 if t % 30 == 0 else 100) for t in range(0, 601, 10)]
    start, middle, end = windows(samples, 60.0)
    assert [s.at_s for s in start] == [0, 10, 20, 30, 40, 50, 60] and end[-1].at_s == 600
    assert [s.at_s for s in middle] == [270, 280, 290, 300, 310, 320, 330]
    out = io.StringIO()
    print_samples(samples[:-2], out, window_s=60.0)  # the last sample alone would read 140 -> 100
    row = next(line for line in out.getvalue().splitlines() if line.startswith("ray::ShardActor"))
    assert "140 / 140 / 140" in row and "+0.0%" in row and "-28.6%" not in row, out.getvalue()
    out = io.StringIO()
    print_samples(samples[:-2] + [sample(590, 440, 100), sample(600, 430, 100)], out, window_s=60.0)
    row = next(line for line in out.getvalue().splitlines() if line.startswith("ray::ShardActor"))
    assert "400 / 400 / 440" in row and "+10.0%" in row, out.getvalue()


def test_the_descriptor_census_tells_this_processs_connections_from_ones_whose_other_end_closed():
    import socket
    import subprocess
    import sys

    from bench._fd_census import census

    child = subprocess.Popen([sys.executable, "-c", (
        "import socket, sys\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); print(s.getsockname()[1], flush=True)\n"
        "held = [s.accept() for _ in range(3)]\n"
        "sys.stdin.read()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        ours = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        deadline = time.monotonic() + 10
        while census([child.pid])[child.pid]["from_here"] < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert census([child.pid])[child.pid]["from_here"] == 3
        for connection in ours[:2]:
            connection.close()  # the child keeps its ends: CLOSE_WAIT, no longer ours
        deadline = time.monotonic() + 10
        while census([child.pid])[child.pid]["close_wait"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        kinds = census([child.pid])[child.pid]
        assert kinds["from_here"] == 1 and kinds["close_wait"] == 2 and kinds["socket"] >= 1, kinds  # + the listener
        assert kinds["pipe"] >= 2, kinds  # its stdin and stdout
        ours[2].close()
    finally:
        child.kill()
        child.wait()
    assert census([child.pid]) == {child.pid: {kind: 0 for kind in kinds}}  # gone: nothing
