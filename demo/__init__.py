"""``optserve demo``: the whole product on one machine, in a few minutes on 2 cores.

An application on top of optserve (its own package, ``optserve.demo``; it needs the ``demo``
extra: torch, scikit-learn, matplotlib, transformers, tqdm, rich). ``optserve demo`` finds it
through the ``optserve.commands`` entry point; the server never imports it.

1. starts an embedded server (local Ray, 2 shard actors) on a free loopback port;
2. creates an asynchronous session holding a small MLP's parameters (scikit-learn's bundled
   8x8 digits: nothing is downloaded);
3. launches 2 worker *processes*, each training that MLP with ``torch`` and
   :class:`optserve.client.torch.RemoteOptimizer` on its own minibatches, with a progress bar;
4. trains the same model (same initial weights, same number of updates, same batch size) in
   process with the same optimizer (``torch.optim.Adam`` for ``adam``, ``transformers.Adafactor``
   for ``adafactor_hf``, the server's own kernel run in process for ``muon`` and ``soap``);
5. prints a table of final loss / accuracy for both, writes ``loss_curve.png`` and
   ``summary.json`` under ``--out`` (default ``./demo_out``).

``optserve demo --diloco H`` instead compares DiLoCo (H inner AdamW steps per round, then one
pseudo-gradient exchange) with per-step synchronous data parallelism on the same worker
processes and the same minibatches (:mod:`optserve.demo.diloco`).

The model and data helpers (:func:`load_digits_split`, :func:`make_model`, :func:`evaluate`)
are also used by the compression test.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import multiprocessing
import os
import queue as queue_module
import shutil
import sys
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

# --- model and data ---------------------------------------------------------------------------

_NEEDS = ("torch", "sklearn", "matplotlib", "transformers", "tqdm", "rich", "jax", "optax", "ray")

HIDDEN = 64
NUM_CLASSES = 10


@dataclasses.dataclass(frozen=True)
class DigitsSplit:
    """scikit-learn's digits: ``x_*`` float32 (n, 64) in [0, 1], ``y_*`` int64 (n,) in [0, 10)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def load_digits_split(test_fraction: float = 0.2, seed: int = 0) -> DigitsSplit:
    """The bundled 1797 digits, shuffled with ``seed`` and split into train / test."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return DigitsSplit(x[train], y[train], x[test], y[test])


def make_model(seed: int = 0):
    """A 64 -> HIDDEN -> 10 ReLU MLP with deterministic initial weights (torch, float32)."""
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, NUM_CLASSES)
    )


def evaluate(model, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of ``model`` on ``x``, ``y``."""
    import torch

    with torch.no_grad():
        logits = model(torch.from_numpy(x))
        loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(y)).item()
        accuracy = (logits.argmax(dim=1).numpy() == y).mean().item()
    return float(loss), float(accuracy)


# --- optimizers: the server's spec and the in-process twin --------------------------------------


DEMO_OPTIMIZERS = ("adam", "adafactor_hf", "muon", "soap")


def optimizer_spec(name: str, lr: float) -> dict[str, Any]:
    """The server-side optimizer for ``name`` (see :func:`in_process_optimizer` for its twin)."""
    if name == "adam":
        return {"name": "adam", "args": {"learning_rate": lr}}
    if name == "adafactor_hf":
        return {"name": "adafactor_hf", "args": {"lr": lr, "relative_step": False, "scale_parameter": False}}
    if name == "muon":
        return {"name": "muon", "args": {"learning_rate": lr}}
    if name == "soap":
        return {"name": "soap", "args": {"learning_rate": lr, "precondition_frequency": 10}}
    raise ValueError(f"demo optimizer must be one of {', '.join(DEMO_OPTIMIZERS)}, got {name!r}")


def in_process_optimizer(name: str, lr: float, params):
    """The same optimizer as :func:`optimizer_spec`, as a torch optimizer in this process."""
    import torch

    if name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    if name == "adafactor_hf":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=lr, relative_step=False, scale_parameter=False)
    if name in ("muon", "soap"):  # no torch twin with the same semantics: the server's own kernel, here
        return KernelInProcess(params, optimizer_spec(name, lr))
    raise ValueError(f"demo optimizer must be one of {', '.join(DEMO_OPTIMIZERS)}, got {name!r}")


