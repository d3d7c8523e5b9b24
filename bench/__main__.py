"""Runs every benchmark, each in its own process: ``python -m bench [--small] [name ...]``."""

from __future__ import annotations

import subprocess
import sys

BENCHMARKS = ("adafactor", "shampoo", "service", "tls", "metrics", "durability", "torch_loop", "checkpoint", "preconditioners",
              "fuzz", "int8_codec", "elastic", "muon", "soap", "diloco", "sparseloco",
              "sparseloco_quality", "nemesis", "soak", "replicas")


def main(argv: list[str]) -> int:
    flags = [a for a in argv if a.startswith("-")]
    names = [a for a in argv if not a.startswith("-")] or list(BENCHMARKS)
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        print(f"unknown benchmark(s) {unknown}; known: {list(BENCHMARKS)}", file=sys.stderr)
        return 2
    failed = []
    for name in names:
        print(f"\n=== bench.{name} {' '.join(flags)}", flush=True)
        if subprocess.call([sys.executable, "-m", f"bench.{name}", *flags]) != 0:
            failed.append(name)
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
