"""What the demo shows and writes: a run's :class:`RunResult`, the table of runs side by side,
``loss_curve.png``, ``summary.json``, and the session's own report (``optserve report``)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from optserve.client import Client
from optserve.client.report import write_csv, write_plots
from optserve.demo.config import DemoConfig


@dataclasses.dataclass
class RunResult:
    """One training run: per-update minibatch losses and the final evaluation."""

    label: str
    updates: int  # updates applied to the model
    dropped_stale: int  # pushes the server refused as too stale (async reject policy)
    seconds: float
    train_loss: float
    test_loss: float
    test_accuracy: float
    curve: list[tuple[int, float]]  # (update index, minibatch loss)
    data_path: str = ""  # how the workers' tensor bytes reached the shards (remote runs)
    optimizer: Optional[dict[str, Any]] = None  # the session's optimizer as the server reports it (remote runs)


# The asynchronous demo's rows: (measure, its cell for a run).
TABLE_ROWS = (("updates", lambda r: str(r.updates)), ("stale dropped", lambda r: str(r.dropped_stale)),
              ("wall s", lambda r: f"{r.seconds:.1f}"), ("final train loss", lambda r: f"{r.train_loss:.4f}"),
              ("test loss", lambda r: f"{r.test_loss:.4f}"), ("test accuracy", lambda r: f"{r.test_accuracy:.3f}"))


def print_table(cfg: DemoConfig, initial: tuple[float, float], results: Sequence[RunResult],
                rows: Sequence[tuple[str, Any]] = TABLE_ROWS, title: Optional[str] = None) -> None:
    """Prints the runs side by side, one column per run and one row per measure (``rows``:
    (name, cell function of a run)), as wide as the terminal (:func:`terminal_columns`): two runs
    fit 80 columns; a narrower terminal wraps the labels at words and folds numbers onto a second
    line (never an ellipsis). ``title``: the default names the optimizer, lr (and its schedule)
    and batch size."""
    from rich.console import Console
    from rich.table import Table

    if title is None:
        schedule = "" if cfg.schedule == "constant" else f" ({cfg.schedule.replace('_', '+')})"
        title = f"digits MLP, {cfg.optimizer} lr={cfg.lr}{schedule}, batch {cfg.batch_size}"
    table = Table(title=f"{title} (initial test loss {initial[0]:.3f})")
    table.add_column("", justify="left", overflow="fold")
    for r in results:
        table.add_column(r.label, justify="right", overflow="fold")
    for name, cell in rows:
        table.add_row(name, *(cell(r) for r in results))
    Console(width=terminal_columns()).print(table)


def terminal_columns() -> int:
    """The width the demo's table may use: the terminal's (or ``$COLUMNS``), 80 when stdout is no
    terminal and ``$COLUMNS`` is unset."""
    return shutil.get_terminal_size(fallback=(80, 24)).columns


def write_plot(path: Path, results: Sequence[RunResult],
               title: str = "optserve demo: digits MLP, same optimizer, same number of updates",
               xlabel: str = "update") -> None:
    """Minibatch loss (moving average over 10 points) against each run's ``curve`` x values
    (the update index by default), one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        steps = np.array([s for s, _ in r.curve])
        losses = np.array([l for _, l in r.curve])
        window = min(10, len(losses))
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        ax.plot(steps[window - 1 :], smooth, label=r.label)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("minibatch cross-entropy (moving average)")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_summary(cfg: DemoConfig, initial: tuple[float, float], results: Sequence[RunResult],
                  **extra: Any) -> None:
    """``summary.json``: the flags, the initial model's test loss / accuracy, each run without its
    curve, and ``extra`` keys (the asynchronous demo's config has no ``diloco`` key, nor
    ``compression`` without one)."""
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()}
    if cfg.diloco is None:
        del config["diloco"]
    if cfg.compression is None:
        del config["compression"]
    summary = {
        "config": config,
        "initial": {"test_loss": initial[0], "test_accuracy": initial[1]},
        "runs": [{k: v for k, v in dataclasses.asdict(r).items() if k != "curve"} for r in results],
        **extra,
    }
    (cfg.out / "summary.json").write_text(json.dumps(summary, indent=2))


def write_session_report(address: str, session: str, out: Path) -> None:
    """What ``optserve report`` writes, under ``out/report``: loss vs step coloured by staleness,
    staleness histogram, accepted vs refused pushes over time, and the series as CSV."""
    with Client(address) as client:
        series = client.session_series(session)
    report = out / "report"
    report.mkdir(parents=True, exist_ok=True)
    write_csv(series, report / "series.csv")
    write_plots(series, report, "demo (async)")
    staleness = [p.staleness for p in series.accepted]
    print(f"session series: {len(series.accepted)} pushes accepted (staleness max {max(staleness, default=0)}), "
          f"{len(series.rejected)} refused; plots in {report}", flush=True)