class KernelInProcess:
    """A registry kernel (``optserve.optim_kernels``) stepping torch parameters in this process:
    the in-process twin of optimizers without a torch implementation of the same semantics."""

    def __init__(self, params, spec: dict[str, Any]):
        import jax
        import optax

        from optserve.optim_kernels import build_optimizer

        self._params = list(params)
        self.name = spec["name"]
        tx = build_optimizer(spec["name"], spec["args"]).transformation
        self._values = {f"p{i}": jax.numpy.asarray(p.detach().numpy()) for i, p in enumerate(self._params)}
        self._state = tx.init(self._values)

        def step(values, state, grads):
            updates, state = tx.update(grads, state, values)
            return optax.apply_updates(values, updates), state

        self._step = jax.jit(step)

    def zero_grad(self) -> None:
        for p in self._params:
            p.grad = None

    def step(self) -> None:
        import torch

        grads = {f"p{i}": p.grad.detach().numpy() for i, p in enumerate(self._params)}
        self._values, self._state = self._step(self._values, self._state, grads)
        with torch.no_grad():
            for i, p in enumerate(self._params):
                p.copy_(torch.from_numpy(np.array(self._values[f"p{i}"])))


# --- configuration ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """``optserve demo`` flags (validated here).

    Attributes:
      steps: updates each worker pushes; the in-process run makes ``workers * steps``.
      workers: worker processes sharing the asynchronous session.
      shards: shard actors of the embedded server.
      batch_size: examples per gradient.
      optimizer / lr: see :func:`optimizer_spec`.
      max_staleness / staleness_policy: async: pushes more than ``max_staleness`` versions old
        are rejected (the worker drops that step and refreshes its parameters) or, with
        ``"scale"``, applied with the step scaled by 1 / (1 + staleness).
      wire_dtype: transport dtype of gradients and parameters (None: float32).
      overlap: workers compute the next gradient while their push is in flight
        (one-step-delayed parameters, see ``optserve.client.overlap``).
      shared_memory: workers move tensor bytes through shared memory where each shard proves it
        is on their host (``Client(shared_memory="auto")``); False (``--no-shared-memory``):
        gRPC bytes.
      out: directory for ``loss_curve.png`` and ``summary.json``.
      progress: draw a progress bar.
      seed: model initialisation and data order.
      diloco: H: compare DiLoCo with H inner steps per round against per-step synchronous data
        parallelism instead (:mod:`optserve.demo.diloco`); None: the asynchronous demo.
    """

    steps: int = 150
    workers: int = 2
    shards: int = 2
    batch_size: int = 32
    optimizer: str = "adam"
    lr: float = 1e-2
    max_staleness: int = 4
    staleness_policy: str = "reject"
    wire_dtype: Optional[str] = None
    overlap: bool = False
    shared_memory: bool = True
    out: Path = Path("demo_out")
    progress: bool = True
    seed: int = 0
    diloco: Optional[int] = None

    def __post_init__(self):
        for field in ("steps", "workers", "shards", "batch_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"--{field.replace('_', '-')} must be >= 1, got {getattr(self, field)}")
        if self.max_staleness < 0:
            raise ValueError(f"--max-staleness must be >= 0, got {self.max_staleness}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        optimizer_spec(self.optimizer, self.lr)  # validates the name
        if self.diloco is not None:
            if self.diloco < 1:
                raise ValueError(f"--diloco must be >= 1 (inner steps per round), got {self.diloco}")
            if self.optimizer != "adam":
                raise ValueError(f"--diloco compares AdamW workers with per-step adam: --optimizer must be adam, "
                                 f"got {self.optimizer!r}")
            if self.overlap:
                raise ValueError("--diloco runs without --overlap (both of its runs exchange synchronously)")


def parse_args(argv: Optional[Sequence[str]]) -> DemoConfig:
    """The :class:`DemoConfig` of ``argv``.

    Raises:
      ValueError: a flag's value is out of range (the message names the flag).
      SystemExit: argparse refused the command line (one line on stderr, status 2) or printed --help.
    """
    from optserve.client.cli import OneLineArgumentParser

    parser = OneLineArgumentParser(
        prog="optserve demo",
        description="Embedded server + 2 worker processes training an MLP on the digits data asynchronously.",
    )
    parser.add_argument("--steps", type=int, default=None,
                        help="updates per worker (default 150, with --diloco H 20 rounds of H; 30 with --quick)")
    parser.add_argument("--quick", action="store_true", help="reduced size for tests: 30 steps per worker")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--optimizer", choices=DEMO_OPTIMIZERS, default="adam")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--max-staleness", type=int, default=4, help="async staleness bound (versions)")
    parser.add_argument("--staleness-policy", choices=("reject", "scale"), default="reject")
    parser.add_argument("--wire-dtype", choices=("float32", "bfloat16", "float16", "int8"), default=None,
                        help="gradients (and, except int8, parameters) on the wire; int8: blockwise with error feedback")
    parser.add_argument("--overlap", action="store_true", help="workers overlap each push with the next gradient")
    parser.add_argument("--no-shared-memory", action="store_true",
                        help="tensor bytes over gRPC (default: through shared memory, the workers share the host)")
    parser.add_argument("--out", type=Path, default=Path("demo_out"), help="output directory (default ./demo_out)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--diloco", type=int, default=None, metavar="H",
                        help="compare DiLoCo (H inner AdamW steps per round, --lr) with per-step sync data parallel "
                             "adam at equal samples, instead of the async demo")
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (30 if args.quick else default_steps(args.diloco))
    return DemoConfig(
        steps=steps,
        workers=args.workers,
        shards=args.shards,
        batch_size=args.batch_size,
        optimizer=args.optimizer,
        lr=args.lr,
        max_staleness=args.max_staleness,
        staleness_policy=args.staleness_policy,
        wire_dtype=None if args.wire_dtype in (None, "float32") else args.wire_dtype,
        overlap=args.overlap,
        shared_memory=not args.no_shared_memory,
        out=args.out,
        progress=not args.no_progress,
        seed=args.seed,
        diloco=args.diloco,
    )


def default_steps(diloco: Optional[int]) -> int:
    """Steps per worker without ``--steps``: 150, or with ``--diloco H`` 20 outer rounds of H.

    DiLoCo's outer Nesterov momentum (0.9) needs about ten rounds to build up; over fewer rounds
    its shared parameters lag behind per-step sync (the comparison would measure the warm-up).
    """
    return 150 if diloco is None else DILOCO_DEFAULT_ROUNDS * diloco


DILOCO_DEFAULT_ROUNDS = 20  # outer rounds of ``optserve demo --diloco H`` without --steps


# --- the worker process -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WorkerTask:
    """What one worker process does: ``steps`` updates of ``session`` at ``address``."""

    rank: int
    address: str
    session: str
    config: DemoConfig


def worker_main(task: WorkerTask, messages, go) -> None:
    """Entry point of a worker process: attaches, reports ``("ready", rank)``, waits for ``go``
    (a ``multiprocessing.Event``), trains and reports ``("step", rank, step, loss, version)``.

    Ends with ``("done", rank, stale_pushes)`` or ``("error", rank, traceback text)``.
    """
    try:
        import torch

        from optserve.client.torch import RemoteOptimizer

        torch.set_num_threads(1)
        cfg = task.config
        data = load_digits_split(seed=cfg.seed)
        model = make_model(cfg.seed)
        optimizer = RemoteOptimizer(
            model.named_parameters(),
            task.address,
            optimizer_spec(cfg.optimizer, cfg.lr),
            session=task.session,
            mode="async",
            max_staleness=cfg.max_staleness,
            staleness_policy=cfg.staleness_policy,
            wire_dtype=cfg.wire_dtype,
            overlap=cfg.overlap,
            shared_memory="auto" if cfg.shared_memory else False,
        )
        messages.put(("ready", task.rank, sorted(set(optimizer.session.data_paths().values()))))
        go.wait()
        rng = np.random.default_rng(cfg.seed + 1000 * (task.rank + 1))
        x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
        for step in range(cfg.steps):
            batch = torch.from_numpy(rng.integers(0, len(x), cfg.batch_size))
            loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step(loss=loss)  # the loss travels with the push: the session's series
            messages.put(("step", task.rank, step, float(loss.item()), int(optimizer.version)))
        optimizer.synchronize()
        optimizer.close()
        messages.put(("done", task.rank, optimizer.stale_pushes))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the demo
        messages.put(("error", task.rank, traceback.format_exc()))


# --- the parts of a run -------------------------------------------------------------------------


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


def run_remote(cfg: DemoConfig, address: str, data: DigitsSplit) -> RunResult:
    """Creates the async session, runs the worker processes, evaluates the session's model."""
    from optserve.client.torch import RemoteOptimizer

    session_name = f"demo-{uuid.uuid4().hex[:8]}"
    model = make_model(cfg.seed)
    owner = RemoteOptimizer(  # creates the session from the seeded weights; workers attach
        model.named_parameters(),
        address,
        optimizer_spec(cfg.optimizer, cfg.lr),
        session=session_name,
        mode="async",
        max_staleness=cfg.max_staleness,
        staleness_policy=cfg.staleness_policy,
        wire_dtype=cfg.wire_dtype,
        shared_memory="auto" if cfg.shared_memory else False,
    )
    procs, (messages,), (go,) = start_workers(worker_main, [WorkerTask(r, address, session_name, cfg)
                                                            for r in range(cfg.workers)], phases=1)
    finished = False
    try:
        seen = drive_workers(procs, messages, go, cfg.steps, cfg.progress, f"training ({cfg.workers} workers)",
                             on_ready=lambda paths: print(_data_path_line(paths, cfg), flush=True))
        finished = True
    finally:
        stop_workers(procs, finished)
    dropped = sum(stale for stale, in seen.done.values())
    owner.pull()  # the session's final parameters into `model`
    _write_report(address, session_name, cfg.out)
    owner.session.close()
    owner.close()
    train_loss, _ = evaluate(model, data.x_train, data.y_train)
    test_loss, test_accuracy = evaluate(model, data.x_test, data.y_test)
    label = f"optserve async, {cfg.workers} worker process{'es' if cfg.workers > 1 else ''}"
    curve = [(index, loss) for index, (_, _, loss) in enumerate(seen.losses)]
    return RunResult(label, sum(seen.steps) - dropped, dropped, seen.seconds, train_loss, test_loss, test_accuracy,
                     curve, data_path="+".join(sorted(seen.paths)))


