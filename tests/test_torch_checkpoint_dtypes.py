"""RemoteOptimizer's checkpoints with bfloat16 state (Adam's first moment kept in bfloat16, a
bfloat16 model): state_dict holds those leaves as bfloat16 tensors, and a fresh optimizer loaded
from it continues as the saved one does."""

from __future__ import annotations

import torch

from optserve.client.torch import RemoteOptimizer

SPEC = {"name": "adam", "args": {"learning_rate": 0.01, "mu_dtype": "bfloat16"}}


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3).to(torch.bfloat16)


def _step(model, optimizer) -> None:
    x = torch.ones(2, 4, dtype=torch.bfloat16)
    optimizer.zero_grad()
    model(x).float().square().mean().backward()
    optimizer.step()


def test_a_bfloat16_models_state_dict_round_trips(server, unique_name):
    model = _model(0)
    optimizer = RemoteOptimizer(model.named_parameters(), server.address, SPEC, session=f"{unique_name}-a")
    _step(model, optimizer)
    saved = optimizer.state_dict()
    dtypes = {value.dtype for entry in saved["state"].values() for value in entry.values()}
    dtypes |= {value.dtype for value in saved["optserve"]["params"].values()}
    assert saved["state"][0]["0.mu"].dtype == torch.bfloat16, dtypes
    other = _model(1)
    resumed = RemoteOptimizer(other.named_parameters(), server.address, SPEC, session=f"{unique_name}-b")
    resumed.load_state_dict(saved)
    for (name, p), (_, q) in zip(model.named_parameters(), other.named_parameters()):
        assert torch.equal(p, q), name
    _step(model, optimizer)
    _step(other, resumed)
    for (name, p), (_, q) in zip(model.named_parameters(), other.named_parameters()):
        assert torch.equal(p, q), name
    for opt in (optimizer, resumed):
        opt.session.close()
        opt.close()
