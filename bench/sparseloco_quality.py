"""SparseLoCo's quality against dense DiLoCo at the same inner steps and H: a two-layer GPT-2, the demo's MLP.

    .venv/bin/python -m bench.sparseloco_quality                 # GPT-2, 4 workers, seeds 0 1 2
    .venv/bin/python -m bench.sparseloco_quality --small         # a smoke run: seed 0, two rounds
    .venv/bin/python -m bench.sparseloco_quality --task digits   # the demo's digits MLP, H 20

``--task gpt2``: ``transformers.GPT2LMHeadModel`` built from a ``GPT2Config`` (``--layers`` 2,
``--embd`` 128, 4 heads, ``--vocab`` 256, context ``--seq`` 64; nothing downloaded). The tokens
are synthetic with structure to learn: a first-order Markov chain whose every token has
``--successors`` possible next tokens (Dirichlet(1) weights, drawn from the seed), so the best
achievable loss is the chain's entropy rate, printed beside the results. ``--task digits``:
``optserve demo --diloco 20``'s MLP, data, learning rate, batch and steps (its floor is 0).

For each seed, the same ``--workers`` workers (threads, one torch DiLoCo client each, on one
embedded server) train twice from the same initial weights on the same minibatches (each
worker's own seeded stream of ``--batch`` sequences or examples):

- dense DiLoCo: inner AdamW (lr ``--lr``), outer Nesterov SGD (lr 0.7, momentum 0.9), float32;
- SparseLoCo: the same inner steps, ``compression={"name": "sparseloco"}`` at its defaults (the
  top ``--topk`` 64 of each ``--chunk`` 64 x 64 tile of an error-fed buffer, 2-bit values, each
  entry averaged over the workers that sent it) and SparseLoCo's outer step, SGD at learning rate 1.

The final train loss is the shared parameters' mean next-token loss on ``--eval`` fresh
sequences of the chain (GPT-2), or the mean loss over the whole training set (digits). Bytes are
what the workers' exchanges record, over the wire (no shared memory): payload up; down, the
compact answer or the dense parameters. It prints one row per run and seed, the ratio of final
losses per seed and of the losses above the floor (the part an optimizer can still remove), and
the bits per parameter per exchange each way.
"""

from __future__ import annotations

import argparse
import os
import statistics
import uuid

import numpy as np

from bench._timing import print_table
from bench.diloco import _all_workers

SPARSELOCO_OUTER = {"name": "sgd", "args": {"learning_rate": 1.0}}
NESTEROV_OUTER = {"name": "sgd", "args": {"learning_rate": 0.7, "momentum": 0.9, "nesterov": True}}
OUTERS = {"sgd1": SPARSELOCO_OUTER, "nesterov": NESTEROV_OUTER}
OUTER_NAMES = {"sgd1": "SGD lr 1", "nesterov": "Nesterov SGD lr 0.7 momentum 0.9"}


