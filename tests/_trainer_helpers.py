"""What the trainer tests share (tests/test_trainers_hf.py, tests/test_trainers_lightning.py): a tiny
GPT-2 built from a config (no download), synthetic token data, the two parameter groups (weight
decay on matrices only), the server spec that mirrors ``torch.optim.AdamW``, a restartable
embedded server, and the comparisons."""

from __future__ import annotations

import os
from typing import Mapping, Optional

import torch

from bench.ray_cluster import free_port

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

VOCAB, SEQ, BATCH = 64, 16, 4
LR, WEIGHT_DECAY = 1e-3, 0.01
BETAS, EPS = (0.9, 0.999), 1e-8  # torch.optim.AdamW's defaults
TOLERANCE = 1e-5  # per-step loss, and final parameters (absolute)


def tiny_gpt2(seed: int) -> torch.nn.Module:
    """A 2-layer GPT-2 (n_embd 32, vocab 64, 16 positions) without dropout, initialised from ``seed``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


class TokenData(torch.utils.data.Dataset):
    """``n`` random sequences of ``SEQ`` tokens (a fixed generator), each its own labels."""

    def __init__(self, n: int, seed: int = 0):
        self.tokens = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def _split(model: torch.nn.Module) -> tuple[list, list]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [(n, p) for n, p in named if p.ndim >= 2], [(n, p) for n, p in named if p.ndim < 2]


def named_groups(model: torch.nn.Module) -> list[dict]:
    """RemoteOptimizer's groups: ``(name, parameter)`` pairs; weight decay on matrices only."""
    decay, rest = _split(model)
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}]


def torch_adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    """The in-process baseline over the same groups."""
    decay, rest = _split(model)
    return torch.optim.AdamW([{"params": [p for _, p in decay], "weight_decay": WEIGHT_DECAY},
                              {"params": [p for _, p in rest], "weight_decay": 0.0}], lr=LR, betas=BETAS, eps=EPS)


def adamw_spec() -> dict:
    """The server optimizer, with torch.optim.AdamW's defaults spelled out (its weight decay is the groups')."""
    return {"name": "adamw", "args": {"learning_rate": LR, "b1": BETAS[0], "b2": BETAS[1], "eps": EPS,
                                      "weight_decay": WEIGHT_DECAY}}


def max_loss_difference(losses: Mapping[int, float], reference: Mapping[int, float], steps) -> float:
    """The largest per-step loss difference over ``steps`` (each must be in both)."""
    missing = [s for s in steps if s not in losses or s not in reference]
    assert not missing, f"steps without a loss: {missing[:5]} (logged {sorted(losses)[:3]}...)"
    return max(abs(losses[s] - reference[s]) for s in steps)


def max_parameter_difference(model: torch.nn.Module, reference: Mapping[str, torch.Tensor]) -> float:
    with torch.no_grad():
        return max(float((p - reference[n]).abs().max()) for n, p in model.named_parameters())


def parameters_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class RestartableServer:
    """An embedded, non-durable server (2 shards, in this process, on the tests' local Ray) on a
    fixed port, which :meth:`restart` stops and starts again there: the restarted one has no
    session of the former one."""

    def __init__(self):
        self.port = free_port()
        self._running = None
        self.starts = 0
        self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        from optserve.server.app import start_server
        from optserve.server.domain.config import ServerConfig

        self._running = start_server(ServerConfig(host="127.0.0.1", port=self.port, shards=2, ray_address="local",
                                                  vote_timeout_s=8.0, min_shard_bytes=0))
        self.starts += 1

    def stop(self) -> None:
        if self._running is not None:
            self._running.stop()
            self._running = None

    def restart(self) -> None:
        self.stop()
        self.start()


def close_quietly(optimizer: Optional[object]) -> None:
    """Closes a RemoteOptimizer's session and connection (either may be gone already)."""
    if optimizer is None:
        return
    from optserve.client.errors import OptservError

    try:
        optimizer.session.close()
    except OptservError:
        pass
    optimizer.close()
