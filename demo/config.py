"""``optserve demo``'s flags: the :class:`DemoConfig` they make, validated, and its parser."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional, Sequence

from optserve.client.cli import OneLineArgumentParser
from optserve.demo.optimizers import DEMO_OPTIMIZERS, LR_SCHEDULES, LearningRate, learning_rate, optimizer_spec

DILOCO_DEFAULT_ROUNDS = 20  # outer rounds of ``optserve demo --diloco H`` without --steps


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """``optserve demo`` flags (validated here).

    Attributes:
      steps: updates each worker pushes; the in-process run makes ``workers * steps``.
      workers: worker processes sharing the asynchronous session.
      shards: shard actors of the embedded server.
      batch_size: examples per gradient.
      optimizer / lr: see :func:`optserve.demo.optimizers.optimizer_spec`; ``lr`` is the peak rate.
      schedule: the learning rate over the run (:data:`~optserve.demo.optimizers.LR_SCHEDULES`):
        ``"warmup_cosine"`` (the asynchronous demo's default: a schedule spec the server
        evaluates, see :meth:`learning_rate`) or ``"constant"`` (``lr`` throughout; ``--diloco``
        compares at a constant rate).
      max_staleness / staleness_policy: async: pushes more than ``max_staleness`` versions old
        are rejected (the worker drops that step and refreshes its parameters) or, with
        ``"scale"``, applied with the step scaled by 1 / (1 + staleness).
      wire_dtype: transport dtype of gradients and parameters (None: float32).
      overlap: workers compute the next gradient while their push is in flight
        (one-step-delayed parameters, see ``optserve.client.overlap``).
      shared_memory: workers move tensor bytes through shared memory where each shard proves it
        is on their host (``Client(shared_memory="auto")``); False (``--no-shared-memory``):
        gRPC bytes.
      out: directory for ``loss_curve.png`` and ``summary.json``.
      progress: draw a progress bar.
      seed: model initialisation and data order.
      diloco: H: compare DiLoCo with H inner steps per round against per-step synchronous data
        parallelism instead (:mod:`optserve.demo.diloco`); None: the asynchronous demo.
      compression: with ``diloco``: "sparseloco" adds a run of DiLoCo with SparseLoCo's
        compression (its defaults, outer SGD at learning rate 1) before the dense one; None: not.
    """

    steps: int = 150
    workers: int = 2
    shards: int = 2
    batch_size: int = 32
    optimizer: str = "adam"
    lr: float = 1e-2
    schedule: str = "warmup_cosine"
    max_staleness: int = 4
    staleness_policy: str = "reject"
    wire_dtype: Optional[str] = None
    overlap: bool = False
    shared_memory: bool = True
    out: Path = Path("demo_out")
    progress: bool = True
    seed: int = 0
    diloco: Optional[int] = None
    compression: Optional[str] = None

    def __post_init__(self):
        for field in ("steps", "workers", "shards", "batch_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"--{field.replace('_', '-')} must be >= 1, got {getattr(self, field)}")
        if self.max_staleness < 0:
            raise ValueError(f"--max-staleness must be >= 0, got {self.max_staleness}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        optimizer_spec(self.optimizer, self.lr)  # validates the name
        if self.schedule not in LR_SCHEDULES:
            raise ValueError(f"--schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.schedule!r}")
        if self.diloco is not None:
            if self.diloco < 1:
                raise ValueError(f"--diloco must be >= 1 (inner steps per round), got {self.diloco}")
            if self.optimizer != "adam":
                raise ValueError(f"--diloco compares AdamW workers with per-step adam: --optimizer must be adam, "
                                 f"got {self.optimizer!r}")
            if self.overlap:
                raise ValueError("--diloco runs without --overlap (both of its runs exchange synchronously)")
            if self.schedule != "constant":
                raise ValueError(f"--diloco compares at a constant --lr: --schedule must be constant, "
                                 f"got {self.schedule!r}")
        if self.compression is not None:
            if self.compression != "sparseloco":
                raise ValueError(f"--compression must be sparseloco, got {self.compression!r}")
            if self.diloco is None:
                raise ValueError("--compression sparseloco compresses DiLoCo's exchanges: it needs --diloco H")
            if self.wire_dtype is not None:
                raise ValueError(f"--compression sparseloco encodes the pseudo-gradients itself: drop --wire-dtype "
                                 f"{self.wire_dtype}")

    @property
    def updates(self) -> int:
        """Updates the asynchronous session makes (one per push): ``workers * steps``."""
        return self.workers * self.steps

    def learning_rate(self) -> LearningRate:
        """The asynchronous session's learning rate (:func:`optserve.demo.optimizers.learning_rate`
        over its :attr:`updates`): a number, or a schedule spec the server evaluates."""
        return learning_rate(self.schedule, self.lr, self.updates)


def parse_args(argv: Optional[Sequence[str]]) -> DemoConfig:
    """The :class:`DemoConfig` of ``argv``.

    Raises:
      ValueError: a flag's value is out of range (the message names the flag).
      SystemExit: argparse refused the command line (one line on stderr, status 2) or printed --help.
    """
    parser = OneLineArgumentParser(
        prog="optserve demo",
        description="Embedded server + 2 worker processes training an MLP on the digits data asynchronously.",
    )
    parser.add_argument("--steps", type=int, default=None,
                        help="updates per worker (default 150, with --diloco H 20 rounds of H; 30 with --quick)")
    parser.add_argument("--quick", action="store_true", help="reduced size for tests: 30 steps per worker")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--optimizer", choices=DEMO_OPTIMIZERS, default="adam")
    parser.add_argument("--lr", type=float, default=1e-2, help="the (peak) learning rate (default 0.01)")
    parser.add_argument("--schedule", choices=LR_SCHEDULES, default=None,
                        help="the learning rate over the run: warmup_cosine (the default: 0 -> --lr over 5%% of the "
                             "updates, cosine to --lr/10; the server evaluates it) or constant (--diloco's default)")
    parser.add_argument("--max-staleness", type=int, default=4, help="async staleness bound (versions)")
    parser.add_argument("--staleness-policy", choices=("reject", "scale"), default="reject")
    parser.add_argument("--wire-dtype", choices=("float32", "bfloat16", "float16", "int8"), default=None,
                        help="gradients (and, except int8, parameters) on the wire; int8: blockwise with error feedback")
    parser.add_argument("--overlap", action="store_true", help="workers overlap each push with the next gradient")
    parser.add_argument("--no-shared-memory", action="store_true",
                        help="tensor bytes over gRPC (default: through shared memory, the workers share the host)")
    parser.add_argument("--out", type=Path, default=Path("demo_out"), help="output directory (default ./demo_out)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--diloco", type=int, default=None, metavar="H",
                        help="compare DiLoCo (H inner AdamW steps per round, --lr) with per-step sync data parallel "
                             "adam at equal samples, instead of the async demo")
    parser.add_argument("--compression", choices=("sparseloco",), default=None,
                        help="with --diloco: also run DiLoCo with SparseLoCo's 2-bit top-k exchanges")
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (30 if args.quick else default_steps(args.diloco))
    return DemoConfig(
        steps=steps,
        workers=args.workers,
        shards=args.shards,
        batch_size=args.batch_size,
        optimizer=args.optimizer,
        lr=args.lr,
        schedule=args.schedule or ("constant" if args.diloco is not None else "warmup_cosine"),
        max_staleness=args.max_staleness,
        staleness_policy=args.staleness_policy,
        wire_dtype=None if args.wire_dtype in (None, "float32") else args.wire_dtype,
        overlap=args.overlap,
        shared_memory=not args.no_shared_memory,
        out=args.out,
        progress=not args.no_progress,
        seed=args.seed,
        diloco=args.diloco,
        compression=args.compression,
    )


def default_steps(diloco: Optional[int]) -> int:
    """Steps per worker without ``--steps``: 150, or with ``--diloco H`` 20 outer rounds of H.

    DiLoCo's outer Nesterov momentum (0.9) needs about ten rounds to build up; over fewer rounds
    its shared parameters lag behind per-step sync (the comparison would measure the warm-up).
    """
    return 150 if diloco is None else DILOCO_DEFAULT_ROUNDS * diloco
