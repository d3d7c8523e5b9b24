"""``optserve report SESSION --out DIR``: how staleness relates to loss, as plots and a CSV.

    optserve report SESSION [--address HOST:PORT] [--token T] [--tls CA.pem] [--out DIR]

Reads the session's series (every accepted push: version, staleness, the loss and scalars its
client attached; every refused push: when and why) and writes under ``DIR``:

* ``loss_vs_step.png``: loss against the session version, each push coloured by its staleness;
* ``staleness_histogram.png``: accepted pushes by staleness;
* ``pushes_over_time.png``: accepted and refused pushes per time bin;
* ``series.csv``: one row per accepted push (``version, staleness, loss, unix_s`` and a column per scalar).

Needs matplotlib (``optserve[demo]`` has it). Errors are one line, exit status 2.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import sys
from pathlib import Path
from typing import Optional, Sequence

from optserve.client import Client
from optserve.client._retry import RetryPolicy
from optserve.client.cli import OneLineArgumentParser
from optserve.client.errors import OptservError


def _parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="optserve report", description="Plots of a session's loss and staleness.")
    parser.add_argument("session", help="the session's name")
    parser.add_argument("--address", default="127.0.0.1:50051", help="the server's control address")
    parser.add_argument("--token", default=None, help="tenant token (servers started with --auth-tokens)")
    parser.add_argument("--tls", default=None, help="CA bundle (PEM) to verify a TLS server with")
    parser.add_argument("--out", default="optserve_report", help="output folder")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per call")
    return parser


def write_csv(series, path: Path) -> None:
    scalar_names = sorted({name for p in series.accepted for name in p.scalars})
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["version", "staleness", "loss", "unix_s", *scalar_names])
        for p in series.accepted:
            writer.writerow([p.version, p.staleness, "" if p.loss is None else repr(p.loss), repr(p.unix_s),
                             *[repr(p.scalars[n]) if n in p.scalars else "" for n in scalar_names]])


def write_plots(series, out: Path, name: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    with_loss = [p for p in series.accepted if p.loss is not None]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if with_loss:
        points = ax.scatter([p.version for p in with_loss], [p.loss for p in with_loss],
                            c=[p.staleness for p in with_loss], cmap="viridis", s=14)
        fig.colorbar(points, ax=ax, label="staleness (versions)")
    else:
        ax.text(0.5, 0.5, "no push carried a loss", ha="center", va="center", transform=ax.transAxes)
    ax.set(xlabel="session version", ylabel="loss", title=f"{name}: loss by step, coloured by staleness")
    written.append(_save(fig, out / "loss_vs_step.png"))

    fig, ax = plt.subplots(figsize=(8, 4.5))
    staleness = [p.staleness for p in series.accepted]
    if staleness:
        ax.hist(staleness, bins=range(0, max(staleness) + 2), align="left", rwidth=0.85)
    ax.set(xlabel="staleness (versions)", ylabel="accepted pushes", title=f"{name}: staleness of accepted pushes")
    written.append(_save(fig, out / "staleness_histogram.png"))

    fig, ax = plt.subplots(figsize=(8, 4.5))
    times = [p.unix_s for p in series.accepted] + [r.unix_s for r in series.rejected]
    if times:
        start, stop = min(times), max(times) + 1e-6
        bins = [start + (stop - start) * i / 30 for i in range(31)]
        ax.hist([[p.unix_s - start for p in series.accepted], [r.unix_s - start for r in series.rejected]],
                bins=[b - start for b in bins], label=["accepted", "refused"], stacked=True)
        ax.legend()
    ax.set(xlabel="seconds since the first push", ylabel="pushes", title=f"{name}: accepted vs refused pushes")
    written.append(_save(fig, out / "pushes_over_time.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def report_main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``optserve report``; returns the exit status."""
    args = _parser().parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:
        print("optserve report: needs matplotlib: pip install matplotlib (or 'optserve[demo]')", file=sys.stderr)
        return 2
    try:
        with Client(args.address, token=args.token, tls=args.tls or False, timeout=args.timeout,
                    retry=RetryPolicy(attempts=2), retain_freed_memory=False) as client:
            series = client.session_series(args.session)
    except (OptservError, ValueError) as exc:
        print(f"optserve report: {args.session}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(series, out / "series.csv")
    for path in write_plots(series, out, args.session) + [out / "series.csv"]:
        print(path)
    return 0
