"""Shampoo benchmarks: root computation per method/dtype/size, and a Shampoo step with and without roots.

Run ``python -m bench.shampoo`` (full, a few minutes on 2 CPU cores) or ``--small``.
Statistics are Shampoo-like: ``G G^T / k + 1e-6 I`` of random Gaussian ``G`` (condition ~1e4-1e6).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from bench._timing import median_seconds, print_table
from optserve.optim_kernels.shampoo import compute_preconditioners, default_root_method, shampoo


def _statistics(depth: int, n: int, dtype) -> jax.Array:
    rng = np.random.default_rng(n)
    k = max(n // 2, 1)  # rank-deficient Gram part: the ridge matters, as early in training
    g = rng.standard_normal((depth, n, k))
    stats = g @ np.swapaxes(g, 1, 2) / k + 1e-6 * np.eye(n)
    return jnp.asarray(stats, dtype)


def bench_roots(sizes, depths, repeats: int) -> str:
    rows = []
    for n, depth in zip(sizes, depths):
        for x64 in (False, True):
            with jax.enable_x64(x64):
                dtype = jnp.float64 if x64 else jnp.float32
                stats = _statistics(depth, n, dtype)
                exps = jnp.full((depth,), 4, jnp.int32)
                for method in ("coupled_newton", "eigh"):
                    fn = jax.jit(lambda s, e, m=method: compute_preconditioners(s, e, method=m))
                    seconds = median_seconds(lambda: jax.block_until_ready(fn(stats, exps)),
                                             repeats=repeats if n <= 256 else 1)
                    _, errors = fn(stats, exps)
                    rows.append([n, depth, "f64" if x64 else "f32", method, seconds,
                                 1e3 * seconds / depth, float(jnp.max(errors))])
    return print_table(
        "compute_preconditioners (p=4) on " + jax.default_backend(),
        ["n", "blocks", "dtype", "method", "stack_s", "ms_per_block", "max_error"], rows)


def bench_step(dim: int, repeats: int) -> str:
    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.standard_normal((dim, dim)), jnp.float32),
        "w2": jnp.asarray(rng.standard_normal((dim, dim // 2)), jnp.float32),
        "b": jnp.asarray(rng.standard_normal((dim,)), jnp.float32),
    }
    grads = jax.tree.map(lambda p: 0.01 * p, params)
    rows = []
    variants = [
        ("statistics only (inline_preconditioners=False)", dict(inline_preconditioners=False)),
        ("with roots, eigh", dict(root_method="eigh")),
        ("with roots, coupled_newton", dict(root_method="coupled_newton")),
    ]
    for label, kwargs in variants:
        tx = shampoo(0.01, block_size=128, **kwargs)
        state = tx.init(params)
        update = jax.jit(tx.update)
        seconds = median_seconds(lambda: jax.block_until_ready(update(grads, state, params)), repeats=repeats)
        rows.append([label, seconds])
    n_blocks = int(tx.init(params).preconditioner_info.exponents.shape[0])
    return print_table(f"Shampoo step, params {dim}x{dim} + {dim}x{dim // 2} + {dim}, block 128 "
                       f"({n_blocks} statistics) on {jax.default_backend()}", ["variant", "seconds"], rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--small", action="store_true", help="tiny sizes, for a smoke run")
    args = parser.parse_args(argv)
    if args.small:
        bench_roots([32, 64], [4, 4], repeats=2)
        bench_step(128, repeats=2)
    else:
        bench_roots([128, 256, 512, 1024], [8, 8, 4, 2], repeats=3)
        bench_step(512, repeats=3)
    print(f"root_method='auto' (an opt-in; the default is coupled_newton) picks here: {default_root_method()}")


if __name__ == "__main__":
    main()
