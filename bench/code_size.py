"""What a compiled step keeps in host memory per preconditioned tensor and per block: the figures
behind each root seam's ``code_cost`` (:mod:`optserve.optim_kernels.registry`), which the shard memory
budget counts. XLA on the CPU reports no code size, so each figure is the anonymous memory a
process keeps after compiling a step (its heap trimmed), beyond a process that compiled the same
optimizer once before (the runtime's first-compile costs are out).

    python -m bench.code_size                  # shampoo and soap, roots on workers and in the step
    python -m bench.code_size --only shampoo:in

Each case runs in a fresh process, twice over two layouts (few tensors of one block each, and
fewer tensors of many blocks), and solves for the cost per tensor and per block; it prints each
measure and the median fit of ``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CASES = {"shampoo:off": ("shampoo", False), "shampoo:in": ("shampoo", True),
         "soap:off": ("soap", False), "soap:in": ("soap", True)}
BLOCK = 256  # Shampoo's default block size
ONE_BLOCK = (8, 1)  # 8 tensors of one block each
MANY_BLOCKS = (2, 4)  # 2 tensors of 4 x 4 blocks each


def _measure_here(name: str, in_step: bool, tensors: int, per_side: int) -> int:
    """Bytes kept after compiling the step of ``tensors`` float32 matrices of ``per_side`` x
    ``per_side`` blocks (this process: call it in a fresh one)."""
    import ctypes
    import gc

    import numpy as np

    from optserve.server.compute import updater
    from optserve.server.compute.root_offload import build_shard_optimizer

    libc = ctypes.CDLL("libc.so.6")
    args = {"learning_rate": 0.01, **({"block_size": BLOCK} if name == "shampoo" else {})}

    def anonymous_bytes() -> int:
        gc.collect()
        libc.malloc_trim(0)
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon"))

    def compile_step(shapes):
        optimizer, _ = build_shard_optimizer(name, args, shapes, pool=None if in_step else object(),
                                             in_process=in_step)
        step = updater.Updater(optimizer, param_specs={t: (s, np.float32) for t, s in shapes.items()})
        if step.step_working_bytes() is None:  # compiles the step (the process-wide cache keeps it)
            raise RuntimeError(f"{name}: the step did not compile for {shapes}")
        return step

    alive = [compile_step({"warm": (BLOCK, BLOCK)})]  # the runtime's first-compile costs, kept out
    before = anonymous_bytes()
    side = BLOCK * per_side
    alive.append(compile_step({f"t{i}": (side, side) for i in range(tensors)}))  # measured while alive
    return anonymous_bytes() - before


def _measure(name: str, in_step: bool, tensors: int, per_side: int) -> int:
    code = (f"import json, bench.code_size as m; print(json.dumps(m._measure_here({name!r}, {in_step}, "
            f"{tensors}, {per_side})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800, check=True)
    return int(json.loads(out.stdout.strip().splitlines()[-1]))


def fit(name: str, in_step: bool) -> tuple[float, float, list[str]]:
    """``(per_tensor, per_block, lines)``: bytes solved from one measure of each layout (SOAP's
    tensors are one block each: its whole cost is per tensor)."""
    (n1, k1), (n2, k2) = ONE_BLOCK, MANY_BLOCKS
    first = _measure(name, in_step, n1, k1)
    lines = [f"  {n1} tensors x {k1 * k1} block(s): {first / 1e6:.1f} MB"]
    if name != "shampoo":
        return first / n1, 0.0, lines
    second = _measure(name, in_step, n2, k2)
    lines.append(f"  {n2} tensors x {k2 * k2} block(s): {second / 1e6:.1f} MB")
    # first = n1 (T + B) ; second = n2 T + n2 k2^2 B
    per_block = (second - first * n2 / n1) / (n2 * k2 * k2 - n2)
    return first / n1 - per_block, per_block, lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=sorted(CASES), help="a case (repeatable; default all)")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)
    for case in args.only or list(CASES):
        name, in_step = CASES[case]
        fits = []
        for _ in range(args.rounds):
            per_tensor, per_block, lines = fit(name, in_step)
            fits.append((per_tensor, per_block))
            print(f"{case}:", *lines, sep="\n", flush=True)
        tensor_kb = statistics.median(f[0] for f in fits) / 1e3
        block_kb = statistics.median(f[1] for f in fits) / 1e3
        print(f"{case}: per tensor {tensor_kb:.0f} KB, per block {block_kb:.0f} KB "
              f"(median of {len(fits)}; roots {'in the step' if in_step else 'on workers'})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
