"""``python -m bench.scale`` end to end at a tiny size: a real server process, real client
processes (NumPy views and torch), the in-process kernel, the tables written into a markdown file
between their markers (the hand-written text around them kept) and the PNG curves."""

from __future__ import annotations

import os

import pytest

from bench import scale
from bench._scale_report import BEGIN, END


def test_bench_scale_quick_writes_its_table_and_keeps_the_hand_written_text(tmp_path):
    out = tmp_path / "scaling.md"
    out.write_text(f"# Scaling\n\nhand-written before\n\n{BEGIN}\nold table\n{END}\n\nhand-written after\n")
    plots = tmp_path / "plots"
    text = scale.main(["--quick", "--params", "300K", "--optimizers", "adafactor", "--paths", "views,torch",
                       "--shards", "1", "--workers", "2", "--workers-params", "300K", "--tensors", "none", "--reuse-server",
                       "--out", str(out), "--plots", str(plots), "--log-dir", str(tmp_path / "logs")])

    written = out.read_text()
    assert "hand-written before" in written and "hand-written after" in written
    assert "old table" not in written and written.count(BEGIN) == 1 and written.count(END) == 1
    assert "Machine: " in written and "cores" in written
    for path in ("views", "torch"):
        rows = [line for line in written.splitlines() if line.startswith("| params |") and f"| {path} |" in line]
        assert len(rows) == 1, written
        assert "failed" not in rows[0] and "skipped" not in rows[0], rows[0]
    workers = [line for line in written.splitlines() if line.startswith("| 0.3 | adafactor |")]
    assert len(workers) == 2 and all("| 2 | async |" in line for line in workers), written
    assert "step ms" in text and "pushes/s" in text
    assert os.path.exists(plots / "step_vs_params.png") and os.path.exists(plots / "throughput_vs_workers.png")


def test_a_point_beyond_the_memory_budget_is_skipped_with_its_figure():
    args = scale.parse_arguments(["--params", "1B", "--optimizers", "adam", "--paths", "numpy", "--shards", "1",
                                  "--workers", "none", "--tensors", "none"])
    (point,) = scale.plan(args)
    assert point.params == 60 * 4096 * 4096
    need = scale.estimated_bytes(point, {}, kernel=False)
    assert need > 4 * point.params * 5  # parameters, Adam's two moments, the client's copies
    measured = scale.estimated_bytes(point, {("adam", "numpy"): 8.0}, kernel=False)
    assert measured == pytest.approx(1.15 * 8.0 * point.params + scale.FIXED_BYTES, rel=1e-6)


def test_model_shapes_follow_the_sizes_asked_for():
    assert scale.default_shapes(scale.parse_count("100M")) == [(f"layer{i}/w", (4096, 4096)) for i in range(6)]
    assert scale.default_shapes(scale.parse_count("10M")) == [(f"layer{i}/w", (1024, 1024)) for i in range(10)]
    shapes = scale.split_shapes(scale.parse_count("10M"), 10_000)
    assert len(shapes) == 10_000 and shapes[0][1] == (31, 31)
