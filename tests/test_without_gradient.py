"""A tensor without a gradient is left alone, as torch optimizers leave a parameter whose ``.grad``
is None: its value and the optimizer state kept for it do not move (a sync step: when no push of
the step had a gradient for it)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from _service_helpers import make_grads, make_params
from optserve.client import Client, InvalidArgumentError
from optserve.client.torch import RemoteOptimizer
from optserve.server.domain.durability import StepRecord

SHAPES = {"embed": (16, 12), "hidden/w": (12, 10), "hidden/b": (10,)}


def _model() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.ModuleDict({"used": torch.nn.Linear(6, 3), "unused": torch.nn.Linear(6, 3)})


def _train(model, optimizer, steps=15):
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)
    for _ in range(steps):
        optimizer.zero_grad()
        ((model["used"](x) - y) ** 2).mean().backward()  # "unused" gets no .grad
        optimizer.step()


def test_a_parameter_whose_grad_is_none_stays_put_under_adamw_weight_decay_as_in_torch(server, unique_name):
    local, remote = _model(), _model()
    before = {n: p.detach().clone() for n, p in remote.named_parameters()}
    _train(local, torch.optim.AdamW(local.parameters(), lr=0.01, weight_decay=0.1))
    optimizer = RemoteOptimizer(remote.named_parameters(), server.address,
                                {"name": "adamw", "args": {"learning_rate": 0.01, "weight_decay": 0.1}},
                                session=unique_name)
    try:
        _train(remote, optimizer)
        with torch.no_grad():
            for name, p in remote.named_parameters():
                if name.startswith("unused"):
                    assert torch.equal(p, before[name]), name  # not decayed, not moved
            for (name, a), b in zip(remote.named_parameters(), local.parameters()):
                assert float((a - b).abs().max()) <= 1e-5, name
    finally:
        optimizer.session.close()
        optimizer.close()


def test_in_a_sync_step_a_tensor_moves_when_any_worker_had_its_gradient(server, unique_name):
    params = make_params(seed=2, shapes=SHAPES)
    with Client(server.address, timeout=120) as client:
        session = client.create_session(unique_name, params, optimizer={"name": "adam", "args": {"learning_rate": 0.1}},
                                        num_workers=2)
        try:
            others = {"a": ["embed", "hidden/b"], "b": ["embed"]}  # embed: no worker has it; hidden/b: one has it

            def worker(name):
                with Client(server.address, timeout=120) as own:
                    attached = own.session(unique_name)
                    grads = make_grads(params, 0 if name == "a" else 1)
                    for tensor in others[name]:
                        grads[tensor] = np.zeros_like(grads[tensor])
                    attached.push(grads, without_gradient=others[name])

            threads = [threading.Thread(target=worker, args=(n,)) for n in others]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            after = session.pull()
            assert np.array_equal(after["embed"], params["embed"])
            assert not np.allclose(after["hidden/b"], params["hidden/b"])
            assert not np.allclose(after["hidden/w"], params["hidden/w"])
        finally:
            session.close()


def test_naming_a_tensor_the_session_lacks_is_refused_and_nothing_moves(server, unique_name):
    params = make_params(seed=2, shapes=SHAPES)
    with Client(server.address, timeout=120) as client:
        session = client.create_session(unique_name, params, optimizer={"name": "adam", "args": {"learning_rate": 0.1}})
        try:
            with pytest.raises(InvalidArgumentError, match="'nope'"):
                session.push(make_grads(params, 0), without_gradient=["nope"])
            after = session.pull()
            assert all(np.array_equal(after[k], params[k]) for k in params) and session.status().version == 0
        finally:
            session.close()


def test_a_step_record_keeps_its_tensors_without_gradient_for_replay():
    record = StepRecord(3, ((2, "c", 1),), 1.0, 0.0, {"default": {"learning_rate": 0.1}}, ("b", "a/w"))
    assert StepRecord.from_json(record.to_json()).absent == ("b", "a/w")
    assert StepRecord.from_json({"version": 1, "tickets": [], "scale": 1.0, "global_stat": 0.0}).absent == ()