# --- worker processes, driven from the parent ----------------------------------------------------


def start_workers(target, tasks: Sequence[Any], phases: int) -> tuple[list, list, list]:
    """Spawns one process per task running ``target(task, queues, gos)`` (with ``phases == 1``:
    ``target(task, queue, go)``); returns ``(processes, queues, gos)``, one queue and one
    ``multiprocessing.Event`` per phase (a run of the workers that :func:`drive_workers` follows)."""
    ctx = multiprocessing.get_context("spawn")
    queues, gos = [ctx.Queue() for _ in range(phases)], [ctx.Event() for _ in range(phases)]
    args = (queues[0], gos[0]) if phases == 1 else (queues, gos)
    procs = [ctx.Process(target=target, args=(task, *args), daemon=True) for task in tasks]
    for p in procs:
        p.start()
    return procs, queues, gos


@dataclasses.dataclass
class WorkersSeen:
    """What the parent saw of one phase of the worker processes."""

    seconds: float  # from ``go`` (every worker ready) to the last ``done``
    steps: list[int]  # steps each worker reported
    losses: list[tuple[int, int, float]]  # (rank, step, minibatch loss) in arrival order
    done: dict[int, tuple]  # rank -> the rest of its ``("done", rank, ...)`` message
    paths: set[str]  # data paths the workers reported when ready


