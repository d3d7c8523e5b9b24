"""RemoteOptimizer(zero_copy=True, the default) on a same-host server: the model's parameters and
gradients are the session's shared regions, training stays exact, torch's gradient semantics
hold, and the client's memory does not hold a second copy of the model."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from optserve.client.torch import RemoteOptimizer
from test_client_torch import _data, _in_process_kernel_losses, _loss, _model, _train

ADAM = {"name": "adam", "args": {"learning_rate": 1e-2}}
ADAMW = {"name": "adamw", "args": {"learning_rate": 1e-2, "weight_decay": 0.1}}


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def _assert_in_regions(model, optimizer) -> None:
    params, grads = optimizer.session.parameter_buffers(), optimizer.session.gradient_buffers()
    for name, p in model.named_parameters():
        assert p.data_ptr() == _address(params[name]), f"{name}: the parameter is not the region's reply array"
        assert p.grad is None or p.grad.data_ptr() == _address(grads[name]), f"{name}: .grad is not the push array"


def test_parameters_and_gradients_are_the_shared_regions_and_training_stays_exact(server, unique_name):
    model = _model()
    optimizer = RemoteOptimizer(model.named_parameters(), server.address, ADAM, session=unique_name)
    assert set(optimizer.session.data_paths().values()) == {"shared_memory"}
    assert sorted(optimizer.shared_tensors) == sorted(optimizer.tensor_names)
    _assert_in_regions(model, optimizer)
    storage = {n: p.data_ptr() for n, p in model.named_parameters()}
    x, y = _data()
    losses = []
    for _ in range(12):
        optimizer.zero_grad()
        loss = _loss(model, x, y)
        loss.backward()
        _assert_in_regions(model, optimizer)  # backward accumulated into the push arrays
        optimizer.step()
        losses.append(loss.item())
        # the shard wrote the new values where the model reads them: nothing was copied or moved
        assert {n: p.data_ptr() for n, p in model.named_parameters()} == storage
    reference = _in_process_kernel_losses(_model(), ADAM, steps=12)
    assert reference[-1] < 0.9 * reference[0]
    np.testing.assert_allclose(losses, reference, rtol=1e-5, atol=0)
    pulled = optimizer.session.pull()
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(p.detach().numpy(), pulled[name])
    optimizer.session.close()
    optimizer.close()


def _train_with_unreached_layer(zero_copy: bool, address: str, session: str, model_reset: bool) -> dict:
    """AdamW on two layers, the second reached by backward only every third step."""
    torch.manual_seed(3)
    first, second = torch.nn.Linear(6, 4), torch.nn.Linear(4, 3)
    model = torch.nn.ModuleDict({"first": first, "second": second})
    optimizer = RemoteOptimizer(model.named_parameters(), address, ADAMW, session=session, zero_copy=zero_copy)
    x, y = _data()
    for step in range(9):
        if model_reset:
            model.zero_grad()  # .grad = None: a fresh gradient next backward
        else:
            optimizer.zero_grad()
        out = first(x)
        loss = ((second(out) - y) ** 2).mean() if step % 3 == 0 else (out ** 2).mean()
        loss.backward()
        optimizer.step()
    values = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    shared = list(optimizer.shared_tensors)
    optimizer.session.close()
    optimizer.close()
    return {"values": values, "shared": shared}


@pytest.mark.parametrize("model_reset", [False, True], ids=["optimizer.zero_grad", "model.zero_grad"])
def test_a_parameter_no_backward_reached_is_left_alone_as_torch_leaves_it(server, unique_name, model_reset):
    bound = _train_with_unreached_layer(True, server.address, unique_name, model_reset)
    copied = _train_with_unreached_layer(False, server.address, unique_name + "-copied", model_reset)
    assert len(bound["shared"]) == 4 and copied["shared"] == []
    for name, value in copied["values"].items():
        np.testing.assert_array_equal(bound["values"][name], value, err_msg=name)


def test_overlap_and_zero_copy_false_keep_the_model_storage(server, unique_name):
    for kwargs in ({"overlap": True}, {"zero_copy": False}):
        model = _model()
        storage = {n: p.data_ptr() for n, p in model.named_parameters()}
        optimizer = RemoteOptimizer(model.named_parameters(), server.address, ADAM, session=f"{unique_name}-{len(kwargs)}"
                                    + next(iter(kwargs)), **kwargs)
        _train(model, optimizer, steps=3)
        optimizer.synchronize()
        assert optimizer.shared_tensors == []
        assert {n: p.data_ptr() for n, p in model.named_parameters()} == storage
        optimizer.session.close()
        optimizer.close()


_PEAK = textwrap.dedent("""
    import json, sys
    import torch
    from optserve.client.torch import RemoteOptimizer

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    address, session, zero_copy = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False) for _ in range(2)])
    x = torch.randn(4, 4096)
    model(x).sum().backward()  # the gradients exist before the baseline, as in any training loop
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    baseline = status("VmRSS")
    optimizer = RemoteOptimizer(model.named_parameters(), address, {"name": "adafactor", "args": {"learning_rate": 1e-3}},
                                session=session, zero_copy=zero_copy)
    for _ in range(3):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    print(json.dumps({"growth": (status("VmHWM") - baseline) / param_bytes, "shared": len(optimizer.shared_tensors)}))
    optimizer.session.close()
    optimizer.close()
