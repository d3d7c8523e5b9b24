"""RemoteOptimizer behaves like a torch optimizer: parameter groups with their own options, and
every ``torch.optim.lr_scheduler`` attached unchanged; the result equals ``torch.optim.AdamW`` with
the same scheduler and groups."""

from __future__ import annotations

import math

import pytest
import torch

from optserve.client import InvalidArgumentError
from optserve.client.status import HyperparamChange
from optserve.client.torch import RemoteOptimizer

STEPS = 50
WARMUP = 5


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2))


def _groups(model, pairs: bool):
    decay = [(n, p) for n, p in model.named_parameters() if n.endswith("weight") and p.ndim == 2]
    no_decay = [(n, p) for n, p in model.named_parameters() if not (n.endswith("weight") and p.ndim == 2)]
    pick = (lambda items: items) if pairs else (lambda items: [p for _, p in items])
    return [{"params": pick(decay), "weight_decay": 0.1}, {"params": pick(no_decay), "weight_decay": 0.0}]


def _warmup_cosine(step: int) -> float:
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))


def _train(model, optimizer, scheduler) -> list[float]:
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(32, 6, generator=g), torch.randn(32, 2, generator=g)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses


def test_adamw_with_lambda_lr_warmup_cosine_and_two_groups_equals_torch_adamw(server, unique_name):
    local, remote = _model(), _model()
    local_opt = torch.optim.AdamW(_groups(local, pairs=False), lr=3e-3, betas=(0.9, 0.999), eps=1e-8)
    optimizer = RemoteOptimizer(_groups(remote, pairs=True), server.address,
                                {"name": "adamw", "args": {"learning_rate": 3e-3, "eps": 1e-8}}, session=unique_name)
    try:
        assert [g["lr"] for g in optimizer.param_groups] == [3e-3, 3e-3]
        _train(local, local_opt, torch.optim.lr_scheduler.LambdaLR(local_opt, _warmup_cosine))
        _train(remote, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_cosine))
        with torch.no_grad():
            for (name, a), b in zip(remote.named_parameters(), local.parameters()):
                assert float((a - b).abs().max()) <= 1e-5 * max(float(b.abs().max()), 1.0), name
        changes = [r for r in optimizer.session.history() if isinstance(r, HyperparamChange)]
        assert {c.group for c in changes} == {"0", "1"} and len(changes) == 2 * STEPS - 2  # from step 1 on, each
    finally:
        optimizer.session.close()
        optimizer.close()


@pytest.mark.parametrize("make, overlap", [
    (lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5), False),
    (lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=12, cycle_momentum=False), False),
    (lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=12), False),
    (lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=12), True),
], ids=["StepLR", "OneCycleLR", "CosineAnnealingLR", "CosineAnnealingLR-overlap"])
def test_a_torch_scheduler_attaches_unchanged_and_the_server_follows_its_rate(server, unique_name, make, overlap):
    model = _model()
    optimizer = RemoteOptimizer(model.named_parameters(), server.address,
                                {"name": "adam", "args": {"learning_rate": 0.004}}, session=unique_name,
                                overlap=overlap)
    scheduler = make(optimizer)
    try:
        rates = []
        for _ in range(12):
            rates.append(optimizer.param_groups[0]["lr"])
            sum((p ** 2).sum() for p in model.parameters()).backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        optimizer.synchronize()
        served = {c.version: c.values["learning_rate"] for c in optimizer.session.history()
                  if isinstance(c, HyperparamChange)}
        current = 0.004
        for step, rate in enumerate(rates, start=1):  # the step producing version N ran with the rate before it
            current = served.get(step, current)
            assert current == pytest.approx(rate, rel=1e-6)
    finally:
        optimizer.session.close()
        optimizer.close()


def test_groups_given_without_names_are_refused_saying_to_pass_named_pairs():
    model = _model()
    with pytest.raises(InvalidArgumentError, match=r"\(name, tensor\) pairs"):
        RemoteOptimizer(_groups(model, pairs=False), "127.0.0.1:1", {"name": "adam", "args": {"learning_rate": 0.1}})


def test_state_dict_carries_the_groups_values_and_load_restores_them(server, unique_name):
    model = _model()
    optimizer = RemoteOptimizer(_groups(model, pairs=True), server.address,
                                {"name": "adamw", "args": {"learning_rate": 0.01}}, session=unique_name)
    try:
        optimizer.param_groups[1]["lr"] = 0.002
        saved = optimizer.state_dict()
        assert [g["weight_decay"] for g in saved["param_groups"]] == [0.1, 0.0]
        optimizer.param_groups[1]["lr"] = 0.5
        optimizer.load_state_dict(saved)
        assert optimizer.param_groups[1]["lr"] == 0.002
    finally:
        optimizer.session.close()
        optimizer.close()


def test_a_group_of_frozen_parameters_stays_off_the_server_and_the_others_follow_their_scheduler(server, unique_name):
    model = _model()
    for p in model[0].parameters():
        p.requires_grad_(False)  # a frozen first layer, in a group of its own
    frozen = [(n, p) for n, p in model.named_parameters() if n.startswith("0.")]
    trained = [(n, p) for n, p in model.named_parameters() if not n.startswith("0.")]
    optimizer = RemoteOptimizer([{"params": frozen}, {"params": trained, "weight_decay": 0.0}], server.address,
                                {"name": "adamw", "args": {"learning_rate": 0.01}}, session=unique_name)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    try:
        for _ in range(3):
            sum((p ** 2).sum() for _, p in trained).backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        changes = [(c.version, c.group) for c in optimizer.session.history() if isinstance(c, HyperparamChange)]
        assert changes == [(2, "0"), (3, "0")]  # the trained group is the server's group 0
    finally:
        optimizer.session.close()
        optimizer.close()


def test_a_scheduler_cycling_betas_the_server_fixes_is_refused_at_once_saying_what_to_do(server, unique_name):
    model = _model()  # Lion's b1 / b2 are fixed at creation (Adam's and AdamW's may change: test_torch_one_cycle)
    optimizer = RemoteOptimizer(model.named_parameters(), server.address,
                                {"name": "optax.lion", "args": {"learning_rate": 0.01}}, session=unique_name)
    try:
        assert "betas" not in optimizer.defaults
        with pytest.raises(ValueError, match="cycle_momentum"):  # torch's own check: no betas among the defaults
            torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.01, total_steps=10)
        optimizer.param_groups[0]["betas"] = (0.8, 0.99)
        sum((p ** 2).sum() for p in model.parameters()).backward()
        with pytest.raises(InvalidArgumentError, match="'betas' changed"):
            optimizer.step()
    finally:
        optimizer.session.close()
        optimizer.close()
