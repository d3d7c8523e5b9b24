"""How step time, memory and throughput grow with parameters, tensors, shards and client workers.

    .venv/bin/python -m bench.scale                     # the default sweep (see the flags)
    .venv/bin/python -m bench.scale --quick             # a smoke run: ~1M parameters, a minute or two
    .venv/bin/python -m bench.scale --params 10M,100M,1B --optimizers adafactor --paths views,torch \\
        --shards 2 --workers 1 --tensors none --out docs/scaling.md --plots docs/scaling/

Against a real server: ``optserve serve`` in a process of its own (embedded local Ray, shard
actors in theirs), started afresh for every point (``--reuse-server``: one per shard count and optimizer, faster,
but memory freed by a closed session may not go back to the machine, so later points' growth can
read low), with its session limits raised to the machine's memory (``--server-limits default``:
the server's own defaults). Clients and the in-process kernel run in processes of their own
(:mod:`bench._scale_worker`), so each one's resident memory is its own. Sweeps:

* ``params``: a model of k matrices 4096 x 4096 float32 (1024 x 1024 below ~34M parameters) per
  ``--params`` size, through each ``--paths`` (``numpy``: plain dicts, ``push_pull(grads)``;
  ``views``: ``gradient_buffers()`` + ``push_pull(bufs, views=True)``; ``torch``:
  ``RemoteOptimizer``), each ``--optimizers`` (adafactor, adam, shampoo with its roots on a
  preconditioner worker) and each ``--shards``;
* ``tensors``: ``--tensors-params`` parameters split into each ``--tensors`` count of square
  tensors (the fixed cost per tensor);
* ``workers``: ``--workers`` client processes on one session at ``--workers-params`` (throughput).

Each row: the step (median of ``--rounds`` rounds in which the client's step and the in-process
kernel's jitted, donated step of the same optimizer and shapes take turns; the ratio is the median
of per-round ratios), the create time, the server's push / step / pull phase times (its metrics),
and memory per parameter, each the peak growth over the window from session create through the
warm-up steps (:mod:`bench._scale_report`): the client process's RSS (``VmHWM``), the private
memory (``RssAnon``) of the client and of the server's process tree, the ``/dev/shm`` regions they
map, their sum, and the machine's used memory (``MemTotal - MemAvailable``). A point whose
estimated need exceeds ``--max-gb`` (default: the memory available at start, less 1 GiB) is
skipped with its figure; where the service fits but not the kernel beside it, the kernel is timed
alone after the point. ``--out FILE`` writes the tables between markers in FILE (the text around
them kept; ``--section NAME``: a section of their own), ``--plots DIR`` the PNG curves.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shlex
import signal
import sys
import tempfile
import time
from typing import Any

from bench import _scale_report as report
from bench._timing import print_table

OPTIMIZERS = {
    "adafactor": {"name": "adafactor", "args": {"learning_rate": 1e-2}},
    "adam": {"name": "adam", "args": {"learning_rate": 1e-3}},
    "shampoo": {"name": "shampoo", "args": {"learning_rate": 1e-3, "block_size": 256,
                                            "preconditioning_compute_steps": 10},
                "preconditioners": {"in_process": False, "max_age": 20}},
}
PATHS = ("numpy", "views", "torch")
# Estimated bytes per parameter (in units of the parameter's 4 bytes), before a smaller point of
# the same optimizer and path was measured: optimizer state on the server, the server's other
# copies (parameters, gradient staging), each path's client, the kernel process.
STATE = {"adafactor": 0.05, "adam": 2.0, "shampoo": 6.0}
SERVER = 2.0
CLIENT = {"numpy": 5.0, "views": 1.5, "torch": 4.0}
KERNEL = 3.0
FIXED_BYTES = 2 << 30  # Ray's daemons, the processes' runtimes


def parse_count(text: str) -> int:
    """``"10M"`` -> 10_000_000 (K, M, B/G suffixes; plain integers too)."""
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def csv(kind=str):
    return lambda text: [] if text.strip().lower() in ("", "none") else [kind(v) for v in text.split(",")]


def default_shapes(params: int) -> list[tuple[str, tuple[int, ...]]]:
    """k square matrices: 4096 x 4096 from ~34M parameters, 1024 x 1024 from ~1M, one below."""
    dim = 4096 if params >= 2 * 4096**2 else 1024 if params >= 1024**2 else max(1, math.isqrt(params))
    return [(f"layer{i}/w", (dim, dim)) for i in range(max(1, round(params / dim**2)))]


def split_shapes(params: int, tensors: int) -> list[tuple[str, tuple[int, ...]]]:
    """``tensors`` square tensors of ``~params / tensors`` parameters each."""
    dim = max(1, math.isqrt(params // tensors))
    return [(f"t{i}/w", (dim, dim)) for i in range(tensors)]


@dataclasses.dataclass(frozen=True)
class Point:
    """One measurement: a model (``shapes``), an optimizer, a path, shards and client workers."""

    sweep: str  # "params", "tensors" or "workers"
    shapes: tuple
    optimizer: str
    path: str
    shards: int
    workers: int = 1

    @property
    def params(self) -> int:
        return sum(math.prod(shape) for _, shape in self.shapes)

    def label(self) -> str:
        return (f"{self.params / 1e6:.1f}M params in {len(self.shapes)} tensors, {self.optimizer}, {self.path}, "
                f"{self.shards} shard(s), {self.workers} worker(s)")


def plan(args) -> list[Point]:
    """The points of every sweep, each sweep's models smallest first."""
    points = []
    for params in sorted(args.params):
        for optimizer in args.optimizers:
            points += [Point("params", tuple(default_shapes(params)), optimizer, path, shards)
                       for shards in args.shards for path in args.paths]
    for tensors in sorted(args.tensors):
        for optimizer in args.tensors_optimizers or args.optimizers:
            points += [Point("tensors", tuple(split_shapes(args.tensors_params, tensors)), optimizer, path, shards)
                       for shards in args.shards for path in args.paths]
    for workers in sorted(args.workers):
        for optimizer in args.workers_optimizers or args.optimizers:
            points += [Point("workers", tuple(default_shapes(args.workers_params)), optimizer, path, shards, workers)
                       for shards in args.shards for path in args.paths]
    return points


