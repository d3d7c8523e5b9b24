"""Adafactor step time on ~100M float32 params: ours vs optax.adafactor vs transformers.Adafactor.

    .venv/bin/python -m bench.adafactor            # six 4096x4096 matrices + vectors (~100.7M)
    .venv/bin/python -m bench.adafactor --small    # six 512x512, a quick sanity run

One "step" is the jitted ``update`` + ``optax.apply_updates`` (T5X defaults: factored second
moment, update clipping 1.0, parameter scale, lr 0.01); torch runs ``Adafactor.step()`` with
the equivalent options (``relative_step=False, scale_parameter=True``). JAX steps are timed
with and without donating params and state (fresh 400 MB outputs cost page faults here).

Roofline: the bytes a minimal three-pass Adafactor must move, over the copy bandwidth measured
in the same run (a donated, jitted ``x * c`` over the same matrices, read + write bytes). For a
factored m x n matrix (N = mn float32): pass 1 reads g and p (row/column means of g^2, rms(p)),
pass 2 reads g (rms of the scaled update, for clipping), pass 3 reads g and p and writes p:
6 N * 4 bytes. An unfactored vector also reads and writes v: 10 N * 4 bytes.
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

from bench._timing import median_seconds, print_table
from optserve.optim_kernels.adafactor import adafactor

LR = 0.01


def _shapes(small: bool) -> dict[str, tuple[int, ...]]:
    n = 512 if small else 4096
    shapes = {f"w{i}": (n, n) for i in range(6)}
    shapes.update({f"b{i}": (n,) for i in range(6)})
    shapes.update({"ln_scale": (n,), "ln_bias": (n,)})
    return shapes


def _random_tree(shapes, seed):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return {k: jax.random.normal(key, s, jnp.float32) * 0.02 for key, (k, s) in zip(keys, shapes.items())}


def roofline_bytes(shapes) -> int:
    total = 0
    for s in shapes.values():
        n = int(np.prod(s))
        total += (6 if len(s) == 2 else 10) * n * 4
    return total


def copy_bandwidth(shapes, repeats) -> float:
    """Bytes/s of a donated jitted elementwise copy (read + write) over the matrices."""
    x = _random_tree({k: s for k, s in shapes.items() if len(s) == 2}, seed=9)
    nbytes = sum(v.nbytes for v in x.values())
    copy = jax.jit(lambda t: jax.tree.map(lambda a: a * 1.0001, t), donate_argnums=0)
    box = [copy(x)]

    def run():
        box[0] = copy(box[0])
        jax.block_until_ready(box[0])

    seconds = median_seconds(run, repeats=repeats, warmup=2)
    del box
    return 2 * nbytes / seconds


def _time_jax(tx, shapes, grads, donate: bool, repeats: int) -> float:
    params = _random_tree(shapes, seed=1)
    state = tx.init(params)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    jitted = jax.jit(step, donate_argnums=(0, 1) if donate else ())
    box = [params, state]

    def run():
        box[0], box[1] = jitted(box[0], box[1], grads)
        jax.block_until_ready(box)

    seconds = median_seconds(run, repeats=repeats, warmup=2)
    del box
    return seconds


def _time_torch(shapes, repeats: int) -> float:
    import torch
    from transformers.optimization import Adafactor

    torch.set_num_threads(os.cpu_count() or 1)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes.values()]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 0.02
    opt = Adafactor(params, lr=LR, relative_step=False, scale_parameter=True, warmup_init=False)
    seconds = median_seconds(opt.step, repeats=repeats, warmup=1)
    del opt, params
    return seconds


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="six 512x512 matrices (quick check)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--skip-torch", action="store_true")
    args = parser.parse_args(argv)

    shapes = _shapes(args.small)
    n_params = sum(int(np.prod(s)) for s in shapes.values())
    grads = _random_tree(shapes, seed=2)
    bandwidth = copy_bandwidth(shapes, args.repeats)
    roofline = roofline_bytes(shapes) / bandwidth

    ours_tx = adafactor(learning_rate=LR)
    optax_tx = optax.adafactor(learning_rate=LR)
    times = {
        "optserve adafactor (donated)": _time_jax(ours_tx, shapes, grads, True, args.repeats),
        "optserve adafactor (no donation)": _time_jax(ours_tx, shapes, grads, False, args.repeats),
        "optax.adafactor (donated)": _time_jax(optax_tx, shapes, grads, True, args.repeats),
        "optax.adafactor (no donation)": _time_jax(optax_tx, shapes, grads, False, args.repeats),
    }
    if not args.skip_torch:
        times["transformers.Adafactor (torch)"] = _time_torch(shapes, max(3, args.repeats // 2))

    ours = min(times["optserve adafactor (donated)"], times["optserve adafactor (no donation)"])
    rows = [
        [name, seconds * 1e3, seconds / ours, seconds / roofline] for name, seconds in times.items()
    ]
    rows.append(["roofline (3-pass bytes / copy bw)", roofline * 1e3, roofline / ours, 1.0])
    title = (
        f"Adafactor step, {n_params / 1e6:.1f}M f32 params, jax {jax.__version__} on "
        f"{jax.devices()[0].platform} ({os.cpu_count()} cores); copy bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s, roofline bytes {roofline_bytes(shapes) / 1e9:.2f} GB"
    )
    table = print_table(title, ["step", "median ms", "x ours (best)", "x roofline"], rows)
    best_optax = min(v for k, v in times.items() if k.startswith("optax"))
    summary = f"speedup vs optax.adafactor (best of donated/not): {best_optax / ours:.2f}x"
    if "transformers.Adafactor (torch)" in times:
        summary += f"; vs transformers.Adafactor: {times['transformers.Adafactor (torch)'] / ours:.2f}x"
    summary += f"; ours / roofline: {ours / roofline:.2f}x"
    print(summary, flush=True)
    return table + "\n" + summary


if __name__ == "__main__":
    main()
