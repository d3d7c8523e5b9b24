"""``optserve demo``: the whole product on one machine, in a few minutes on 2 cores.

An application on top of optserve (its own package, ``optserve.demo``; it needs the ``demo``
extra: torch, scikit-learn, matplotlib, transformers, tqdm, rich). ``optserve demo`` finds it
through the ``optserve.commands`` entry point (:func:`main`); the server never imports it.

1. starts an embedded server (local Ray, 2 shard actors) on a free loopback port;
2. creates an asynchronous session holding a small MLP's parameters (scikit-learn's bundled
   8x8 digits: nothing is downloaded);
3. launches 2 worker *processes*, each training that MLP with ``torch`` and
   :class:`optserve.client.torch.RemoteOptimizer` on its own minibatches, with a progress bar;
4. trains the same model (same initial weights, same number of updates, same batch size) in
   process with the same optimizer (``torch.optim.Adam`` for ``adam``, ``transformers.Adafactor``
   for ``adafactor_hf``, the server's own kernel run in process for ``muon`` and ``soap``);
5. prints a table of final loss / accuracy for both, writes ``loss_curve.png`` and
   ``summary.json`` under ``--out`` (default ``./demo_out``).

``optserve demo --diloco H`` instead compares DiLoCo (H inner AdamW steps per round, then one
pseudo-gradient exchange) with per-step synchronous data parallelism on the same worker
processes and the same minibatches (:mod:`optserve.demo.diloco`).

The modules, by job: :mod:`~optserve.demo.config` (the flags), :mod:`~optserve.demo.digits`
(the data and the model, also used by the compression test), :mod:`~optserve.demo.optimizers`
(server spec and in-process twin), :mod:`~optserve.demo.embedded_server`,
:mod:`~optserve.demo.worker_processes` (spawning and following the workers),
:mod:`~optserve.demo.async_demo` and :mod:`~optserve.demo.diloco` (the two demos),
:mod:`~optserve.demo.report` (table, plot, summary).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Optional, Sequence

from optserve.demo.async_demo import run_async_demo
from optserve.demo.config import parse_args
from optserve.demo.digits import evaluate, load_digits_split, make_model
from optserve.demo.diloco import run_diloco_demo

_NEEDS = ("torch", "sklearn", "matplotlib", "transformers", "tqdm", "rich", "jax", "optax", "ray")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the demo; returns the process exit status (0 on success, 2 for a bad flag or a missing
    dependency, each reported in one line on stderr)."""
    try:
        cfg = parse_args(argv)
    except ValueError as exc:
        print(f"optserve demo: {exc}", file=sys.stderr)
        return 2
    missing = _missing(_NEEDS)
    if missing:
        print(f"optserve demo: the demo is not installed (pip install -e '.[demo]'): missing {', '.join(missing)}",
              file=sys.stderr)
        return 2
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cfg.out.mkdir(parents=True, exist_ok=True)
    import torch

    torch.set_num_threads(1)
    data = load_digits_split(seed=cfg.seed)
    initial = evaluate(make_model(cfg.seed), data.x_test, data.y_test)
    if cfg.diloco is not None:
        return run_diloco_demo(cfg, data, initial)
    return run_async_demo(cfg, data, initial)


def _missing(modules: Sequence[str]) -> list[str]:
    """The top-level ``modules`` that cannot be imported here (not found, or their lookup fails)."""
    missing = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


if __name__ == "__main__":
    sys.exit(main())