def drive_workers(procs: Sequence, messages, go, steps: int, progress: bool, description: str,
                  on_ready=lambda paths: None) -> WorkersSeen:
    """Follows one phase of the worker processes through ``messages``: waits for every
    ``("ready", rank, paths)``, calls ``on_ready(paths)``, sets ``go`` (the clock starts), counts
    ``("step", rank, step, loss, version)`` on a progress bar of ``len(procs) * steps`` until every
    worker sent ``("done", rank, ...)``.

    Raises:
      RuntimeError: a worker sent ``("error", rank, traceback)`` or exited without finishing.
    """
    workers = len(procs)
    seen = WorkersSeen(0.0, [0] * workers, [], {}, set())
    ready: set[int] = set()
    bar = _NoBar()
    start = time.perf_counter()
    try:
        while len(seen.done) < workers:
            try:
                kind, rank, *rest = messages.get(timeout=5.0)
            except queue_module.Empty:
                dead = [p for i, p in enumerate(procs) if i not in seen.done and not p.is_alive()]
                if dead:
                    raise RuntimeError(f"demo worker(s) exited without finishing (exit codes {[p.exitcode for p in dead]})")
                continue
            if kind == "ready":
                ready.add(rank)
                seen.paths.update(rest[0] or ())
                if len(ready) == workers:  # every worker has imported torch and attached: start the clock
                    on_ready(seen.paths)
                    bar = _progress_bar(workers * steps, progress, description)
                    start = time.perf_counter()
                    go.set()
            elif kind == "step":
                step, loss, version = rest
                seen.steps[rank] = step + 1
                seen.losses.append((rank, step, loss))
                bar.update(1)
                bar.set_postfix_str(f"version {version}, loss {loss:.3f}")
            elif kind == "done":
                seen.done[rank] = tuple(rest)
            else:
                raise RuntimeError(f"demo worker {rank} failed:\n{rest[0]}")
        seen.seconds = time.perf_counter() - start
    finally:
        bar.close()
    return seen


