"""``optserve demo --diloco H``: DiLoCo against per-step synchronous data parallelism.

The same ``--workers`` worker processes train the demo's MLP twice, one run after the other, on
the same embedded server and the same minibatches (each worker's own seeded stream, ``--steps``
of ``--batch-size`` examples, rounded up to whole rounds of H):

1. DiLoCo (:class:`optserve.client.torch.DiLoCo`): each worker takes H steps with its own
   ``torch.optim.AdamW`` (lr ``--lr``, torch's default weight decay 0.01), then pushes its
   pseudo-gradient to a sync session of ``--workers`` workers whose optimizer (Nesterov SGD,
   lr 0.7, momentum 0.9) makes the outer step; every worker continues from the shared result.
2. Per-step synchronous data parallelism (:class:`optserve.client.torch.RemoteOptimizer`, sync
   mode): every worker pushes every step's gradient; the session averages them and runs adam
   (lr ``--lr``).

With ``--compression sparseloco`` a first run is DiLoCo with SparseLoCo's compression (its
defaults: the top 64 of each 64x64 tile of an error-fed buffer, 2-bit values, each entry averaged
over the workers that sent it) and SparseLoCo's outer step, SGD at learning rate 1.

Each worker counts the payload bytes it pushed (:func:`wire_payload_bytes`: values at their wire
width, int8 blocks with their float32 scales, DiLoCo's as its exchanges record them; no message
framing). The parent evaluates the
sessions' final parameters, prints a table, and writes ``loss_curve.png`` and ``summary.json``.
"""

from __future__ import annotations

import collections
import dataclasses
import traceback
import uuid
from typing import Iterable, Optional, Sequence

import numpy as np

from optserve.demo.config import DemoConfig
from optserve.demo.digits import DigitsSplit, evaluate, make_model
from optserve.demo.embedded_server import embedded_server
from optserve.demo.optimizers import optimizer_spec
from optserve.demo.report import RunResult, print_table, write_plot, write_summary
from optserve.demo.worker_processes import data_path_line, drive_workers, start_workers, stop_workers
from optserve.protos import contract

SPARSELOCO_OUTER = {"name": "sgd", "args": {"learning_rate": 1.0}}


def runs(cfg: DemoConfig) -> tuple[str, ...]:
    """The phases of the worker processes, in order."""
    return ("sparseloco", "diloco", "sync") if cfg.compression else ("diloco", "sync")

# bytes per value on the wire for the demo's --wire-dtype names (None: float32)
_WIRE_WIDTH = {None: 4, "float32": 4, "bfloat16": 2, "float16": 2}


