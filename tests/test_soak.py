"""A short soak (bench/soak.py): the nemesis's durable sessions without faults, elastic members
leaving and joining, and a crowd creating, training and closing sessions of its own beside them,
against a real server (its own process tree, 2 shard actors). Nothing acknowledged is lost or
applied twice, the closed sessions leave no folder, and every process of the server is sampled."""

from __future__ import annotations

import io

import pytest

from bench.checker import print_report
from bench.soak import SoakOptions, print_samples, run


@pytest.mark.slow
def test_a_short_soak_loses_nothing_and_the_crowds_closed_sessions_leave_no_folder(tmp_path):
    out = io.StringIO()
    report, soak = run(SoakOptions(minutes=0.5, crowd=6, crowd_steps=4, pause_s=0.5, rejoin_s=12.0, sample_s=5.0,
                                   warmup_s=5.0, settle_s=5.0, folder=str(tmp_path / "run")), out)
    print_samples(soak.samples, out)
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