def stop_workers(procs: Sequence, finished: bool) -> None:
    """Joins the worker processes (up to 30 s each when they ``finished``), terminating any left."""
    for p in procs:
        p.join(timeout=30 if finished else 0)
        if p.is_alive():
            p.terminate()


def _data_path_line(paths: set[str], cfg: DemoConfig) -> str:
    """What the demo says about its data plane once every worker attached."""
    if paths == {"shared_memory"}:
        return ("data plane: shared memory (each shard proved it shares this host with the workers); gRPC carries "
                "every step's message (--no-shared-memory: tensor bytes over gRPC)")
    if not cfg.shared_memory:
        return "data plane: gRPC (--no-shared-memory)"
    return f"data plane: {' + '.join(sorted(paths)) or 'grpc'} (shared memory could not be proven for every shard)"


def run_in_process(cfg: DemoConfig, data: DigitsSplit) -> RunResult:
    """The same model, initial weights, batch size and number of updates, trained in process."""
    import torch

    model = make_model(cfg.seed)
    optimizer = in_process_optimizer(cfg.optimizer, cfg.lr, model.parameters())
    rng = np.random.default_rng(cfg.seed + 999_999)
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    curve = []
    updates = cfg.workers * cfg.steps
    start = time.perf_counter()
    for step in range(updates):
        batch = torch.from_numpy(rng.integers(0, len(x), cfg.batch_size))
        loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        curve.append((step, float(loss.item())))
    seconds = time.perf_counter() - start
    train_loss, _ = evaluate(model, data.x_train, data.y_train)
    test_loss, test_accuracy = evaluate(model, data.x_test, data.y_test)
    label = optimizer.name if isinstance(optimizer, KernelInProcess) else type(optimizer).__name__
    return RunResult(f"in process ({label})", updates, 0, seconds, train_loss, test_loss, test_accuracy, curve)


# --- reporting ----------------------------------------------------------------------------------


class _NoBar:
    def update(self, n: int) -> None: ...

    def set_postfix_str(self, s: str) -> None: ...

    def close(self) -> None: ...


def _progress_bar(total: int, enabled: bool, description: str):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=description, unit="step", dynamic_ncols=True)


# The asynchronous demo's rows: (measure, its cell for a run).
TABLE_ROWS = (("updates", lambda r: str(r.updates)), ("stale dropped", lambda r: str(r.dropped_stale)),
              ("wall s", lambda r: f"{r.seconds:.1f}"), ("final train loss", lambda r: f"{r.train_loss:.4f}"),
              ("test loss", lambda r: f"{r.test_loss:.4f}"), ("test accuracy", lambda r: f"{r.test_accuracy:.3f}"))


def print_table(cfg: DemoConfig, initial: tuple[float, float], results: Sequence[RunResult],
                rows: Sequence[tuple[str, Any]] = TABLE_ROWS, title: Optional[str] = None) -> None:
    """Prints the runs side by side, one column per run and one row per measure (``rows``:
    (name, cell function of a run)), as wide as the terminal (:func:`terminal_columns`): two runs
    fit 80 columns; a narrower terminal wraps the labels at words and folds numbers onto a second
    line (never an ellipsis). ``title``: the default names the optimizer, lr and batch size."""
    from rich.console import Console
    from rich.table import Table

    if title is None:
        title = f"digits MLP, {cfg.optimizer} lr={cfg.lr}, batch {cfg.batch_size}"
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