def estimated_bytes(point: Point, learned: dict, kernel: bool) -> int:
    """The machine memory ``point`` is expected to take (the kernel beside it with ``kernel``): from
    the largest measured point of its optimizer and path (x1.15), else from the static factors."""
    p4 = 4 * point.params
    measured = learned.get((point.optimizer, point.path))
    if measured is not None and point.workers == 1:
        service = 1.15 * measured * point.params
    else:
        state = STATE[point.optimizer]
        service = p4 * (SERVER + state + (CLIENT[point.path] + 1.0) * point.workers)
    return int(service + (p4 * (KERNEL + STATE[point.optimizer]) if kernel else 0) + FIXED_BYTES)


def optimizer_spec(name: str, quick: bool) -> dict:
    spec = {key: (dict(value) if isinstance(value, dict) else value) for key, value in OPTIMIZERS[name].items()}
    if quick and name == "shampoo":  # roots within the smoke run's few steps
        spec["args"]["preconditioning_compute_steps"] = 2
        spec["preconditioners"]["max_age"] = 4
    return spec


def server_flags(args, optimizer: str) -> list[str]:
    flags = []
    if args.server_limits == "raised":
        total = report.meminfo()["MemTotal"]
        flags += ["--max-session-bytes", str(total), "--shard-memory-bytes", str(total), "--max-staged-bytes",
                  str(total)]
    if optimizer == "shampoo":
        flags += ["--precond-workers", "1"]
    return flags + shlex.split(args.serve_args)


def _ms(value) -> Any:
    return "-" if value is None else value


def step_rows(rows: list[dict]) -> tuple[list[str], list[list]]:
    header = ["sweep", "M params", "tensors", "optimizer", "path", "shards", "step ms", "x kernel", "kernel ms",
              "ns/param", "create s", "client RSS B/p", "client B/p", "server B/p", "shm B/p", "ours B/p",
              "machine B/p", "server push/step/pull ms", "note"]
    out = []
    for r in rows:
        if r.get("skipped"):
            out.append([r["sweep"], round(r["params"] / 1e6, 1), r["tensors"], r["optimizer"], r["path"], r["shards"],
                        *["-"] * 12, r["skipped"]])
            continue
        ratio = "-" if r.get("ratio") is None else f"{r['ratio']:.2f}"
        note = [] if r.get("interleaved", True) else ["kernel timed apart"]
        if r.get("data_paths") and r["data_paths"] != "shared_memory":
            note.append(f"data path {r['data_paths']}")
        if r.get("shared_tensors") is not None:
            note.append(f"{r['shared_tensors']} shared tensors")
        out.append([r["sweep"], round(r["params"] / 1e6, 1), r["tensors"], r["optimizer"], r["path"], r["shards"],
                    r["step_ms"], ratio, _ms(r.get("kernel_ms")), r["ns_per_param"], r["create_s"], r["client_rss_bpp"],
                    r["client_bpp"], r["server_bpp"], r["shm_bpp"], r["ours_bpp"], r["machine_bpp"], r["phases"],
                    "; ".join(note)])
    return header, out