def wire_payload_bytes(sizes: Iterable[int], wire_dtype: Optional[str]) -> int:
    """Payload bytes of one push of float32 tensors with ``sizes`` elements each, sent as
    ``wire_dtype``: 4 / 2 bytes per value, or for ``"int8"`` 1 byte per value plus one float32
    scale per block of ``INT8_BLOCK`` values of each tensor (no message framing)."""
    sizes = [int(n) for n in sizes]
    if wire_dtype == contract.INT8_NAME:
        return sum(n + 4 * -(-n // contract.INT8_BLOCK) for n in sizes)
    return _WIRE_WIDTH[wire_dtype] * sum(sizes)


def comparison_steps(cfg: DemoConfig) -> int:
    """Steps per worker in both runs: ``--steps`` rounded up to whole rounds of H (``--diloco``)."""
    return -(-cfg.steps // cfg.diloco) * cfg.diloco


# --- the worker process -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ComparisonTask:
    """One worker process: ``steps`` steps in each of ``sessions`` (one per run of :func:`runs`)
    on ``data`` (sent along: the worker need not import scikit-learn)."""

    rank: int
    address: str
    sessions: tuple[str, ...]
    steps: int
    config: DemoConfig
    data: DigitsSplit


class _DiLoCoWorker:
    """A worker's DiLoCo: AdamW inner steps, a pseudo-gradient push every H-th ``step()``."""

    run = "diloco"

    def __init__(self, model, task: ComparisonTask, worker_id: str):
        import torch

        from optserve.client.torch import DiLoCo

        cfg = task.config
        self.params = list(model.parameters())
        self.inner = torch.optim.AdamW(self.params, lr=cfg.lr)
        sparse = self.run == "sparseloco"
        self.diloco = DiLoCo(model, self.inner, task.address, session=task.sessions[runs(cfg).index(self.run)],
                             sync_every=cfg.diloco, num_workers=cfg.workers, worker_id=worker_id,
                             wire_dtype=cfg.wire_dtype, outer=SPARSELOCO_OUTER if sparse else None,
                             compression={"name": "sparseloco"} if sparse else None,
                             shared_memory="auto" if cfg.shared_memory else False)
        self.session = self.diloco.sessions[0]
        self.exchanges = 0
        self.payload_bytes = 0

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def step(self) -> None:
        self.diloco.step()
        self.exchanges = sum(self.diloco.rounds)
        self.payload_bytes = sum(exchange.bytes_up for exchange in self.diloco.exchanges)

    def close(self) -> None:
        self.diloco.close()


class _SparseLoCoWorker(_DiLoCoWorker):
    """DiLoCo with SparseLoCo's compression and outer step."""

    run = "sparseloco"


class _PerStepWorker:
    """A worker's per-step synchronous data parallelism: every ``step()`` pushes the gradients."""

    def __init__(self, model, task: ComparisonTask, worker_id: str):
        from optserve.client.torch import RemoteOptimizer

        cfg = task.config
        self.params = list(model.parameters())
        self.optimizer = RemoteOptimizer(model.named_parameters(), task.address, optimizer_spec("adam", cfg.lr),
                                         session=task.sessions[-1], mode="sync", num_workers=cfg.workers,
                                         worker_id=worker_id, wire_dtype=cfg.wire_dtype,
                                         shared_memory="auto" if cfg.shared_memory else False)
        self.session = self.optimizer.session
        self.wire_dtype = cfg.wire_dtype
        self.exchanges = 0
        self.payload_bytes = 0

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> None:
        pushed = [p.grad.numel() for p in self.params if p.grad is not None]
        self.optimizer.step()
        self.exchanges += 1
        self.payload_bytes += wire_payload_bytes(pushed, self.wire_dtype)

    def close(self) -> None:
        self.optimizer.close()


_WORKERS = {"sparseloco": _SparseLoCoWorker, "diloco": _DiLoCoWorker, "sync": _PerStepWorker}


def comparison_worker_main(task: ComparisonTask, queues: Sequence, gos: Sequence) -> None:
    """Entry point of a worker process: for each run of :func:`runs` (phase ``i``: ``queues[i]``,
    ``gos[i]``) it attaches, reports ``("ready", rank, data paths)``, waits for ``gos[i]``, trains
    ``task.steps`` steps reporting ``("step", rank, step, loss, version)``, and ends the run with
    ``("done", rank, payload bytes pushed, exchanges)``; a failure is ``("error", rank, traceback)``
    on the queue of the run it happened in."""
    phase = 0
    try:
        import torch

        torch.set_num_threads(1)
        cfg = task.config
        x, y = torch.from_numpy(task.data.x_train), torch.from_numpy(task.data.y_train)
        for phase, run in enumerate(runs(cfg)):
            messages = queues[phase]
            model = make_model(cfg.seed)
            worker = _WORKERS[run](model, task, f"worker-{task.rank}")
            messages.put(("ready", task.rank, sorted(set(worker.session.data_paths().values()))))
            gos[phase].wait()
            rng = np.random.default_rng(cfg.seed + 1000 * (task.rank + 1))  # the same minibatches in both runs
            for step in range(task.steps):
                batch = torch.from_numpy(rng.integers(0, len(x), cfg.batch_size))
                loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
                worker.zero_grad()
                loss.backward()
                worker.step()
                messages.put(("step", task.rank, step, float(loss.item()), int(worker.session.version)))
            worker.close()
            messages.put(("done", task.rank, worker.payload_bytes, worker.exchanges))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the demo
        queues[phase].put(("error", task.rank, traceback.format_exc()))


# --- the parent ---------------------------------------------------------------------------------


@dataclasses.dataclass
class ComparisonResult(RunResult):
    """A :class:`RunResult` with what each worker pushed; ``curve``: (step per worker, mean of the
    workers' minibatch losses at that step)."""

    steps_per_worker: int = 0
    exchanges_per_worker: int = 0
    payload_bytes_per_worker: list[int] = dataclasses.field(default_factory=list)  # by rank


def run_comparison(cfg: DemoConfig, address: str, data: DigitsSplit) -> list[ComparisonResult]:
    """Runs the worker processes through every run; returns their results in the order of :func:`runs`."""
    steps = comparison_steps(cfg)
    names = tuple(f"demo-{run}-{uuid.uuid4().hex[:8]}" for run in runs(cfg))
    tasks = [ComparisonTask(rank, address, names, steps, cfg, data) for rank in range(cfg.workers)]
    labels = {"sparseloco": f"SparseLoCo, H={cfg.diloco}", "diloco": f"DiLoCo, H={cfg.diloco}",
              "sync": "sync DP, every step"}
    procs, queues, gos = start_workers(comparison_worker_main, tasks, phases=len(runs(cfg)))
    results, owners, finished = [], [], False
    try:
        # While the workers import torch, this process creates both sessions from the seeded
        # weights (the workers attach) and keeps their handles to pull the final parameters.
        for run in runs(cfg):
            model = make_model(cfg.seed)
            owners.append((model, _WORKERS[run](model, tasks[0], "owner")))  # never steps
        for phase, run in enumerate(runs(cfg)):
            seen = drive_workers(procs, queues[phase], gos[phase], steps, cfg.progress, labels[run],
                                 on_ready=(lambda paths: print(data_path_line(paths, cfg), flush=True))
                                 if phase == 0 else (lambda paths: None))
            model, owner = owners[phase]
            _load_final(model, owner.session)
            results.append(_result(labels[run], seen, model, data, steps))
        finished = True
    finally:
        stop_workers(procs, finished)
        for _, owner in owners:
            owner.session.close()  # for every client
            owner.close()
    return results


def _load_final(model, session) -> None:
    """Writes ``session``'s parameters (float32) into ``model``."""
    import torch

    values = session.pull(wire_dtype=None)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.from_numpy(np.asarray(values[name], dtype=np.float32)))


def _result(label: str, seen, model, data: DigitsSplit, steps: int) -> ComparisonResult:
    by_step: dict[int, list[float]] = collections.defaultdict(list)
    for _, step, loss in seen.losses:
        by_step[step].append(loss)
    curve = [(step + 1, float(np.mean(by_step[step]))) for step in sorted(by_step)]
    payload = [seen.done[rank][0] for rank in sorted(seen.done)]
    exchanges = max(done[1] for done in seen.done.values())
    train_loss, _ = evaluate(model, data.x_train, data.y_train)
    test_loss, test_accuracy = evaluate(model, data.x_test, data.y_test)
    return ComparisonResult(label, exchanges, 0, seen.seconds, train_loss, test_loss, test_accuracy, curve,
                            data_path="+".join(sorted(seen.paths)), steps_per_worker=steps,
                            exchanges_per_worker=exchanges, payload_bytes_per_worker=payload)


def _bytes_cell(r: ComparisonResult) -> str:
    low, high = min(r.payload_bytes_per_worker), max(r.payload_bytes_per_worker)
    return f"{low:,}" if low == high else f"{low:,}-{high:,}"


COMPARISON_ROWS = (
    ("steps / worker", lambda r: str(r.steps_per_worker)),
    ("exchanges / worker", lambda r: str(r.exchanges_per_worker)),
    ("payload bytes / worker", _bytes_cell),
    ("wall s", lambda r: f"{r.seconds:.1f}"),
    ("final train loss", lambda r: f"{r.train_loss:.4f}"),
    ("test loss", lambda r: f"{r.test_loss:.4f}"),
    ("test accuracy", lambda r: f"{r.test_accuracy:.3f}"),
)


def run_diloco_demo(cfg: DemoConfig, data: DigitsSplit, initial: tuple[float, float]) -> int:
    """``optserve demo --diloco H`` after the flags and data are ready (see the module docstring)."""
    steps = comparison_steps(cfg)
    rounded = f" (--steps {cfg.steps} rounded up to whole rounds of {cfg.diloco})" if steps != cfg.steps else ""
    with embedded_server(cfg) as address:
        print(f"server listening on {address}; DiLoCo H={cfg.diloco} vs per-step sync data parallel: "
              f"{cfg.workers} workers x {steps} steps{rounded}, batch {cfg.batch_size}, the same minibatches "
              f"in both runs", flush=True)
        results = run_comparison(cfg, address, data)
    wire = cfg.wire_dtype or "float32"
    sparse_title = (" SparseLoCo: the same inner steps, the top 64 of each 64x64 tile of an error-fed buffer in 2 "
                    "bits, outer SGD lr 1." if cfg.compression else "")
    print_table(cfg, initial, results, rows=COMPARISON_ROWS,
                title=f"digits MLP, {cfg.workers} workers x {steps} steps x batch {cfg.batch_size}. DiLoCo: inner "
                      f"AdamW lr={cfg.lr}, outer Nesterov SGD lr 0.7 momentum 0.9; sync DP: adam lr={cfg.lr}."
                      f"{sparse_title} Payload bytes: the {wire} (pseudo-)gradients a worker pushed, no framing")
    diloco, sync = results[-2:]
    comparison = {"final_train_loss_ratio": diloco.train_loss / sync.train_loss,
                  "payload_bytes_ratio": sum(diloco.payload_bytes_per_worker) / sum(sync.payload_bytes_per_worker)}
    print(f"DiLoCo / per-step sync: final train loss x{comparison['final_train_loss_ratio']:.3f}, "
          f"payload bytes x{comparison['payload_bytes_ratio']:.3f} (1/H = {1 / cfg.diloco:.3f})", flush=True)
    if cfg.compression:
        sparse = results[0]
        sent = sum(sparse.payload_bytes_per_worker)
        comparison.update({
            "sparseloco_train_loss_ratio_to_diloco": sparse.train_loss / diloco.train_loss,
            "sparseloco_payload_bytes_ratio_to_diloco": sent / sum(diloco.payload_bytes_per_worker),
            "sparseloco_payload_bytes_ratio_to_sync": sent / sum(sync.payload_bytes_per_worker)})
        print(f"SparseLoCo / DiLoCo: final train loss x{comparison['sparseloco_train_loss_ratio_to_diloco']:.3f}, "
              f"payload bytes x{comparison['sparseloco_payload_bytes_ratio_to_diloco']:.4f}; SparseLoCo / per-step "
              f"sync: payload bytes x{comparison['sparseloco_payload_bytes_ratio_to_sync']:.5f}", flush=True)
    plot = cfg.out / "loss_curve.png"
    against = "SparseLoCo and DiLoCo" if cfg.compression else "DiLoCo"
    write_plot(plot, results, title=f"optserve demo: {against} H={cfg.diloco} vs per-step sync DP, {cfg.workers} workers",
               xlabel=f"step per worker ({cfg.workers} x {cfg.batch_size} samples per step in both runs)")
    write_summary(cfg, initial, results, steps_per_worker=steps, comparison=comparison)
    print(f"wrote {plot} and {cfg.out / 'summary.json'}", flush=True)
    return 0