# --- entry point --------------------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the demo; returns the process exit status (0 on success, 2 for a bad flag or a missing
    dependency, each reported in one line on stderr)."""
    try:
        cfg = parse_args(argv)
    except ValueError as exc:
        print(f"optserve demo: {exc}", file=sys.stderr)
        return 2
    missing = _missing(_NEEDS)
    if missing:
        print(f"optserve demo: the demo is not installed (pip install -e '.[demo]'): missing {', '.join(missing)}",
              file=sys.stderr)
        return 2
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cfg.out.mkdir(parents=True, exist_ok=True)
    import torch

    torch.set_num_threads(1)
    data = load_digits_split(seed=cfg.seed)
    initial = evaluate(make_model(cfg.seed), data.x_test, data.y_test)
    if cfg.diloco is not None:
        from optserve.demo.diloco import run_diloco_demo

        return run_diloco_demo(cfg, data, initial)

    with embedded_server(cfg) as address:
        print(f"server listening on {address}; {cfg.workers} workers x {cfg.steps} steps", flush=True)
        remote = run_remote(cfg, address, data)
    baseline = run_in_process(cfg, data)
    results = [remote, baseline]
    print_table(cfg, initial, results)
    plot = cfg.out / "loss_curve.png"
    write_plot(plot, results)
    write_summary(cfg, initial, results)
    print(f"wrote {plot} and {cfg.out / 'summary.json'}", flush=True)
    return 0


@contextlib.contextmanager
def embedded_server(cfg: DemoConfig):
    """An optserve server on a free loopback port with ``cfg.shards`` shards on a local Ray (shut
    down afterwards unless Ray was running already); yields its address."""
    print(f"optserve demo: starting an embedded server (local Ray, {cfg.shards} shards) ...", flush=True)
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig

    ray_was_running = _ray_is_initialized()
    # The demo's model is small (tens of KB): min_shard_bytes=0 spreads it over every shard anyway,
    # so the demo runs the multi-shard path (fan-out, cross-shard votes) a large model takes.
    server = start_server(ServerConfig(host="127.0.0.1", port=0, shards=cfg.shards, ray_address="local",
                                       min_shard_bytes=0))
    try:
        yield server.address
    finally:
        server.stop()
        if not ray_was_running:
            _shutdown_ray()


def write_summary(cfg: DemoConfig, initial: tuple[float, float], results: Sequence[RunResult],
                  **extra: Any) -> None:
    """``summary.json``: the flags, the initial model's test loss / accuracy, each run without its
    curve, and ``extra`` keys (the asynchronous demo's config has no ``diloco`` key)."""
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()}
    if cfg.diloco is None:
        del config["diloco"]
    summary = {
        "config": config,
        "initial": {"test_loss": initial[0], "test_accuracy": initial[1]},
        "runs": [{k: v for k, v in dataclasses.asdict(r).items() if k != "curve"} for r in results],
        **extra,
    }
    (cfg.out / "summary.json").write_text(json.dumps(summary, indent=2))


def _missing(modules: Sequence[str]) -> list[str]:
    """The top-level ``modules`` that cannot be imported here (not found, or their lookup fails)."""
    missing = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def _write_report(address: str, session: str, out: Path) -> None:
    """What ``optserve report`` writes: loss vs step coloured by staleness, staleness histogram,
    accepted vs refused pushes over time, and the series as CSV."""
    from optserve.client import Client
    from optserve.client.report import write_csv, write_plots

    with Client(address) as client:
        series = client.session_series(session)
    report = out / "report"
    report.mkdir(parents=True, exist_ok=True)
    write_csv(series, report / "series.csv")
    write_plots(series, report, "demo (async)")
    staleness = [p.staleness for p in series.accepted]
    print(f"session series: {len(series.accepted)} pushes accepted (staleness max {max(staleness, default=0)}), "
          f"{len(series.rejected)} refused; plots in {report}", flush=True)


def _ray_is_initialized() -> bool:
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()


def _shutdown_ray() -> None:
    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    except ImportError:
        pass


if __name__ == "__main__":
    sys.exit(main())