def worker_rows(rows: list[dict]) -> tuple[list[str], list[list]]:
    header = ["M params", "optimizer", "path", "shards", "workers", "mode", "pushes/s", "updates/s", "M params/s",
              "x kernel rate", "client RSS MB each", "client B/p", "server B/p", "shm B/p", "ours B/p", "machine B/p",
              "server push/step/pull ms", "note"]
    out = []
    for r in rows:
        if r.get("skipped"):
            out.append([round(r["params"] / 1e6, 1), r["optimizer"], r["path"], r["shards"], r["workers"],
                        *["-"] * 12, r["skipped"]])
            continue
        rate = "-" if r.get("x_kernel_rate") is None else f"{r['x_kernel_rate']:.2f}"
        out.append([round(r["params"] / 1e6, 1), r["optimizer"], r["path"], r["shards"], r["workers"], r["mode"],
                    r["pushes_per_s"], r["updates_per_s"], r["mparams_per_s"], rate, r["client_rss_mb"],
                    r["client_bpp"], r["server_bpp"], r["shm_bpp"], r["ours_bpp"], r["machine_bpp"], r["phases"], ""])
    return header, out


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=csv(parse_count), default=None, help="sizes, e.g. 10M,100M,1B")
    parser.add_argument("--optimizers", type=csv(), default=None, help=f"of {','.join(OPTIMIZERS)}")
    parser.add_argument("--paths", type=csv(), default=None, help=f"of {','.join(PATHS)}")
    parser.add_argument("--shards", type=csv(int), default=None, help="shard counts, e.g. 1,2,4")
    parser.add_argument("--workers", type=csv(int), default=None, help="client workers sweep, e.g. 1,2,4,8 (none: skip)")
    parser.add_argument("--workers-params", type=parse_count, default=None, help="model size of the workers sweep")
    parser.add_argument("--workers-optimizers", type=csv(), default=None, help="default: --optimizers")
    parser.add_argument("--workers-mode", choices=("async", "sync"), default="async")
    parser.add_argument("--tensors", type=csv(int), default=None, help="tensors per model sweep (none: skip)")
    parser.add_argument("--tensors-params", type=parse_count, default=None, help="model size of the tensors sweep")
    parser.add_argument("--tensors-optimizers", type=csv(), default=None, help="default: --optimizers")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved timed rounds per point")
    parser.add_argument("--warmup", type=int, default=None, help="steps before the rounds (in the memory window)")
    parser.add_argument("--max-gb", type=float, default=None, help="memory budget (default: available - 1 GiB)")
    parser.add_argument("--force", action="store_true", help="run points whose estimate exceeds the budget")
    parser.add_argument("--server-limits", choices=("raised", "default"), default="raised",
                        help="raised: session and shard limits at the machine's memory; default: the server's")
    parser.add_argument("--serve-args", default="", help="more `optserve serve` flags, one string")
    parser.add_argument("--reuse-server", action="store_true", help="one server per shard count and optimizer")
    parser.add_argument("--profile", type=int, default=0, help="cProfile this many client steps per point")
    parser.add_argument("--quick", action="store_true", help="a smoke run: ~1M parameters, few rounds")
    parser.add_argument("--out", default=None, help="write the tables into this markdown file (between markers)")
    parser.add_argument("--plots", default=None, help="write PNG curves into this folder")
    parser.add_argument("--section", default="", help="a name: the tables go into their own generated section "
                        "of --out (others kept) and the PNG names start with NAME- (e.g. --section 1b)")
    parser.add_argument("--log-dir", default=None, help="server logs (default: a temporary folder)")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = dict(params=[parse_count(v) for v in (["1M"] if quick else ["10M", "30M", "100M", "300M"])],
                    optimizers=["adafactor", "adam"] if quick else list(OPTIMIZERS), paths=list(PATHS),
                    shards=[1] if quick else [1, 2, 4], workers=[1, 2] if quick else [1, 2, 4, 8],
                    workers_params=parse_count("1M" if quick else "30M"), tensors=[10, 1000] if quick else
                    [10, 100, 1000, 10000], tensors_params=parse_count("1M" if quick else "10M"),
                    rounds=3 if quick else 7, warmup=1 if quick else 2)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    named = set(args.optimizers) | set(args.workers_optimizers or ()) | set(args.tensors_optimizers or ())
    unknown = sorted(named - set(OPTIMIZERS)) + sorted(set(args.paths) - set(PATHS))
    if unknown:
        parser.error(f"unknown optimizer(s) or path(s) {unknown}")
    return args