class MarkovTokens:
    """A first-order Markov chain over ``vocab`` tokens, each with ``successors`` possible next
    tokens; ``sample(rng, batch, length)`` -> int64 [batch, length]."""

    def __init__(self, vocab: int, successors: int, seed: int):
        rng = np.random.default_rng(10_000 + seed)
        self.vocab = vocab
        self.next_tokens = np.stack([rng.choice(vocab, successors, replace=False) for _ in range(vocab)])
        self.weights = rng.dirichlet(np.ones(successors), size=vocab)
        self.cumulative = np.cumsum(self.weights, axis=1)

    def entropy_rate(self) -> float:
        """Nats per token of the chain at its stationary distribution (the loss floor)."""
        transition = np.zeros((self.vocab, self.vocab))
        for token in range(self.vocab):
            transition[token, self.next_tokens[token]] += self.weights[token]
        values, vectors = np.linalg.eig(transition.T)
        stationary = np.abs(np.real(vectors[:, np.argmin(np.abs(values - 1))]))
        stationary /= stationary.sum()
        per_token = -np.sum(self.weights * np.log(self.weights), axis=1)
        return float(stationary @ per_token)

    def sample(self, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
        out = np.empty((batch, length), np.int64)
        out[:, 0] = rng.integers(0, self.vocab, batch)
        for t in range(1, length):
            pick = (rng.random(batch)[:, None] > self.cumulative[out[:, t - 1]]).sum(axis=1)
            out[:, t] = self.next_tokens[out[:, t - 1], np.minimum(pick, self.next_tokens.shape[1] - 1)]
        return out


def make_model(args, seed: int):
    """The two-layer GPT-2 from a config, its weights from ``seed`` (no dropout: the runs compare
    optimizers, not noise)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.embd, n_layer=args.layers,
                        n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


class GPT2Task:
    """The two-layer GPT-2 on one seed's Markov tokens."""

    def __init__(self, args, seed: int):
        self.args, self.seed = args, seed
        self.chain = MarkovTokens(args.vocab, args.successors, seed)
        self.floor = self.chain.entropy_rate()

    def model(self):
        return make_model(self.args, self.seed)

    def loss(self, model, rng: np.random.Generator):
        """One minibatch's loss (a fresh draw of ``--batch`` sequences from ``rng``)."""
        import torch

        tokens = torch.from_numpy(self.chain.sample(rng, self.args.batch, self.args.seq))
        return model(tokens, labels=tokens).loss

    def final_loss(self, model) -> float:
        """The mean next-token loss on ``--eval`` fresh sequences of the chain."""
        import torch

        tokens = torch.from_numpy(self.chain.sample(np.random.default_rng(99_999), self.args.eval, self.args.seq))
        with torch.no_grad():
            return float(model(tokens, labels=tokens).loss)


class DigitsTask:
    """The demo's digits MLP (``optserve demo --diloco``'s model, data and minibatches of
    ``--batch``); its loss floor is 0."""

    floor = 0.0

    def __init__(self, args, seed: int):
        from optserve.demo.digits import load_digits_split

        self.args, self.seed = args, seed
        self.data = load_digits_split()

    def model(self):
        from optserve.demo.digits import make_model as make_mlp

        return make_mlp(self.seed)

    def loss(self, model, rng: np.random.Generator):
        import torch

        batch = rng.integers(0, len(self.data.x_train), self.args.batch)
        return torch.nn.functional.cross_entropy(model(torch.from_numpy(self.data.x_train[batch])),
                                                 torch.from_numpy(self.data.y_train[batch]))

    def final_loss(self, model) -> float:
        """The mean loss over the whole training set."""
        from optserve.demo.digits import evaluate

        return evaluate(model, self.data.x_train, self.data.y_train)[0]


TASKS = {"gpt2": GPT2Task, "digits": DigitsTask}
# per task: inner steps, H, AdamW lr, batch (the digits' are optserve demo --diloco 20's)
TASK_DEFAULTS = {"gpt2": (600, 30, 1e-3, 8), "digits": (400, 20, 1e-2, 32)}


def train_run(args, address: str, task, sparse: bool):
    """Every worker's ``--steps`` inner steps in one session (a thread each; the first failure is
    raised); returns (the session's final parameters, each worker's exchanges)."""
    import torch

    from optserve.client.torch import DiLoCo

    seed = task.seed
    session = f"quality-{'sparse' if sparse else 'dense'}-{seed}-{uuid.uuid4().hex[:6]}"
    exchanges: list = [None] * args.workers

    def work(rank: int) -> None:
        model = task.model()
        inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
        diloco = DiLoCo(model, inner, address, session=session, sync_every=args.H, num_workers=args.workers,
                        worker_id=f"w{rank}", outer=sparse_outer(args) if sparse else OUTERS[args.dense_outer],
                        compression=dict(args.compression) if sparse else None,
                        shared_memory=False)  # the bytes cross the wire, where they are counted
        rng = np.random.default_rng(seed * 100 + rank)  # the same minibatches in both runs
        for _ in range(args.steps):
            loss = task.loss(model, rng)
            inner.zero_grad()
            loss.backward()
            diloco.step()
        diloco.close()
        exchanges[rank] = list(diloco.exchanges)

    _all_workers([lambda rank=rank: work(rank) for rank in range(args.workers)])
    from optserve.client import Client

    with Client(address) as client:
        handle = client.session(session)
        final = handle.pull(wire_dtype=None)
        handle.close()
    return final, exchanges


def sparse_outer(args) -> dict:
    """SparseLoCo's outer optimizer: ``--sparse-outer``, its learning rate and momentum replaced
    where ``--sparse-outer-lr`` / ``--sparse-outer-momentum`` are given (momentum > 0: Nesterov)."""
    outer = {"name": OUTERS[args.sparse_outer]["name"], "args": dict(OUTERS[args.sparse_outer]["args"])}
    if args.sparse_outer_lr is not None:
        outer["args"]["learning_rate"] = args.sparse_outer_lr
    if args.sparse_outer_momentum is not None:
        outer["args"].update(momentum=args.sparse_outer_momentum, nesterov=args.sparse_outer_momentum > 0)
    return outer


def final_loss(task, values) -> float:
    """``task``'s final loss of the parameters ``values``."""
    import torch

    model = task.model()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.from_numpy(np.asarray(values[name], np.float32)))
    return task.final_loss(model)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sparseloco_quality")
    parser.add_argument("--task", choices=sorted(TASKS), default="gpt2")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--small", action="store_true", help="a smoke run: seed 0, two rounds")
    parser.add_argument("--steps", type=int, help="inner steps per worker, whole rounds of H (gpt2 600, digits 400)")
    parser.add_argument("--H", type=int, help="inner steps per round (gpt2 30, digits 20)")
    parser.add_argument("--lr", type=float, help="the inner AdamW's learning rate (gpt2 1e-3, digits 1e-2)")
    parser.add_argument("--batch", type=int, help="sequences (gpt2, 8) or examples (digits, 32) per step")
    parser.add_argument("--topk", type=int, default=64, help="SparseLoCo's entries kept per chunk")
    parser.add_argument("--chunk", type=int, default=64, help="SparseLoCo's tile side / piece length")
    parser.add_argument("--bits", type=int, default=2, help="SparseLoCo's bits per value (32: float32)")
    parser.add_argument("--sparse-outer", choices=sorted(OUTERS), default="sgd1",
                        help="SparseLoCo's outer optimizer: SGD lr 1 (its paper's) or DiLoCo's Nesterov")
    parser.add_argument("--sparse-outer-lr", type=float, help="SparseLoCo's outer learning rate instead")
    parser.add_argument("--sparse-outer-momentum", type=float, help="SparseLoCo's outer momentum instead (Nesterov)")
    parser.add_argument("--dense-outer", choices=sorted(OUTERS), default="nesterov",
                        help="dense DiLoCo's outer optimizer: Nesterov lr 0.7 momentum 0.9 (its paper's) or SGD lr 1")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--successors", type=int, default=4)
    parser.add_argument("--eval", type=int, default=256, help="sequences the final loss is measured on")
    args = parser.parse_args(argv)
    for name, default in zip(("steps", "H", "lr", "batch"), TASK_DEFAULTS[args.task]):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.small:
        args.seeds, args.steps = args.seeds[:1], 2 * args.H
    if args.steps % args.H:
        parser.error(f"--steps {args.steps} is not a whole number of rounds of --H {args.H}")
    args.compression = {"name": "sparseloco", "topk": args.topk, "chunk": args.chunk, "bits": args.bits}
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import torch

    torch.set_num_threads(1)
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig

    server = start_server(ServerConfig(host="127.0.0.1", port=0, shards=2, ray_address="local", min_shard_bytes=0))
    rows, ratios, excess, floors = [], [], [], []
    try:
        for seed in args.seeds:
            task = TASKS[args.task](args, seed)
            parameters = sum(p.numel() for p in task.model().parameters())
            floors.append(task.floor)
            losses = {}
            for sparse in (False, True):
                final, exchanges = train_run(args, server.address, task, sparse)
                losses[sparse] = final_loss(task, final)
                count = max(len(e) for e in exchanges)
                up = statistics.mean(sum(x.bytes_up for x in e) for e in exchanges)
                down = statistics.mean(sum(x.bytes_down for x in e) for e in exchanges)
                rows.append([seed, "SparseLoCo" if sparse else "DiLoCo", count, f"{losses[sparse]:.4f}",
                             f"{8 * up / count / parameters:.3f}", f"{8 * down / count / parameters:.3f}",
                             f"{up:,.0f}"])
            ratios.append(losses[True] / losses[False])
            excess.append((losses[True] - task.floor) / (losses[False] - task.floor))
            rows[-1] += [f"{ratios[-1]:.4f}", f"{excess[-1]:.3f}"]
            rows[-2] += ["", ""]
    finally:
        server.stop()
    overridden = args.sparse_outer_lr is not None or args.sparse_outer_momentum is not None
    sparse_name = f"SGD {sparse_outer(args)['args']}" if overridden else OUTER_NAMES[args.sparse_outer]
    what = (f"two-layer GPT-2 ({parameters / 1e6:.2f}M parameters, embd {args.embd}, vocab {args.vocab}, context "
            f"{args.seq}) on Markov tokens, {args.successors} successors each (loss floor "
            f"{statistics.mean(floors):.4f} nats, mean over seeds)" if args.task == "gpt2" else
            f"the demo's digits MLP ({parameters:,} parameters; loss on the whole training set)")
    print_table(f"{what}; {args.workers} workers x {args.steps} inner steps (AdamW lr {args.lr}, batch {args.batch}), "
                f"H={args.H}; SparseLoCo top {args.topk} of each {args.chunk}-chunk, {args.bits} bits; outer: "
                f"SparseLoCo {sparse_name}, DiLoCo {OUTER_NAMES[args.dense_outer]}",
                ["seed", "run", "exchanges", "final train loss", "bits/param up per exchange",
                 "bits/param down per exchange", "bytes up / worker", "SparseLoCo / DiLoCo loss",
                 "ratio of losses above the floor"], rows)
    print(f"SparseLoCo / DiLoCo final train loss: {', '.join(f'{r:.4f}' for r in ratios)} "
          f"(worst {max(ratios):.4f}; within 5%: {max(ratios) <= 1.05}); of the loss above the floor: "
          f"{', '.join(f'{r:.3f}' for r in excess)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
