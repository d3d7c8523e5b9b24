"""What durability costs: the service step with durability off / the step log on / a checkpoint
being written, same run; a checkpoint's wall time and size; recovery time from a shard SIGKILL.

    .venv/bin/python -m bench.durability            # ~100M float32 params (6 x 4096 x 4096), 2 shards
    .venv/bin/python -m bench.durability --small    # 4 x 512 x 512, a quick smoke run

Step times: three servers side by side (:mod:`bench._ab`, interleaved rounds, after warm-up
rounds so that the page cache and the heaps are in their steady state). "every 8 steps" checkpoints
every 8th step (the log holds at most 8 steps and is truncated behind each checkpoint); "default
policy" runs the defaults (a checkpoint whenever the log would pass 2 x the parameter bytes, i.e.
every other step for this model, so one is nearly always being written). The comparison runs
once per log mode, each with its own baseline: ``auto`` (the default: direct I/O where the
filesystem takes it), through the page cache (``buffered``) and with direct I/O (``direct``: by DMA
from the gradients' memory, no copy on the shard's CPU); ``--log-io`` runs one of them. Each durable variant's
steps are split by what its shards were doing (read from ``Session.status()`` before and after
each step, outside its timing): "log on" steps saw no checkpoint being written, the others did.
``--dir`` puts the checkpoints and logs elsewhere (e.g. ``/dev/shm`` to take the disk out and see
the CPU cost alone).

Write order: durability off against the step log alone (no checkpoint ever), its record written
while the update runs (the default) and before it (``write_ahead``), and the disk's own time to
write one step's gradient with direct I/O in the same folder: a logged step cannot take less than
that, whatever the order (``--order`` runs only this table).

Recovery: a durable server, a session trained a few steps (a checkpoint, then log records), the
shard holding the session's clock SIGKILLed; the time from the kill until the same client's next
``push_pull`` returns (Ray restarts the actor, which restores the checkpoint and replays the log).
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time

import numpy as np

from bench._ab import Split, compare, parse_arguments
from bench._timing import print_table
from bench.service import OPTIMIZER, _model

NEVER = 10**12


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def recovery(small: bool, shards: int, checkpoint_dir: str) -> list:
    """Rows: checkpoint wall time and size, and the recovery time after a shard SIGKILL."""
    from optserve.client import Client
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig
    from optserve.server.domain.durability import DurabilityConfig

    matrices, dim = (4, 512) if small else (6, 4096)
    params = _model(matrices, dim)
    grads = {k: np.random.default_rng(1).standard_normal(v.shape, dtype=np.float32) * 1e-3 for k, v in params.items()}
    server = start_server(ServerConfig(host="127.0.0.1", port=0, shards=shards, durability=DurabilityConfig(
        checkpoint_dir, every_steps=3, every_s=1e9, max_log_bytes=NEVER)))
    try:
        client = Client(server.address, timeout=600)
        session = client.create_session("recover", params, optimizer=OPTIMIZER)
        out = session.pull()
        for _ in range(3):  # a checkpoint at version 3
            session.push_pull(grads, out=out)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # wait until it is on disk
            durability = [s.durability for s in session.status().shards]
            if min(d.durable_version for d in durability) >= 3:
                break
            time.sleep(0.5)
        checkpoint_s = max(d.checkpoint_seconds for d in durability)
        checkpoint_bytes = sum(_folder_bytes(os.path.join(checkpoint_dir, "sessions", "recover", f"shard-{i}",
                                                          "checkpoint-3")) for i in range(len(durability)))
        for _ in range(2):  # two steps in the log only
            session.push_pull(grads, out=out)
        os.kill(server.fleet.pids()[0], signal.SIGKILL)
        killed = time.monotonic()
        session.push_pull(grads, out=out)
        recovered_s = time.monotonic() - killed
        status = session.status()
        assert status.version == 6, status
        session.close()
        client.close()
    finally:
        server.stop()
    return [["checkpoint write (background), whole session", checkpoint_s * 1e3, "",
             f"{checkpoint_bytes / 1e6:.0f} MB on disk (orbax) for {sum(v.nbytes for v in params.values()) / 1e6:.0f}"
             f" MB of params + the optimizer state"],
            ["recovery: shard SIGKILL -> next push_pull served", recovered_s * 1e3, "",
             "restart + restore checkpoint + replay 2 logged steps + the step"]]


def disk_write_seconds(folder: str, nbytes: int, repeats: int = 3) -> float:
    """Median seconds to write ``nbytes`` into a fresh file in ``folder`` with direct I/O (through
    the page cache where the filesystem refuses it) and fsync it: the disk's floor under a step
    whose log record is that big."""
    import mmap
    import statistics

    block = 4 << 20
    buffer = mmap.mmap(-1, block)  # page aligned, as O_DIRECT needs
    buffer.write(np.random.default_rng(0).bytes(block))
    path = os.path.join(folder, "disk-probe")
    samples = []
    for _ in range(repeats):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o600)
        except OSError:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            started = time.perf_counter()
            for _ in range(-(-nbytes // block)):
                os.write(fd, buffer)
            os.fsync(fd)
            samples.append(time.perf_counter() - started)
        finally:
            os.close(fd)
            os.unlink(path)
    return statistics.median(samples)


def write_orders(folder: str, small: bool, shards: int, repeats: int) -> str:
    """The step with durability off, the log alone written while the update runs and before it
    (write-ahead), and the disk's time to write one step's gradient: printed tables."""
    from optserve.server.domain.durability import DurabilityConfig

    def log_alone(name: str, **kwargs) -> DurabilityConfig:
        return DurabilityConfig(os.path.join(folder, name), every_steps=NEVER, every_s=1e9, max_log_bytes=NEVER,
                                **kwargs)

    table = compare(f"bench.durability, write order (the log alone, no checkpoint; in {folder})", {
        "durability off": ({}, {}),
        "log, written while the update runs (default)": ({"durability": log_alone("overlapped")}, {}),
        "log, written before the update (--write-ahead)": ({"durability": log_alone("ahead", write_ahead=True)}, {}),
    }, small=small, shards=shards, repeats=repeats, warmup=3)
    matrices, dim = (4, 512) if small else (6, 4096)
    nbytes = matrices * dim * dim * 4
    os.makedirs(folder, exist_ok=True)
    seconds = disk_write_seconds(folder, nbytes)
    return table + print_table("bench.durability: the disk", ["what", "ms", "GB/s", "note"], [
        [f"direct write + fsync of one step's gradient ({nbytes / 1e6:.0f} MB)", seconds * 1e3, nbytes / seconds / 1e9,
         "median of 3; the least a logged step can take (the log moves this much per step)"]])


def _checkpoint_probe(session) -> tuple:
    """(checkpoints committed per shard, whether any shard is writing one now)."""
    durability = [shard.durability for shard in session.status().shards]
    return tuple(d.checkpoints_written for d in durability), any(d.checkpoint_writing for d in durability)


def main(argv=None) -> str:
    def extra(parser):
        parser.add_argument("--dir", default=None, help="folder for the checkpoints and logs (default: a temporary "
                                                         "folder)")
        parser.add_argument("--log-io", choices=["auto", "buffered", "direct"], default=None,
                            help="run only this kind of log writes (default: each, one after the other)")
        parser.add_argument("--order", action="store_true",
                            help="run only the write-order table (the log alone, overlapped and write-ahead)")
        parser.set_defaults(repeats=16)  # enough rounds for both kinds of durable steps

    args = parse_arguments(__doc__.splitlines()[0], argv, extra=extra)
    from optserve.server.domain.durability import DurabilityConfig, LogIO

    root = tempfile.mkdtemp(prefix="optserve-bench-durability-", dir=args.dir)
    try:
        if args.order:
            return write_orders(os.path.join(root, "order"), args.small, args.shards, args.repeats)
        split = Split(_checkpoint_probe, "log on", "a checkpoint being written")
        table = ""
        # two runs of three servers, not one of five: five 100M-parameter servers crowd 2 cores
        for log_io in [LogIO(args.log_io)] if args.log_io else list(LogIO):
            suffix = {LogIO.AUTO: " (defaults)", LogIO.BUFFERED: ", buffered", LogIO.DIRECT: ", direct I/O"}[log_io]
            folder = os.path.join(root, log_io.value)
            durable = {f"every 8 steps{suffix}": DurabilityConfig(os.path.join(folder, "every-8"), every_steps=8,
                                                                  every_s=1e9, max_log_bytes=NEVER, log_io=log_io),
                       f"default policy{suffix}": DurabilityConfig(os.path.join(folder, "default"), log_io=log_io)}
            table += compare(f"bench.durability, log writes {log_io.value} (logs and checkpoints in {folder})", {
                "durability off": ({}, {}), **{name: ({"durability": config}, {}) for name, config in durable.items()},
            }, small=args.small, shards=args.shards, repeats=args.repeats, warmup=3,
                splits={name: split for name in durable})
        if not args.log_io:
            table += write_orders(os.path.join(root, "order"), args.small, args.shards, args.repeats)
        rows = recovery(args.small, args.shards, os.path.join(root, "recovery"))
        return table + print_table("bench.durability: checkpoint and recovery", ["what", "ms", "", "note"], rows)
    finally:
        shutil.rmtree(root, ignore_errors=True)

if __name__ == "__main__":
    main()
