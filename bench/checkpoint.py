"""A training checkpoint's cost: RemoteOptimizer's state_dict / load_state_dict against torch.optim.AdamW's.

    .venv/bin/python -m bench.checkpoint            # ~100M parameters, Adam
    .venv/bin/python -m bench.checkpoint --small    # ~4M parameters, a quick check

One run starts an embedded server (local Ray, 2 shards) and builds one model twice: one trained a
step by ``RemoteOptimizer`` (optax's ``adam`` on the server), one by ``torch.optim.AdamW`` in
process. In interleaved rounds it times, for each, what a trainer does at a checkpoint:
``state_dict()`` alone, ``torch.save(state_dict())`` to a file, and ``load_state_dict(torch.load())``
(ours replaces the session with one created from the file's state and writes the parameters into
the model). Each figure is the median over the rounds; the peak extra memory is this process's
resident high-water mark above where it stood before the call (``/proc/self/clear_refs``). The
server's shards hold their own copies; their memory is not in these figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
import uuid

from bench._timing import print_table


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """``layers`` square ``Linear(width, width)`` layers (with biases); ``rounds`` interleaved rounds."""

    width: int
    layers: int
    rounds: int

    @property
    def parameters(self) -> int:
        return self.layers * (self.width * self.width + self.width)


FULL = CheckpointConfig(width=2048, layers=24, rounds=3)
SMALL = CheckpointConfig(width=1024, layers=4, rounds=3)


def _model(cfg: CheckpointConfig):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(cfg.width, cfg.width) for _ in range(cfg.layers)])


def _one_step(model, optimizer) -> None:
    import torch

    x = torch.randn(4, model[0].in_features, generator=torch.Generator().manual_seed(1))
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def measured(fn) -> tuple[float, int]:
    """``(seconds, peak extra bytes)`` of ``fn()``: wall time, and the resident high-water mark
    above the resident size before the call."""
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as refs:  # resets VmHWM to the current resident size
        refs.write("5")
    before = _rss_kib("VmRSS")
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    return seconds, max(0, _rss_kib("VmHWM") - before) * 1024


def main(argv=None) -> str:
    import torch

    from optserve.client.torch import RemoteOptimizer
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true")
    args = parser.parse_args(argv)
    cfg = SMALL if args.small else FULL
    running = start_server(ServerConfig(host="127.0.0.1", port=0, shards=2, ray_address="local", min_shard_bytes=0))
    folder = tempfile.mkdtemp(prefix="optserve-bench-checkpoint-")
    try:
        ours_model, theirs_model = _model(cfg), _model(cfg)
        spec = {"name": "adam", "args": {"learning_rate": 1e-3}}
        ours = RemoteOptimizer(ours_model.named_parameters(), running.address, spec,
                               session=f"bench-checkpoint-{uuid.uuid4().hex[:8]}")
        theirs = torch.optim.AdamW(theirs_model.parameters(), lr=1e-3, weight_decay=0.0)
        _one_step(ours_model, ours)
        _one_step(theirs_model, theirs)
        paths = {"ours": os.path.join(folder, "ours.pt"), "theirs": os.path.join(folder, "theirs.pt")}
        optimizers = {"ours": ours, "theirs": theirs}
        operations = {
            "state_dict()": lambda who: optimizers[who].state_dict(),
            "torch.save(state_dict())": lambda who: torch.save(optimizers[who].state_dict(), paths[who]),
            "load_state_dict(torch.load())": lambda who: optimizers[who].load_state_dict(
                torch.load(paths[who], weights_only=False)),
        }
        samples = {(op, who): [] for op in operations for who in optimizers}
        for _ in range(cfg.rounds):
            for op, fn in operations.items():
                for who in ("ours", "theirs"):
                    samples[(op, who)].append(measured(lambda: fn(who)))
        rows = []
        for op in operations:
            ours_s = statistics.median(s for s, _ in samples[(op, "ours")])
            theirs_s = statistics.median(s for s, _ in samples[(op, "theirs")])
            ours_b = statistics.median(b for _, b in samples[(op, "ours")])
            theirs_b = statistics.median(b for _, b in samples[(op, "theirs")])
            rows.append([op, f"{ours_s:.3f}", f"{theirs_s:.3f}", f"{ours_s / max(theirs_s, 1e-9):.2f}x",
                         f"{ours_b / 2**20:.0f}", f"{theirs_b / 2**20:.0f}"])
        state_mib = sum(p.numel() * 4 for p in theirs_model.parameters()) * 3 / 2**20
        title = (f"checkpoint of {cfg.parameters / 1e6:.1f}M parameters with Adam (params + 2 moments: "
                 f"{state_mib:.0f} MiB), medians of {cfg.rounds} interleaved rounds")
        table = print_table(title, ["operation", "optserve s", "torch.optim.AdamW s", "ratio", "optserve peak MiB",
                                    "AdamW peak MiB"], rows)
        ours.session.close()
        ours.close()
        return table
    finally:
        running.stop()
        for name in os.listdir(folder):
            os.remove(os.path.join(folder, name))
        os.rmdir(folder)


if __name__ == "__main__":
    main()