""")


def _peak_growth(address: str, session: str, zero_copy: bool) -> dict:
    done = subprocess.run([sys.executable, "-c", _PEAK, address, session, "1" if zero_copy else "0"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_client_peak_memory_holds_no_second_copy_of_the_model(server, unique_name):
    """Create and three steps of a 128 MiB model (two 64 MiB tensors: above glibc's mmap
    threshold, so freed storage goes back to the OS at once): the parameters and gradients move
    into the regions and their old storage is freed, so the client's peak resident memory grows
    by about one copy at the moment of the move; copying them every step (zero_copy=False) holds
    two more."""
    bound = _peak_growth(server.address, unique_name, True)
    copied = _peak_growth(server.address, unique_name + "-copied", False)
    assert bound["shared"] == 2 and copied["shared"] == 0
    assert bound["growth"] < 1.6, bound
    assert copied["growth"] > bound["growth"] + 0.8, (bound, copied)  # the bound can tell the two apart


@pytest.mark.slow
def test_a_model_in_the_regions_follows_a_restarted_shard_exactly(ray_local, tmp_path):
    """A shard SIGKILLed mid-training (durable sessions): its regions are gone, the next step
    negotiates fresh ones, and the model's parameters and gradients move there; every step equals
    the same model trained with copies, bit for bit."""
    import os
    import signal

    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig
    from optserve.server.domain.durability import DurabilityConfig

    running = start_server(ServerConfig(host="127.0.0.1", port=0, shards=2, vote_timeout_s=8.0, min_shard_bytes=0,
                                        durability=DurabilityConfig(str(tmp_path), every_steps=4)))
    try:
        bound_model, copied_model = _model(), _model()
        bound = RemoteOptimizer(bound_model.named_parameters(), running.address, ADAM, session="bound")
        copied = RemoteOptimizer(copied_model.named_parameters(), running.address, ADAM, session="copied",
                                 zero_copy=False)
        before = {n: p.data_ptr() for n, p in bound_model.named_parameters()}
        x, y = _data()
        for step in range(8):
            if step == 4:
                os.kill(running.fleet.pids()[0], signal.SIGKILL)
            for model, optimizer in ((bound_model, bound), (copied_model, copied)):
                optimizer.zero_grad()
                _loss(model, x, y).backward()
                optimizer.step()
            for (name, a), b in zip(bound_model.named_parameters(), copied_model.parameters()):
                assert torch.equal(a, b), (step, name)
        assert bound.version == copied.version == 8
        _assert_in_regions(bound_model, bound)
        moved = {n for n, p in bound_model.named_parameters() if p.data_ptr() != before[n]}
        on_killed = set(next(shard.names for shard in bound.session._shards if shard.index == 0))
        assert on_killed <= moved, (moved, on_killed)  # into the fresh regions of the new shard process
        bound.close()
        copied.close()
    finally:
        running.stop()


def test_an_evaluation_pull_leaves_the_training_parameters_in_the_regions_alone(server, unique_name):
    """Schedule-free optimizers evaluate other parameters than they train: pulling those (as bytes)
    must not write them where the model's training parameters live."""
    spec = {"name": "optax.contrib.schedule_free_adamw", "args": {"learning_rate": 0.05, "warmup_steps": 4, "b1": 0.8}}
    model = _model()
    optimizer = RemoteOptimizer(model.named_parameters(), server.address, spec, session=unique_name)
    _train(model, optimizer, steps=3)
    training = {n: p.detach().clone() for n, p in model.named_parameters()}
    evaluation = optimizer.session.pull(evaluation=True)
    assert any(not np.array_equal(evaluation[n], t.numpy()) for n, t in training.items())  # they differ
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), training[name]), name
    _assert_in_regions(model, optimizer)
    optimizer.session.close()
    optimizer.close()


def test_a_step_that_ends_without_its_answer_moves_the_model_out_of_the_regions(server, unique_name):
    """An unanswered step may still be applied from the regions later: the model takes storage of
    its own at once (its values kept), and the next step binds it to fresh regions."""
    model = _model()
    optimizer = RemoteOptimizer(model.named_parameters(), server.address, ADAM, session=unique_name)
    _train(model, optimizer, steps=2)
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = _data()
    optimizer.zero_grad()
    _loss(model, x, y).backward()
    optimizer.session.close()  # the next step finds no session: NotFound, unanswered by the step itself
    with pytest.raises(Exception):
        optimizer.step()
    assert optimizer.shared_tensors == []
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), values[name]), name
    optimizer.close()
