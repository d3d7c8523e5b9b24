"""Muon step time on ~25M float32 params in 2-D matrices: ours vs optax.contrib.muon, in process.

    .venv/bin/python -m bench.muon            # 3 transformer blocks of width 832 (~24.9M params)
    .venv/bin/python -m bench.muon --small    # 2 blocks of width 256, a quick sanity run

One "step" is the jitted ``update`` + ``optax.apply_updates`` with params and state donated, on
the same shapes and gradients for both (default options: Nesterov, 5 Newton–Schulz steps,
lr 0.02). The two take turns within every round (a slow spell of the machine falls on both) and
the ratio is the median of the per-round ratios. Every matrix takes the Muon path, so the step is
dominated by the Newton–Schulz matmuls: per iteration on the wide ``m x n`` orientation,
``X X^T`` (2 m^2 n flops), ``A A`` (2 m^3) and ``B X`` (2 m^2 n).
"""

from __future__ import annotations

import argparse
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optserve.optim_kernels.muon import muon

from bench._timing import print_table
from bench.service import interleaved_seconds

LR = 0.02
NS_STEPS = 5


def _shapes(small: bool) -> dict[str, tuple[int, int]]:
    """Transformer-block matrices in the (fan_in, fan_out) layout: qkv, attention out, MLP in / out."""
    width, blocks = (256, 2) if small else (832, 3)
    shapes = {}
    for b in range(blocks):
        shapes.update({f"block{b}/qkv": (width, 3 * width), f"block{b}/attn_out": (width, width),
                       f"block{b}/mlp_in": (width, 4 * width), f"block{b}/mlp_out": (4 * width, width)})
    return shapes


def _random_tree(shapes, seed):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return {k: jax.random.normal(key, s, jnp.float32) * 0.02 for key, (k, s) in zip(keys, shapes.items())}


def _ns_flops(shapes) -> float:
    total = 0.0
    for rows, cols in shapes.values():
        m, n = min(rows, cols), max(rows, cols)
        total += NS_STEPS * (4 * m * m * n + 2 * m**3)
    return total


def _stepper(tx, shapes, grads):
    """A zero-argument function running one donated, jitted step (blocks until done)."""

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    jitted = jax.jit(step, donate_argnums=(0, 1))
    params = _random_tree(shapes, seed=1)
    box = [params, tx.init(params)]

    def run():
        box[0], box[1] = jitted(box[0], box[1], grads)
        jax.block_until_ready(box)

    return run, box


def _first_step_difference(shapes, grads) -> float:
    """Max relative difference of one step's updates, ours vs optax, from the same inputs."""
    params = _random_tree(shapes, seed=1)
    worst = 0.0
    results = []
    for tx in (muon(LR), optax.contrib.muon(LR)):
        updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
        results.append(updates)
    for name in shapes:
        a, b = np.asarray(results[0][name]), np.asarray(results[1][name])
        worst = max(worst, float(np.max(np.abs(a - b)) / np.max(np.abs(b))))
    return worst


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="2 blocks of width 256 (quick check)")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved rounds")
    args = parser.parse_args(argv)

    shapes = _shapes(args.small)
    n_params = sum(int(np.prod(s)) for s in shapes.values())
    grads = _random_tree(shapes, seed=2)
    difference = _first_step_difference(shapes, grads)
    steps = {}
    boxes = []
    for name, tx in (("optserve muon", muon(LR)), ("optax.contrib.muon", optax.contrib.muon(LR))):
        steps[name], box = _stepper(tx, shapes, grads)
        boxes.append(box)
    samples, _ = interleaved_seconds(steps, rounds=args.repeats, warmup=2)

    ours, theirs = samples["optserve muon"], samples["optax.contrib.muon"]
    ratios = [a / b for a, b in zip(ours, theirs)]
    flops = _ns_flops(shapes)
    rows = []
    for name, times in samples.items():
        median = statistics.median(times)
        note = "" if name != "optserve muon" else (
            f"{statistics.median(ratios):.3f} x optax (median per round) [{min(ratios):.2f}, {max(ratios):.2f}]")
        rows.append([name, median * 1e3, flops / median / 1e9, note])
    title = (f"Muon step, {n_params / 1e6:.1f}M f32 params in {len(shapes)} matrices, jax {jax.__version__} on "
             f"{jax.devices()[0].platform} ({os.cpu_count()} cores); median of {args.repeats} interleaved rounds "
             f"after 2 warm-up; Newton-Schulz {flops / 1e9:.0f} GFLOP per step")
    table = print_table(title, ["step", "median ms", "NS GFLOP/s", "note"], rows)
    summary = (f"ours / optax.contrib.muon: {statistics.median(ratios):.3f}x (target <= 1.2x); "
               f"first-step max relative difference of updates: {difference:.2e}")
    print(summary, flush=True)
    del boxes
    return table + "\n" + summary


if __name__ == "__main__":
    main()
