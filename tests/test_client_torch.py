"""RemoteOptimizer: a torch.optim.Optimizer backed by a real server (loopback gRPC, local Ray)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from optserve.client import Client, InvalidArgumentError, PreconditionerOptions
from optserve.client.torch import RemoteOptimizer, RemoteOptimizerConfig, gradient_to_numpy, tensor_to_numpy

STEPS = 20


def _model(seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(dtype)


def _data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)


def _loss(model, x, y) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def _train(model, optimizer, steps: int = STEPS) -> list[float]:
    """``steps`` full-batch steps; the loss before each update."""
    x, y = _data()
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = _loss(model, x, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _in_process_kernel_losses(model, spec, steps: int = STEPS) -> list[float]:
    """The same loop with the optserve kernel applied in this process (JAX, jitted)."""
    import jax
    import jax.numpy as jnp
    import optax

    from optserve.optim_kernels import build_optimizer

    tx = build_optimizer(spec["name"], spec["args"]).transformation
    named = dict(model.named_parameters())
    params = {n: jnp.asarray(p.detach().numpy()) for n, p in named.items()}
    state = tx.init(params)

    @jax.jit
    def update(grads, state, params):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    x, y = _data()
    losses = []
    for _ in range(steps):
        with torch.no_grad():
            for n, p in named.items():
                p.copy_(torch.from_numpy(np.array(params[n])))
        model.zero_grad()
        loss = _loss(model, x, y)
        loss.backward()
        losses.append(loss.item())
        params, state = update({n: jnp.asarray(p.grad.numpy()) for n, p in named.items()}, state, params)
    return losses


ADAFACTOR_HF_SETTINGS = [
    {"lr": 1e-2, "relative_step": False, "scale_parameter": True, "warmup_init": False},
    {"lr": None, "relative_step": True, "scale_parameter": False, "warmup_init": False, "beta1": 0.9, "weight_decay": 0.01},
]


@pytest.mark.parametrize(
    "spec",
    [
        {"name": "adam", "args": {"learning_rate": 1e-2}},
        {"name": "adafactor_hf", "args": ADAFACTOR_HF_SETTINGS[0]},
        {"name": "adafactor_hf", "args": ADAFACTOR_HF_SETTINGS[1]},
    ],
    ids=["adam", "adafactor_hf", "adafactor_hf-relative_step-beta1-wd"],
)
def test_sync_single_worker_follows_in_process_kernel_trajectory(server, unique_name, spec):
    remote_model = _model()
    optimizer = RemoteOptimizer(remote_model.named_parameters(), server.address, spec, session=unique_name)
    remote = _train(remote_model, optimizer)
    reference = _in_process_kernel_losses(_model(), spec)
    assert reference[-1] < 0.9 * reference[0], "the reference must actually train for the comparison to mean anything"
    np.testing.assert_allclose(remote, reference, rtol=1e-5, atol=0)
    assert optimizer.version == STEPS
    optimizer.session.close()
    optimizer.close()


@pytest.mark.parametrize("settings", ADAFACTOR_HF_SETTINGS, ids=["lr1e-2", "relative_step-beta1-wd"])
def test_remote_adafactor_hf_tracks_transformers_adafactor(server, unique_name, settings):
    from transformers.optimization import Adafactor

    remote_model = _model()
    optimizer = RemoteOptimizer(
        remote_model.named_parameters(), server.address, {"name": "adafactor_hf", "args": settings}, session=unique_name
    )
    remote = _train(remote_model, optimizer)
    reference_model = _model()
    reference = _train(reference_model, Adafactor(reference_model.parameters(), **settings))
    assert reference[-1] < 0.9 * reference[0]
    np.testing.assert_allclose(remote, reference, rtol=1e-4, atol=0)
    optimizer.session.close()
    optimizer.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_step_writes_server_values_in_place_keeping_dtype_and_storage(server, unique_name, dtype):
    """With ``zero_copy=False`` (tests/test_torch_zero_copy.py: the storage moves into shared memory)."""
    model = _model(dtype=dtype)
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    optimizer = RemoteOptimizer(model.named_parameters(), server.address, {"name": "sgd", "args": {"learning_rate": 0.1}},
                                session=unique_name, zero_copy=False)
    x, y = _data()
    _loss(model, x.to(dtype), y.to(dtype)).backward()
    grads = {n: p.grad.float().numpy().copy() for n, p in model.named_parameters()}
    optimizer.step()
    server_values = optimizer.session.pull()
    for name, p in model.named_parameters():
        ptr, old = before[name]
        assert p.dtype == dtype and p.data_ptr() == ptr and p.requires_grad
        # The server keeps a float32 master copy and applies float32 SGD to the widened values.
        expected = old.float().numpy() - np.float32(0.1) * grads[name]
        np.testing.assert_allclose(server_values[name], expected, rtol=1e-6, atol=1e-7)
        # The model holds those values rounded to its own dtype.
        assert torch.equal(p.detach(), torch.from_numpy(np.array(server_values[name])).to(dtype))
        assert not torch.equal(p.detach(), old)
    optimizer.session.close()
    optimizer.close()


def test_frozen_parameters_stay_out_of_the_session_and_step_returns_the_closure_loss(server, unique_name):
    model = _model()
    model[0].requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    optimizer = RemoteOptimizer(model.named_parameters(), server.address, {"name": "sgd", "args": {"learning_rate": 0.1}},
                                session=unique_name)
    assert optimizer.tensor_names == ["2.weight", "2.bias"]
    assert sorted(optimizer.session.pull()) == ["2.bias", "2.weight"]
    x, y = _data()
    before = model[2].weight.detach().clone()

    def closure():
        optimizer.zero_grad()
        loss = _loss(model, x, y)
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    assert loss.item() == pytest.approx(_loss(_model(), x, y).item())
    assert torch.equal(model[0].weight, frozen) and not torch.equal(model[2].weight, before)
    optimizer.session.close()
    optimizer.close()


def test_tensor_to_numpy_views_float32_and_widens_bfloat16_exactly():
    t = torch.randn(5, 7)
    assert np.shares_memory(tensor_to_numpy(t), t.numpy())
    b = torch.randn(3, 4, 5).to(torch.bfloat16)
    widened = tensor_to_numpy(b)
    assert widened.dtype == np.float32 and widened.shape == (3, 4, 5)
    np.testing.assert_array_equal(widened, b.float().numpy())
    np.testing.assert_array_equal(tensor_to_numpy(b[:, 1]), b[:, 1].float().numpy())
    # Gradients keep their 16 bits (a view) where ml_dtypes exists; the values are the same.
    g = gradient_to_numpy(b)
    np.testing.assert_array_equal(g.astype(np.float32), b.float().numpy())
    assert np.shares_memory(g, b.view(torch.int16).numpy()) == (g.dtype.name == "bfloat16")


def test_state_dict_holds_the_session_and_load_puts_another_optimizers_session_there(server, unique_name):
    spec = {"name": "adam", "args": {"learning_rate": 1e-2}}
    model = _model()
    optimizer = RemoteOptimizer(model.named_parameters(), server.address, spec, session=unique_name)
    _train(model, optimizer, steps=3)
    state = optimizer.state_dict()
    meta = state["optserve"]
    assert meta["session"] == unique_name and meta["version"] == 3
    assert meta["tensor_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert sorted(state["state"]) == [0, 1, 2, 3] and {"0.mu", "0.nu", "0.count"} <= set(state["state"][0])

    # A fresh process (here: a fresh model and optimizer on another session) resumes from it:
    # its own session takes the checkpoint's state, and the model the checkpoint's parameters.
    other = _model(seed=7)
    resumed = RemoteOptimizer(other.named_parameters(), server.address, spec, session=unique_name + "-b")
    resumed.load_state_dict(state)
    assert resumed.session_name == unique_name + "-b" and resumed.version == 3
    for (n, p), (_, q) in zip(model.named_parameters(), other.named_parameters()):
        assert torch.equal(p, q), n
    # Both continue alike: the moments came along.
    _train(model, optimizer, steps=2)
    _train(other, resumed, steps=2)
    assert resumed.version == optimizer.version == 5
    for (n, p), (_, q) in zip(model.named_parameters(), other.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6, msg=n)
    unrelated = RemoteOptimizer(torch.nn.Linear(2, 2).named_parameters(), server.address,
                                {"name": "sgd", "args": {"learning_rate": 0.1}}, session=unique_name + "-c")
    with pytest.raises(ValueError, match="differ"):
        unrelated.load_state_dict(state)
    unrelated.session.close()
    for opt in (optimizer, resumed):
        opt.session.close()
        opt.close()


def test_second_optimizer_naming_a_session_attaches_and_starts_from_its_parameters(server, unique_name):
    spec = {"name": "sgd", "args": {"learning_rate": 0.1}}
    first_model = _model(seed=0)
    first = RemoteOptimizer(first_model.named_parameters(), server.address, spec, session=unique_name, mode="async", max_staleness=4)
    _train(first_model, first, steps=2)
    second_model = _model(seed=5)
    with pytest.warns(UserWarning, match="already existed at version 2"):  # the model's values are replaced
        second = RemoteOptimizer(second_model.named_parameters(), server.address, spec, session=unique_name,
                                 mode="async", max_staleness=4)
    assert first.created and not second.created
    for (n, p), (_, q) in zip(first_model.named_parameters(), second_model.named_parameters()):
        assert torch.equal(p, q), n
    first.session.close()


def test_bad_configuration_is_refused_before_contacting_a_server():
    with pytest.raises(ValueError, match="mode"):
        RemoteOptimizerConfig(optimizer={"name": "adam", "args": {}}, session="s", mode="bulk")
    with pytest.raises(ValueError, match="wire_dtype"):
        RemoteOptimizerConfig(optimizer={"name": "adam", "args": {}}, session="s", wire_dtype="int4")
    with pytest.raises(ValueError, match="optimizer"):
        RemoteOptimizerConfig(optimizer="adam", session="s")
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="twice"):
        RemoteOptimizer([("w", p), ("w", p)], "127.0.0.1:1", {"name": "adam", "args": {}})


def test_bad_preconditioners_are_refused_naming_the_option_before_contacting_a_server():
    p = torch.nn.Parameter(torch.zeros(2))
    spec = {"name": "shampoo", "args": {}, "preconditioners": {"max_age": -1}}
    with pytest.raises(InvalidArgumentError, match="max_age"):
        RemoteOptimizer([("w", p)], "127.0.0.1:1", spec)
    with pytest.raises(InvalidArgumentError, match="unknown option 'inline'"):
        RemoteOptimizerConfig(optimizer={"name": "shampoo", "preconditioners": {"inline": True}}, session="s")
    with pytest.raises(InvalidArgumentError, match="unknown key 'precondtioners'"):
        RemoteOptimizerConfig(optimizer={"name": "shampoo", "precondtioners": {}}, session="s")


SHAMPOO_ARGS = {"learning_rate": 0.01, "block_size": 8, "start_preconditioning_step": 2}


@pytest.mark.parametrize("preconditioners", [{"in_process": True}, {"max_age": 3}], ids=["in_process", "max_age"])
def test_preconditioners_option_reaches_the_server_through_the_torch_adapter(server, unique_name, preconditioners):
    spec = {"name": "shampoo", "args": SHAMPOO_ARGS, "preconditioners": preconditioners}
    model = _model()
    optimizer = RemoteOptimizer(model.named_parameters(), server.address, spec, session=unique_name)
    losses = _train(model, optimizer, steps=4)
    assert all(np.isfinite(losses)) and optimizer.version == 4
    expected = PreconditionerOptions(**preconditioners)
    assert optimizer.config.options.preconditioners == expected
    # The server's record of the session (GetSession), read by a fresh client, carries the option.
    with Client(server.address) as other:
        attached = other.session(unique_name)
        assert attached.options.preconditioners == expected
        assert attached.options.optimizer == "shampoo" and attached.options.optimizer_args == SHAMPOO_ARGS
        attached.detach()
    assert optimizer.state_dict()["optserve"]["optimizer"]["preconditioners"] == {"in_process": False, "max_age": None,
                                                                     **preconditioners}
    status = optimizer.session.status()
    # The test server has no preconditioner workers: roots are computed in the update, per block.
    assert all(s.root_offload is not None and not s.root_offload.offloaded for s in status.shards)
    assert [b for s in status.shards for b in s.preconditioners]
    optimizer.session.close()
    optimizer.close()


def test_server_error_surfaces_with_its_message(server, unique_name):
    with pytest.raises(Exception, match="no_such_optimizer"):
        RemoteOptimizer(_model().named_parameters(), server.address, {"name": "no_such_optimizer", "args": {}}, session=unique_name)


def test_stale_push_is_dropped_and_the_model_refreshed_to_the_session(server, unique_name):
    spec = {"name": "sgd", "args": {"learning_rate": 0.1}}
    model_a, model_b = _model(), _model()
    a = RemoteOptimizer(model_a.named_parameters(), server.address, spec, session=unique_name,
                        mode="async", max_staleness=0, staleness_policy="reject")
    # b joins with the same configuration (an attach that names another mode is refused)
    b = RemoteOptimizer(model_b.named_parameters(), server.address, spec, session=unique_name,
                        mode="async", max_staleness=0, staleness_policy="reject")
    x, y = _data()
    _loss(model_a, x, y).backward()
    a.step()  # version 1
    _loss(model_b, x, y).backward()
    b.step()  # computed on version 0: one version stale, refused
    assert b.stale_pushes == 1 and b.version == 1 and a.stale_pushes == 0
    for (n, p), (_, q) in zip(model_a.named_parameters(), model_b.named_parameters()):
        assert torch.equal(p, q), n
    b.zero_grad()
    _loss(model_b, x, y).backward()
    b.step()  # fresh again: applies
    assert b.version == 2 and b.stale_pushes == 1
    assert a.session.status().rejected.get("stale") == 1
    a.session.close()


def test_importing_the_torch_adapter_imports_neither_jax_nor_ray():
    code = "import sys, optserve.client.torch; print(sorted(m for m in ('jax', 'ray') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


_WORKER = textwrap.dedent(
    """
    import json, sys
    import torch
    from optserve.client.torch import RemoteOptimizer

    address, session, steps, rank = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    torch.manual_seed(rank)  # different initial weights: the attaching worker must adopt the session's
    model = torch.nn.Linear(8, 1)
    g = torch.Generator().manual_seed(123)
    x = torch.randn(256, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)
    opt = RemoteOptimizer(model.named_parameters(), address, {"name": "sgd", "args": {"learning_rate": 0.05}},
                          session=session, mode="async", max_staleness=16, staleness_policy="scale")
    rng = torch.Generator().manual_seed(1000 + rank)
    print("ready", flush=True)
    sys.stdin.readline()  # both workers start their loops together, so their steps interleave
    for step in range(steps):
        idx = torch.randint(0, 256, (32,), generator=rng)
        loss = ((model(x[idx]) - y[idx]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(json.dumps({"rank": rank, "step": step, "loss": loss.item(), "version": opt.version,
                          "created": opt.created}), flush=True)
    opt.close()
    """
)


def test_two_worker_processes_share_an_async_session_and_the_loss_falls(server, unique_name):
    steps = 40
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, server.address, unique_name, str(steps), str(rank)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    for proc in procs:
        line = proc.stdout.readline()
        assert line.strip() == "ready", proc.stderr.read()[-3000:]
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    records = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
        records.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
    assert [len(r) for r in records] == [steps, steps]
    assert sorted(r[0]["created"] for r in records) == [False, True], "one worker creates, the other attaches"
    # Each worker saw the other's updates: its final version exceeds its own step count.
    assert all(r[-1]["version"] > steps for r in records)

    session = Client(server.address).session(unique_name)
    params = session.pull()
    assert session.version == 2 * steps
    g = torch.Generator().manual_seed(123)
    x = torch.randn(256, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)
    creator = [r[0]["rank"] for r in records if r[0]["created"]][0]
    torch.manual_seed(creator)
    initial = torch.nn.Linear(8, 1)
    initial_loss = ((initial(x) - y) ** 2).mean().item()
    w, b = torch.from_numpy(np.array(params["weight"])), torch.from_numpy(np.array(params["bias"]))
    final_loss = ((x @ w.T + b - y) ** 2).mean().item()
    assert final_loss < 0.1 * initial_loss, (initial_loss, final_loss)
    session.close()


def test_step_sends_the_loss_of_its_argument_or_closure_as_telemetry(server, unique_name):
    from optserve.client import Client

    model = _model()
    x, y = _data()
    opt = RemoteOptimizer(model.named_parameters(), server.address, {"name": "sgd", "args": {"learning_rate": 0.1}},
                          session=unique_name)
    try:
        loss = _loss(model, x, y)
        loss.backward()
        opt.step(loss=loss)

        def closure():
            opt.zero_grad()
            value = _loss(model, x, y)
            value.backward()
            return value

        returned = opt.step(closure)
        with Client(server.address) as client:
            series = client.session_series(unique_name)
        assert [p.loss for p in series.accepted] == pytest.approx([loss.item(), returned.item()])
        assert [p.version for p in series.accepted] == [1, 2]
    finally:
        opt.session.close()
        opt.close()


def test_parameters_instead_of_named_parameters_is_a_clear_type_error(server):
    import torch

    from optserve.client.torch import RemoteOptimizer

    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="pass model.named_parameters"):
        RemoteOptimizer(model.parameters(), server.address, {"name": "sgd", "args": {"learning_rate": 0.1}})


def test_rerun_attaching_to_a_trained_session_warns_that_the_model_was_replaced(server, unique_name):
    import torch

    from optserve.client.torch import RemoteOptimizer

    spec = {"name": "sgd", "args": {"learning_rate": 0.1}}
    first_model = torch.nn.Linear(2, 2)
    first = RemoteOptimizer(first_model.named_parameters(), server.address, spec, session=unique_name)
    first_model(torch.ones(1, 2)).sum().backward()
    first.step()
    first.close()
    with pytest.warns(UserWarning, match="already existed at version 1"):
        second = RemoteOptimizer(torch.nn.Linear(2, 2).named_parameters(), server.address, spec, session=unique_name)
    second.session.close()


def test_a_worker_whose_session_another_restored_is_refused_naming_it_and_resyncs(server, unique_name):
    spec = {"name": "adam", "args": {"learning_rate": 1e-2}}
    model_a, model_b = _model(), _model()
    a = RemoteOptimizer(model_a.named_parameters(), server.address, spec, session=unique_name, mode="async")
    _train(model_a, a, steps=2)
    checkpoint = a.state_dict()
    with pytest.warns(UserWarning, match="already existed"):
        b = RemoteOptimizer(model_b.named_parameters(), server.address, spec, session=unique_name, mode="async")
    _train(model_a, a, steps=2)
    _train(model_b, b, steps=1)
    assert b.version == 5  # async: b's push from version 2 was applied
    a.load_state_dict(checkpoint)  # the session is rewound to version 2 under b's feet
    assert a.version == 2
    with pytest.warns(UserWarning, match="was replaced"):
        _train(model_b, b, steps=1)  # b's gradient belongs to the former session: dropped, b re-synced
    assert b.version == 2 and b.stale_pushes == 1 and a.session.status().version == 2
    for (n, p), (_, q) in zip(model_a.named_parameters(), model_b.named_parameters()):
        assert torch.equal(p, q), n
    _train(model_b, b, steps=1)  # and trains on in the restored session
    assert b.version == 3
    a.session.close()
    for opt in (a, b):
        opt.close()


def test_loading_the_sessions_own_current_state_replaces_nothing(server, unique_name):
    """accelerate's prepare does opt.load_state_dict(opt.state_dict()): the session stays, so a
    worker attached to it trains on undisturbed."""
    spec = {"name": "adam", "args": {"learning_rate": 1e-2}}
    model_a, model_b = _model(), _model()
    a = RemoteOptimizer(model_a.named_parameters(), server.address, spec, session=unique_name, mode="async")
    _train(model_a, a, steps=2)
    with pytest.warns(UserWarning, match="already existed"):
        b = RemoteOptimizer(model_b.named_parameters(), server.address, spec, session=unique_name, mode="async")
    a.load_state_dict(a.state_dict())
    assert a.session.info.config.incarnation == b.session.info.config.incarnation
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "was replaced"
        _train(model_b, b, steps=1)
    assert b.version == 3 and b.stale_pushes == 0
    _train(model_a, a, steps=1)
    assert a.version == 4
    a.session.close()
    for opt in (a, b):
        opt.close()
