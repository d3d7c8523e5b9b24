"""Step time of Shampoo with offloaded roots vs in-line roots vs Adafactor (issue 6).

    .venv/bin/python -m bench.preconditioners            # 20 matrices of 1024 x 1024, block_size 256
    .venv/bin/python -m bench.preconditioners --small    # 8 matrices of 512 x 512, block_size 128

Each variant runs the loop a shard runs for one session (``ShardSession``): ``before_update`` ->
one jitted, donated update over the whole pytree -> ``after_update``, with the roots of the
offloaded variant computed by real preconditioner workers (Ray actors on this machine, started by
:func:`optserve.server.compute.preconditioner_pool.start_workers`). gRPC is left out: it costs the same
for every optimizer. A step's time is the mean over ``steps`` timed steps after a warm-up that
compiles everything (the mean, not the median, so steps that wait for roots count). The
offloaded variant also reports the oldest root any update used (target: <= 2 x
preconditioning_compute_steps) and how many updates had to wait.

Target (issue 6): offloaded Shampoo step <= 1.3 x the Adafactor step. Roots and updates share
this machine's cores here, so the offloaded number is an upper bound for a server whose workers
have their own devices.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time


from bench._timing import print_table


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """``matrices`` square ``dim x dim`` parameters; Shampoo blocks of ``block_size``."""

    matrices: int
    dim: int
    block_size: int
    workers: int
    every: int  # preconditioning_compute_steps of the "every N" and offloaded variants
    steps: int  # timed steps per variant (the every-step in-line variant runs fewer)

    def __post_init__(self):
        if min(self.matrices, self.dim, self.block_size, self.workers, self.every, self.steps) < 1:
            raise ValueError(f"all sizes must be >= 1: {self}")


FULL = BenchConfig(matrices=20, dim=1024, block_size=256, workers=2, every=10, steps=30)
SMALL = BenchConfig(matrices=8, dim=512, block_size=128, workers=2, every=10, steps=30)


def _params(config: BenchConfig):
    import numpy as np

    rng = np.random.default_rng(0)
    return {f"layer{i:02d}/w": (rng.standard_normal((config.dim, config.dim)) * 0.02).astype(np.float32)
            for i in range(config.matrices)}


def _grads(params, count: int):
    import jax
    import numpy as np

    rng = np.random.default_rng(1)
    return [{k: jax.device_put((rng.standard_normal(v.shape) * 1e-2).astype(np.float32)) for k, v in params.items()}
            for _ in range(count)]


def _run(name: str, args: dict, params_np, grads, steps: int, warmup: int, pool=None, max_age=None) -> dict:
    """Times ``steps`` shard-style updates; returns the row's numbers."""
    import jax
    import optax

    from optserve.server.compute.root_offload import build_shard_optimizer

    shapes = {k: v.shape for k, v in params_np.items()}
    built, around = build_shard_optimizer(name, args, shapes, pool, max_age=max_age)
    tx = built.transformation

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(step, donate_argnums=(0, 1))
    params = {k: jax.device_put(v) for k, v in params_np.items()}
    state = jax.jit(tx.init)(params)
    oldest = -1
    times = []
    for t in range(warmup + steps):
        g = grads[t % len(grads)]
        start = time.perf_counter()
        if around is not None:
            state = around.before_update(state, g, params)
        params, state = step(params, state, g)
        jax.block_until_ready(params)
        if around is not None:
            state = around.after_update(state)
            oldest = max([oldest] + [b.age for b in around.status().blocks])
        if t >= warmup:
            times.append(time.perf_counter() - start)
    status = around.status() if around is not None else None
    if pool is not None:
        around.drain()
    return {"mean_s": sum(times) / len(times), "median_s": statistics.median(times), "max_s": max(times),
            "oldest": oldest, "waits": status.waits if status else 0, "roots": status.roots_installed if status else 0}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="8 matrices of 512 x 512 (a quick check)")
    args = parser.parse_args(argv)
    config = SMALL if args.small else FULL
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from optserve.server.compute.preconditioner_pool import PoolConfig, PreconditionerPool, start_workers

    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        params = _params(config)
        grads = _grads(params, 3)
        shampoo = {"learning_rate": 1e-3, "block_size": config.block_size, "start_preconditioning_step": 1}
        every = {**shampoo, "preconditioning_compute_steps": config.every}
        pool_config = PoolConfig(workers=config.workers)
        pool = PreconditionerPool(start_workers(pool_config), pool_config)
        rows = []
        variants = [
            ("adafactor (hf)", "adafactor_hf", {"lr": 1e-3, "relative_step": False}, config.steps, None),
            ("shampoo, roots in line every step", "shampoo", shampoo, 2, None),
            (f"shampoo, roots in line every {config.every}", "shampoo", every, config.steps, None),
            (f"shampoo, offloaded roots (P={config.every}, max_age={2 * config.every})", "shampoo", every,
             config.steps, pool),
        ]
        base = None
        for label, name, kwargs, steps, use_pool in variants:
            warmup = 1 if use_pool is None else config.every + 1  # the offloaded warm-up compiles the workers
            numbers = _run(name, kwargs, params, grads, steps, warmup, pool=use_pool)
            base = base or numbers["mean_s"]
            rows.append([label, steps, numbers["mean_s"] * 1e3, numbers["median_s"] * 1e3, numbers["max_s"] * 1e3,
                         numbers["mean_s"] / base,
                         numbers["oldest"] if name == "shampoo" else "-", numbers["waits"] if use_pool else "-"])
        load = os.getloadavg()
        title = (f"bench.preconditioners: {config.matrices} x [{config.dim}, {config.dim}], block_size "
                 f"{config.block_size}, {config.workers} CPU workers (f32), {os.cpu_count()} cores, "
                 f"load avg {load[0]:.1f}")
        print_table(title, ["variant", "steps", "mean ms", "median ms", "max ms", "mean x adafactor", "oldest root",
                            "waits"], rows)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