def main(argv=None) -> str:
    from bench import _scale_run as run

    args = parse_arguments(argv)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)  # servers and workers are stopped on the way out
    started = time.monotonic()
    budget = (args.max_gb * 1e9 if args.max_gb else report.meminfo()["MemAvailable"] - (1 << 30))
    machine = report.machine_description()
    command = "python -m bench.scale " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    print(f"bench.scale on {machine}; budget {budget / 1e9:.1f} GB", flush=True)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="optserve-bench-scale-")
    os.makedirs(log_dir, exist_ok=True)
    sampler = report.MemorySampler()
    learned: dict = {}
    steps, workers = [], []
    servers: dict = {}
    kernels: dict = {}
    points = plan(args)
    try:
        for index, point in enumerate(points):
            spec = optimizer_spec(point.optimizer, args.quick)
            base = {"sweep": point.sweep, "params": point.params, "tensors": len(point.shapes),
                    "optimizer": point.optimizer, "path": point.path, "shards": point.shards,
                    "workers": point.workers, "mode": args.workers_mode}
            target = workers if point.sweep == "workers" else steps
            need_both, need = estimated_bytes(point, learned, True), estimated_bytes(point, learned, False)
            if need > budget and not args.force:
                why = f"skipped: needs ~{need / 1e9:.1f} GB, budget {budget / 1e9:.1f} GB"
                print(f"[{index + 1}/{len(points)}] {point.label()}: {why}", flush=True)
                target.append({**base, "skipped": why})
                continue
            beside = need_both <= budget or args.force
            model_key = (point.shapes, point.optimizer)
            for key in [k for k in kernels if k != model_key or not beside]:  # one kernel process at a time
                kernels.pop(key).stop()
            if beside and model_key not in kernels:
                kernels[model_key] = run.Kernel(list(point.shapes), spec)
            server_key = (point.shards, point.optimizer)
            for key in [k for k in servers if k != server_key or not args.reuse_server]:
                servers.pop(key).stop()
            if server_key not in servers:
                servers[server_key] = run.ScaleServer(log_dir, point.shards, server_flags(args, point.optimizer))
            server = servers[server_key]
            session = f"scale-{index}"
            warmup = args.warmup + (spec["args"].get("preconditioning_compute_steps", 0) + 2
                                    if point.optimizer == "shampoo" else 0)
            try:
                if point.sweep == "workers":
                    row = run.run_workers(server, sampler, kernels.get(model_key), session=session, path=point.path,
                                          shapes=list(point.shapes), optimizer=spec, params=point.params,
                                          workers=point.workers, mode=args.workers_mode, rounds=max(3, args.rounds // 2),
                                          steps_per_round=3 if args.quick else 5)
                else:
                    row = run.run_point(server, sampler, kernels.get(model_key), session=session, path=point.path,
                                        shapes=list(point.shapes), optimizer=spec, params=point.params, warmup=warmup,
                                        rounds=args.rounds, profile=args.profile)
                    if not beside:
                        server.stop()
                        servers.clear()
                        row.update(run.kernel_apart(list(point.shapes), spec, args.rounds), interleaved=False)
                        row["ratio"] = row["step_ms"] / row["kernel_ms"]
                    if row.get("ours_bpp") is not None:  # the machine's growth counts other programs too
                        learned[(point.optimizer, point.path)] = max(row["ours_bpp"], row["machine_bpp"] or 0.0)
            except Exception as exc:  # noqa: BLE001 - the point is reported failed; the sweep goes on
                row = {"skipped": f"failed: {str(exc).strip().splitlines()[-1][:200]}"}
                print(f"{point.label()} failed: {exc}", file=sys.stderr, flush=True)
                for key in list(servers):  # the server may be in any state: a fresh one for the next point
                    servers.pop(key).stop()
            if args.reuse_server and server_key in servers:
                _close_session(server.address, session)
            target.append({**base, **row})
            print(f"[{index + 1}/{len(points)}] {point.label()}: {_summary(target[-1])} "
                  f"({report.elapsed(started)})", flush=True)
            if args.out and index + 1 < len(points):  # a run cut short still leaves what it measured
                _write(args, machine, command, steps, workers, started, quiet=True,
                       partial=f"partial: {index + 1} of {len(points)} points")
    finally:
        for kernel in kernels.values():
            kernel.stop()
        for server in servers.values():
            server.stop()
        sampler.stop()
    return _write(args, machine, command, steps, workers, started)


def _stop_on_sigterm(signum, frame) -> None:
    raise SystemExit(f"bench.scale: signal {signum}")


def _close_session(address: str, session: str) -> None:
    from optserve.client import Client

    try:
        with Client(address, timeout=60, shared_memory=False) as client:
            client.close_session(session)
    except Exception:  # noqa: BLE001 - a session left open only costs the reused server memory
        pass


def _summary(row: dict) -> str:
    if row.get("skipped"):
        return row["skipped"]
    if "pushes_per_s" in row:
        return f"{row['pushes_per_s']:.2f} pushes/s, {row['mparams_per_s']:.0f} M params/s"
    ratio = f", {row['ratio']:.2f} x kernel" if row.get("ratio") is not None else ""
    return (f"step {row['step_ms']:.1f} ms{ratio}, create {row['create_s']:.2f} s, ours {row['ours_bpp']:.1f} "
            f"machine {row['machine_bpp']:.1f} B/param")


def _write(args, machine: str, command: str, steps: list, workers: list, started: float, quiet: bool = False,
           partial: str = "") -> str:
    """Prints the tables (unless ``quiet``) and writes ``--out`` and ``--plots`` (not while ``partial``)."""
    title = (f"bench.scale, {report.utc_now()}: step = median of {args.rounds} rounds interleaved with the "
             f"in-process kernel; B/p = bytes per parameter; {report.elapsed(started)}")
    show = (lambda t, h, r: t) if quiet else print_table
    header, rows = step_rows(steps)
    text = show(title, header, rows) if rows else title
    w_header, w_rows = worker_rows(workers)
    if w_rows:
        text += "\n" + show(f"workers sweep ({args.workers_mode})", w_header, w_rows)
    profiles = [f"#### {r['params'] / 1e6:.1f}M, {r['tensors']} tensors, {r['optimizer']}, {r['path']}, "
                f"{r['shards']} shard(s)\n\n```text\n{r['profile']}\n```" for r in steps if r.get("profile")]
    images = (report.plots(args.plots, steps, workers, prefix=f"{args.section}-" if args.section else "")
              if args.plots and not partial else [])
    if args.out:
        parts = [f"Generated by `{command}` on {report.utc_now()}" + (f" ({partial})." if partial else "."),
                 f"Machine: {machine}.",
                 f"Server limits: {args.server_limits}; server started {'per shard count' if args.reuse_server else 'afresh for every point'}; "
                 f"{args.rounds} timed rounds after {args.warmup} warm-up step(s)."]
        if rows:
            parts += ["", "### Step time and memory", "", report.markdown_table(header, rows)]
        if w_rows:
            parts += ["", f"### Throughput against client workers ({args.workers_mode} session)", "",
                      report.markdown_table(w_header, w_rows)]
        if images:
            out_dir = os.path.dirname(os.path.abspath(args.out))
            parts += ["", "### Curves", ""] + [f"![{os.path.basename(p)}]({os.path.relpath(p, out_dir)})" for p in images]
        if profiles:
            parts += ["", "### Client profiles (cProfile, cumulative)", ""] + profiles
        report.write_section(args.out, "\n".join(parts), args.section)
        if not quiet:
            print(f"wrote {args.out}" + (f" and {len(images)} plots in {args.plots}" if images else ""), flush=True)
    return text


if __name__ == "__main__":
    main()
