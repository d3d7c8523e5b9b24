"""The schedulers people train with drive RemoteOptimizer as they drive torch.optim: a warmup from a
learning rate of 0 (Hugging Face's ``get_cosine_schedule_with_warmup``) and ``OneCycleLR`` with its
default ``cycle_momentum=True`` (``betas`` cycled for Adam / AdamW, ``momentum`` for SGD), each
equal to the torch optimizer in process, on a real server."""

from __future__ import annotations

import pytest
import torch

from optserve.client.status import HyperparamChange
from optserve.client.torch import RemoteOptimizer


def _model() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _train(model, optimizer, scheduler, steps: int) -> list[dict]:
    """``steps`` steps of a regression; the groups' values each step ran with."""
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(32, 6, generator=g), torch.randn(32, 2, generator=g)
    seen = []
    for _ in range(steps):
        optimizer.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        seen.append({k: v for k, v in optimizer.param_groups[0].items() if k in ("lr", "betas", "momentum")})
        optimizer.step()
        scheduler.step()
    return seen


def _assert_same_parameters(remote, local, tolerance=1e-5):
    with torch.no_grad():
        for (name, a), b in zip(remote.named_parameters(), local.parameters()):
            assert float((a - b).abs().max()) <= tolerance * max(float(b.abs().max()), 1.0), name


def _closed(optimizer):
    optimizer.session.close()
    optimizer.close()


def test_adamw_with_a_huggingface_warmup_from_lr_zero_equals_torch_adamw(server, unique_name):
    from transformers import get_cosine_schedule_with_warmup

    local, remote = _model(), _model()
    local_opt = torch.optim.AdamW(local.parameters(), lr=3e-3, weight_decay=0.01)
    optimizer = RemoteOptimizer(remote.named_parameters(), server.address,
                                {"name": "adamw", "args": {"learning_rate": 3e-3, "weight_decay": 0.01}},
                                session=unique_name)
    try:
        seen = _train(remote, optimizer, get_cosine_schedule_with_warmup(optimizer, 10, 60), 12)
        _train(local, local_opt, get_cosine_schedule_with_warmup(local_opt, 10, 60), 12)
        assert seen[0]["lr"] == 0.0  # the first step ran at a learning rate of 0
        _assert_same_parameters(remote, local)
    finally:
        _closed(optimizer)


def test_one_cycle_lr_cycling_betas_drives_adamw_as_it_drives_torch_adamw(server, unique_name):
    local, remote = _model(), _model()
    local_opt = torch.optim.AdamW(local.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.05)
    optimizer = RemoteOptimizer(remote.named_parameters(), server.address, {
        "name": "adamw", "args": {"learning_rate": 1e-3, "b2": 0.99, "weight_decay": 0.05}}, session=unique_name)
    try:
        assert optimizer.param_groups[0]["betas"] == (0.9, 0.99)
        seen = _train(remote, optimizer, torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.01, total_steps=20),
                      20)
        _train(local, local_opt, torch.optim.lr_scheduler.OneCycleLR(local_opt, max_lr=0.01, total_steps=20), 20)
        assert len({s["betas"][0] for s in seen}) > 10 and {s["betas"][1] for s in seen} == {0.99}
        _assert_same_parameters(remote, local)
        served = [c.values for c in optimizer.session.history() if isinstance(c, HyperparamChange)]
        assert served[0]["b1"] == pytest.approx(0.95)  # OneCycleLR starts at its max_momentum
        assert not [key for values in served for key in values if key.startswith("1-")]  # the kernel's own
    finally:
        _closed(optimizer)


def test_one_cycle_lr_cycling_momentum_drives_sgd_as_it_drives_torch_sgd(server, unique_name):
    local, remote = _model(), _model()
    local_opt = torch.optim.SGD(local.parameters(), lr=0.01, momentum=0.9)
    optimizer = RemoteOptimizer(remote.named_parameters(), server.address,
                                {"name": "sgd", "args": {"learning_rate": 0.01, "momentum": 0.9}}, session=unique_name)
    try:
        assert optimizer.param_groups[0]["momentum"] == 0.9 and "betas" not in optimizer.param_groups[0]
        seen = _train(remote, optimizer, torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=20),
                      20)
        _train(local, local_opt, torch.optim.lr_scheduler.OneCycleLR(local_opt, max_lr=0.05, total_steps=20), 20)
        assert len({s["momentum"] for s in seen}) > 10
        _assert_same_parameters(remote, local)
    finally:
        _closed(optimizer)
