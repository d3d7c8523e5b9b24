"""``optserve demo`` end to end, at reduced size: its own server, Ray and worker processes."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _optserve_command() -> list[str]:
    script = Path(sys.executable).parent / "optserve"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from optserve.server.cli import main; sys.exit(main())"]


def test_demo_argument_errors_name_the_flag():
    from optserve.demo.config import parse_args

    with pytest.raises(ValueError, match="--steps"):
        parse_args(["--steps", "0"])
    assert parse_args(["--quick"]).steps < parse_args([]).steps
    with pytest.raises(ValueError, match="--compression sparseloco compresses DiLoCo's exchanges: it needs --diloco"):
        parse_args(["--compression", "sparseloco"])
    with pytest.raises(ValueError, match="drop --wire-dtype"):
        parse_args(["--diloco", "5", "--compression", "sparseloco", "--wire-dtype", "int8"])


def test_demo_diloco_runs_twenty_outer_rounds_unless_steps_are_given():
    from optserve.demo.config import parse_args

    assert parse_args(["--diloco", "20"]).steps == 400
    assert parse_args(["--diloco", "20", "--steps", "160"]).steps == 160
    assert parse_args(["--diloco", "5", "--quick"]).steps == 30


def test_demo_learning_rate_is_warmup_cosine_by_spec_unless_constant_or_diloco():
    from optserve.demo.config import parse_args

    cfg = parse_args([])
    assert cfg.schedule == "warmup_cosine" and cfg.updates == 300
    assert cfg.learning_rate() == {"schedule": "warmup_cosine_decay_schedule", "init_value": 0.0, "peak_value": 0.01,
                                   "warmup_steps": 15, "decay_steps": 300, "end_value": 0.001}
    assert parse_args(["--quick"]).learning_rate()["warmup_steps"] == 3  # 5% of 2 x 30 updates
    assert parse_args(["--schedule", "constant", "--lr", "0.02"]).learning_rate() == 0.02
    assert parse_args(["--diloco", "5"]).schedule == "constant"  # DiLoCo compares at a constant rate
    with pytest.raises(ValueError, match="--schedule"):
        parse_args(["--diloco", "5", "--schedule", "warmup_cosine"])


def test_demo_in_process_twin_follows_the_servers_schedule_step_by_step():
    torch = pytest.importorskip("torch")
    from optserve.demo.config import parse_args
    from optserve.demo.optimizers import in_process_optimizer
    from optserve.optim_kernels.schedules import build_schedule

    cfg = parse_args(["--quick"])
    spec = cfg.learning_rate()
    optimizer, scheduler = in_process_optimizer("adam", spec, torch.nn.Linear(2, 2).parameters(), cfg.updates)
    applied = []
    for _ in range(cfg.updates):
        applied.append(optimizer.param_groups[0]["lr"])  # the rate step() applies
        optimizer.step()
        scheduler.step()
    schedule = build_schedule(spec, "test")  # what the server evaluates at its step count 0, 1, ...
    assert applied == pytest.approx([float(schedule(t)) for t in range(cfg.updates)], abs=1e-9)
    assert applied[0] == 0.0 and max(applied) == pytest.approx(0.01)


@pytest.mark.slow
def test_demo_trains_two_worker_processes_and_reports_table_plot_and_summary(tmp_path):
    out = tmp_path / "demo_out"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        _optserve_command() + ["demo", "--quick", "--no-progress", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "optserve async, 2 worker processes" in proc.stdout
    assert "in process" in proc.stdout
    # the learning rate is a warmup + cosine schedule by spec, evaluated by the server, and says so
    assert "lr warmup_cosine_decay_schedule: 0 -> 0.01 over 3 warmup steps, cosine to 0.001 at step 60" in proc.stdout
    assert "adam lr=0.01 (warmup+cosine)" in proc.stdout

    png = (out / "loss_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5_000
    # the session's series: every accepted push carried its worker's loss
    rows = (out / "report" / "series.csv").read_text().splitlines()[1:]
    assert rows and all(row.split(",")[2] for row in rows)
    assert (out / "report" / "loss_vs_step.png").stat().st_size > 5_000

    summary = json.loads((out / "summary.json").read_text())
    remote, local = summary["runs"]
    steps = summary["config"]["steps"]
    # the session was created with the schedule: its optimizer as the server reports it
    assert summary["config"]["schedule"] == "warmup_cosine"
    assert remote["optimizer"] == {"name": "adam", "args": {"learning_rate": {
        "schedule": "warmup_cosine_decay_schedule", "init_value": 0.0, "peak_value": 0.01, "warmup_steps": 3,
        "decay_steps": 2 * steps, "end_value": 0.001}}}
    assert remote["updates"] + remote["dropped_stale"] == local["updates"] == 2 * steps
    assert remote["updates"] >= steps, "most pushes apply"

    initial = summary["initial"]["test_loss"]
    # Both runs learn; the asynchronous one trails a little at this size (its gradients are about
    # one version stale: an in-process Adam with a one-step delay reaches ~0.45 train loss here).
    assert remote["test_loss"] < 0.5 * initial and local["test_loss"] < 0.5 * initial
    assert remote["test_accuracy"] > 0.7, remote
    assert remote["test_accuracy"] > local["test_accuracy"] - 0.2, (remote, local)


@pytest.mark.parametrize("columns", [50, 80, 100])
def test_demo_table_fits_the_terminal_width(columns, monkeypatch, capsys):
    from optserve.demo.config import DemoConfig
    from optserve.demo.report import RunResult, print_table

    monkeypatch.setenv("COLUMNS", str(columns))  # what shutil.get_terminal_size reads first
    run = RunResult("optserve async, 2 worker processes", 300, 2, 12.5, 0.1234, 0.2345, 0.955, [])
    print_table(DemoConfig(), (2.3, 0.1), [run, dataclasses.replace(run, label="in process (Adam)")])
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.count("0.955") for line in lines) == 2, "both runs, accuracy whole"
    assert max(len(line) for line in lines) <= columns
    if columns >= 80:  # two runs' labels fit an 80-column terminal unwrapped
        assert any("optserve async, 2 worker processes" in line and "in process (Adam)" in line for line in lines)


def test_demo_table_width_falls_back_to_80_columns_without_a_terminal():
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    width = subprocess.run([sys.executable, "-c", "from optserve.demo.report import terminal_columns; print(terminal_columns())"],
                           capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
    assert width.stdout.strip() == "80", width.stderr


@pytest.mark.slow
def test_demo_diloco_and_sparseloco_compare_with_per_step_sync_at_a_fifth_of_the_payload_and_far_less(tmp_path):
    out = tmp_path / "demo_out"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        _optserve_command() + ["demo", "--quick", "--no-progress", "--diloco", "5", "--compression", "sparseloco",
                               "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "DiLoCo, H=5" in proc.stdout and "sync DP, every step" in proc.stdout
    assert "Payload bytes" in proc.stdout and "payload bytes / worker" in proc.stdout

    png = (out / "loss_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5_000

    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["diloco"] == 5 and summary["config"]["compression"] == "sparseloco"
    sparse, diloco, sync = summary["runs"]
    assert (sparse["label"], diloco["label"], sync["label"]) == ("SparseLoCo, H=5", "DiLoCo, H=5", "sync DP, every step")
    steps = summary["steps_per_worker"]
    assert diloco["steps_per_worker"] == sync["steps_per_worker"] == steps  # equal samples
    assert (diloco["exchanges_per_worker"], sync["exchanges_per_worker"]) == (steps // 5, steps)
    # every worker pushed the whole model's float32 (pseudo-)gradient per exchange: 1/H of the bytes
    for worker_bytes in (diloco["payload_bytes_per_worker"], sync["payload_bytes_per_worker"]):
        assert len(worker_bytes) == 2 and len(set(worker_bytes)) == 1
    assert diloco["payload_bytes_per_worker"][0] == pytest.approx(sync["payload_bytes_per_worker"][0] / 5, rel=0.01)
    assert f"{sync['payload_bytes_per_worker'][0]:,}" in proc.stdout

    # SparseLoCo's 2-bit top-k: the MLP's 64x64 tiles send 64 entries each (its vectors go whole)
    assert sparse["exchanges_per_worker"] == diloco["exchanges_per_worker"]
    assert 0 < sparse["payload_bytes_per_worker"][0] < diloco["payload_bytes_per_worker"][0] / 10
    assert summary["comparison"]["sparseloco_payload_bytes_ratio_to_diloco"] < 0.1
    assert "SparseLoCo / DiLoCo: final train loss" in proc.stdout

    initial = summary["initial"]["test_loss"]
    for run in (sparse, diloco, sync):  # all learn
        assert run["test_loss"] < 0.5 * initial and run["test_accuracy"] > 0.7, run


@pytest.mark.parametrize("optimizer", ["muon", "soap"])
def test_demo_trains_with_muon_and_soap(tmp_path, optimizer):
    out = tmp_path / "demo_out"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # --steps 60: under the demo's warmup + cosine schedule the rate averages about half of --lr, and
    # muon at lr 0.01 needs more than --quick's 2 x 30 updates for the target (2 x 60: ~0.42 of it)
    proc = subprocess.run(
        _optserve_command() + ["demo", "--quick", "--steps", "60", "--no-progress", "--optimizer", optimizer,
                               "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert f"in process ({optimizer})" in proc.stdout
    assert "lr warmup_cosine_decay_schedule" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    remote, local = summary["runs"]
    initial = summary["initial"]["test_loss"]
    assert remote["test_loss"] < 0.7 * initial and local["test_loss"] < 0.7 * initial, (remote, local, initial)
