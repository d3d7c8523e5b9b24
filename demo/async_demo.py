"""``optserve demo`` (without ``--diloco``): asynchronous training against its in-process twin.

Worker processes train the digits MLP on one asynchronous session of the embedded server, each
with :class:`optserve.client.torch.RemoteOptimizer` on its own minibatches; then this process
trains the same model (same initial weights, batch size and number of updates) with the same
optimizer in process (:func:`optserve.demo.optimizers.in_process_optimizer`). Both follow the
same learning rate: by default warmup + cosine, a schedule spec in the session's optimizer that the
server evaluates at the session's step count (:meth:`~optserve.demo.config.DemoConfig.learning_rate`),
and its torch twin in process.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
import uuid

import numpy as np

from optserve.client import Client
from optserve.demo.config import DemoConfig
from optserve.demo.digits import DigitsSplit, evaluate, load_digits_split, make_model
from optserve.demo.embedded_server import embedded_server
from optserve.demo.optimizers import KernelInProcess, describe_learning_rate, in_process_optimizer, optimizer_spec
from optserve.demo.report import RunResult, print_table, write_plot, write_session_report, write_summary
from optserve.demo.worker_processes import data_path_line, drive_workers, start_workers, stop_workers


def run_async_demo(cfg: DemoConfig, data: DigitsSplit, initial: tuple[float, float]) -> int:
    """The asynchronous demo after the flags and data are ready: both runs, the table, the plot
    and the summary; returns the exit status (0)."""
    with embedded_server(cfg) as address:
        print(f"server listening on {address}; {cfg.workers} workers x {cfg.steps} steps", flush=True)
        print(f"optimizer: {cfg.optimizer}, {describe_learning_rate(cfg.learning_rate())}", flush=True)
        remote = run_remote(cfg, address, data)
    baseline = run_in_process(cfg, data)
    results = [remote, baseline]
    print_table(cfg, initial, results)
    plot = cfg.out / "loss_curve.png"
    write_plot(plot, results)
    write_summary(cfg, initial, results)
    print(f"wrote {plot} and {cfg.out / 'summary.json'}", flush=True)
    return 0


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

        from optserve.client.torch import RemoteOptimizer  # imports torch

        torch.set_num_threads(1)
        cfg = task.config
        data = load_digits_split(seed=cfg.seed)
        model = make_model(cfg.seed)
        optimizer = RemoteOptimizer(
            model.named_parameters(),
            task.address,
            optimizer_spec(cfg.optimizer, cfg.learning_rate()),
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


# --- the two runs -------------------------------------------------------------------------------


def run_remote(cfg: DemoConfig, address: str, data: DigitsSplit) -> RunResult:
    """Creates the async session, runs the worker processes, evaluates the session's model."""
    from optserve.client.torch import RemoteOptimizer  # imports torch

    session_name = f"demo-{uuid.uuid4().hex[:8]}"
    model = make_model(cfg.seed)
    owner = RemoteOptimizer(  # creates the session from the seeded weights; workers attach
        model.named_parameters(),
        address,
        optimizer_spec(cfg.optimizer, cfg.learning_rate()),
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
                             on_ready=lambda paths: print(data_path_line(paths, cfg), flush=True))
        finished = True
    finally:
        stop_workers(procs, finished)
    dropped = sum(stale for stale, in seen.done.values())
    owner.pull()  # the session's final parameters into `model`
    write_session_report(address, session_name, cfg.out)
    with Client(address) as client:  # the optimizer as the server holds it (the schedule spec included)
        options = client.session_options(session_name)
    owner.session.close()
    owner.close()
    train_loss, _ = evaluate(model, data.x_train, data.y_train)
    test_loss, test_accuracy = evaluate(model, data.x_test, data.y_test)
    label = f"optserve async, {cfg.workers} worker process{'es' if cfg.workers > 1 else ''}"
    curve = [(index, loss) for index, (_, _, loss) in enumerate(seen.losses)]
    return RunResult(label, sum(seen.steps) - dropped, dropped, seen.seconds, train_loss, test_loss, test_accuracy,
                     curve, data_path="+".join(sorted(seen.paths)),
                     optimizer={"name": options.optimizer, "args": dict(options.optimizer_args)})


def run_in_process(cfg: DemoConfig, data: DigitsSplit) -> RunResult:
    """The same model, initial weights, batch size and number of updates, trained in process."""
    import torch

    model = make_model(cfg.seed)
    updates = cfg.updates
    optimizer, scheduler = in_process_optimizer(cfg.optimizer, cfg.learning_rate(), model.parameters(), updates)
    rng = np.random.default_rng(cfg.seed + 999_999)
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    curve = []
    start = time.perf_counter()
    for step in range(updates):
        batch = torch.from_numpy(rng.integers(0, len(x), cfg.batch_size))
        loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()  # the rate of the next update, as the server's schedule gives it
        curve.append((step, float(loss.item())))
    seconds = time.perf_counter() - start
    train_loss, _ = evaluate(model, data.x_train, data.y_train)
    test_loss, test_accuracy = evaluate(model, data.x_test, data.y_test)
    label = optimizer.name if isinstance(optimizer, KernelInProcess) else type(optimizer).__name__
    return RunResult(f"in process ({label})", updates, 0, seconds, train_loss, test_loss, test_accuracy, curve)
