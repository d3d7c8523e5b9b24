"""Steps/s of a torch training loop: RemoteOptimizer (overlap off/on, f32/bf16 wire) vs in-process Adam.

    .venv/bin/python -m bench.torch_loop            # ~25M-parameter MLP
    .venv/bin/python -m bench.torch_loop --small    # ~0.6M parameters, a quick check

One run starts an embedded server (local Ray, 2 shards), times each variant's training step
(forward, backward, ``step()``, ``zero_grad()``) as a median over repeats, and prints a table
with steps/s and the ratio to the in-process ``torch.optim.Adam`` loop. The server runs
optax's ``adam`` with the same hyperparameters.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import uuid


from bench._timing import median_seconds, print_table


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """Model and timing sizes. ``width``: hidden width; ``depth``: hidden-to-hidden layers."""

    d_in: int
    width: int
    depth: int
    batch: int
    repeats: int
    shards: int = 2

    def __post_init__(self):
        if min(self.d_in, self.width, self.depth, self.batch, self.repeats, self.shards) < 1:
            raise ValueError(f"all sizes must be >= 1: {self}")


FULL = LoopConfig(d_in=1024, width=2048, depth=5, batch=32, repeats=8)
SMALL = LoopConfig(d_in=256, width=384, depth=3, batch=32, repeats=8)


def make_model(cfg: LoopConfig):
    import torch

    torch.manual_seed(0)
    layers = [torch.nn.Linear(cfg.d_in, cfg.width), torch.nn.ReLU()]
    for _ in range(cfg.depth):
        layers += [torch.nn.Linear(cfg.width, cfg.width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(cfg.width, cfg.d_in))
    return torch.nn.Sequential(*layers)


def time_loop(model, optimizer, cfg: LoopConfig, scheduled: bool = False) -> float:
    """Median seconds of one training step (the optimizer's pending work included for overlap);
    ``scheduled``: a ``LambdaLR`` changes the learning rate after every step (each step then sends
    its new rate to the server before its push)."""
    import torch

    g = torch.Generator().manual_seed(1)
    x = torch.randn(cfg.batch, cfg.d_in, generator=g)
    y = torch.randn(cfg.batch, cfg.d_in, generator=g)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0 / (1.0 + 1e-3 * k)) if scheduled else None

    def step():
        optimizer.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()

    seconds = median_seconds(step, repeats=cfg.repeats, warmup=2)
    if hasattr(optimizer, "synchronize"):
        optimizer.synchronize()
    return seconds


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a ~0.6M-parameter model for a quick check")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: stable on shared machines)")
    args = parser.parse_args(argv)
    cfg = SMALL if args.small else FULL
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    import torch

    from optserve.client.torch import RemoteOptimizer
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig

    torch.set_num_threads(args.threads)
    n_params = sum(p.numel() for p in make_model(cfg).parameters())
    print(f"model: {n_params / 1e6:.1f}M params, batch {cfg.batch}, torch threads {torch.get_num_threads()}", flush=True)

    rows = []
    model = make_model(cfg)
    baseline = time_loop(model, torch.optim.Adam(model.parameters(), lr=1e-3), cfg)
    rows.append(["in-process torch.optim.Adam", "-", "-", baseline * 1e3, 1 / baseline, 1.0])
    model = make_model(cfg)
    with_scheduler = time_loop(model, torch.optim.Adam(model.parameters(), lr=1e-3), cfg, scheduled=True)
    rows.append(["in-process torch.optim.Adam + LambdaLR", "-", "-", with_scheduler * 1e3, 1 / with_scheduler,
                 baseline / with_scheduler])

    server = start_server(ServerConfig(host="127.0.0.1", port=0, shards=cfg.shards, ray_address="local"))
    try:
        for overlap, wire, scheduled in ((False, None, False), (False, None, True), (False, "bfloat16", False),
                                         (True, None, False), (True, None, True), (True, "bfloat16", False)):
            model = make_model(cfg)
            optimizer = RemoteOptimizer(
                model.named_parameters(),
                server.address,
                {"name": "adam", "args": {"learning_rate": 1e-3}},
                session=f"bench-{uuid.uuid4().hex[:8]}",
                wire_dtype=wire,
                overlap=overlap,
            )
            seconds = time_loop(model, optimizer, cfg, scheduled=scheduled)
            rows.append([
                "RemoteOptimizer (adam)" + (" + LambdaLR" if scheduled else ""), "on" if overlap else "off",
                wire or "float32",
                seconds * 1e3, 1 / seconds, baseline / seconds,
            ])
            optimizer.session.close()
            optimizer.close()
    finally:
        server.stop()
    bytes_per_step = n_params * 4
    return print_table(
        f"torch training loop, {n_params / 1e6:.1f}M params ({bytes_per_step / 1e6:.0f} MB f32 each way per step), "
        f"{cfg.shards} shards, loopback",
        ["loop", "overlap", "wire", "step ms (median)", "steps/s", "vs in-process"],
        rows,
    )


if __name__ == "__main__":
    main()
