"""A session's whole state leaves the server and comes back: ``Session.state()`` is one version
of every shard (parameters, each tensor's optimizer state, the shared state, the hyperparameters
in force) and ``create_session(..., state=...)`` starts a session exactly there, so that it
continues as the uninterrupted session does, leaf for leaf."""

from __future__ import annotations

import numpy as np
import pytest

from optserve.client import Client, InvalidArgumentError

SHAPES = {"a": (8, 6), "b": (6,), "c": (6, 4), "d": (4,)}


def _params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}


def _grads(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}


def _train(session, steps: range) -> dict[str, np.ndarray]:
    params = None
    for step in steps:
        params = session.push_pull(_grads(step))
    return params


OPTIMIZERS = [
    {"name": "adamw", "args": {"learning_rate": 0.01, "weight_decay": 0.1}},
    {"name": "adafactor", "args": {"learning_rate": 0.05}},
    {"name": "muon", "args": {"learning_rate": 0.02}},
    {"name": "soap", "args": {"learning_rate": 0.01, "precondition_frequency": 2}},
    {"name": "shampoo", "args": {"learning_rate": 0.05, "block_size": 4, "preconditioning_compute_steps": 2}},
]


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address) as c:
        yield c


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o["name"])
def test_a_session_created_from_a_saved_state_continues_as_the_uninterrupted_one(client, unique_name, optimizer):
    original = client.create_session(f"{unique_name}-a", _params(), optimizer)
    _train(original, range(3))
    saved = original.state()
    assert saved["version"] == 3
    assert set(saved["params"]) == set(SHAPES) and set(saved["tensors"]) <= set(SHAPES)
    uninterrupted = _train(original, range(3, 6))

    restored = client.create_session(f"{unique_name}-b", state=saved)
    assert restored.version == 3
    assert restored.state()["version"] == 3
    again = restored.state()
    for tensor, leaves in saved["tensors"].items():
        for path, value in leaves.items():
            np.testing.assert_array_equal(again["tensors"][tensor][path], value, err_msg=f"{tensor} {path}")
    for path, value in saved["shared"].items():
        np.testing.assert_array_equal(again["shared"][path], value, err_msg=path)
    continued = _train(restored, range(3, 6))
    assert restored.version == 6
    for name in SHAPES:
        np.testing.assert_allclose(continued[name], uninterrupted[name], rtol=1e-6, atol=1e-6, err_msg=name)
    final_a, final_b = original.state(), restored.state()
    for tensor, leaves in final_a["tensors"].items():
        for path, value in leaves.items():
            np.testing.assert_allclose(final_b["tensors"][tensor][path], value, rtol=1e-6, atol=1e-6,
                                       err_msg=f"{tensor} {path}")
    original.close()
    restored.close()


def test_a_saved_state_that_does_not_fit_the_optimizer_is_refused_naming_the_leaf(client, unique_name):
    original = client.create_session(f"{unique_name}-a", _params(), OPTIMIZERS[0])
    _train(original, range(1))
    saved = original.state()
    original.close()
    bad = {**saved, "tensors": {**saved["tensors"], "a": {**saved["tensors"]["a"],
                                                         "0.mu": np.zeros((3, 3), np.float32)}}}
    with pytest.raises(InvalidArgumentError, match="0.mu"):
        client.create_session(f"{unique_name}-b", state=bad)
    assert f"{unique_name}-b" not in client.list_sessions()
    with pytest.raises(InvalidArgumentError, match="does not have"):
        client.create_session(f"{unique_name}-c", state=saved, optimizer={"name": "sgd", "args": {"learning_rate": 0.1}})
    assert f"{unique_name}-c" not in client.list_sessions()


def test_sessions_save_writes_an_orbax_checkpoint_that_restore_starts_a_session_from(server, client, unique_name,
                                                                                      tmp_path):
    import subprocess
    import sys

    import orbax.checkpoint as ocp

    source = client.create_session(f"{unique_name}-a", _params(), OPTIMIZERS[0])
    _train(source, range(3))
    directory = str(tmp_path / "saved")

    def optserve(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-c", "import sys; from optserve.server.cli import main; sys.exit(main())",
                   "sessions", *args, "--address", server.address]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    saved = optserve("save", f"{unique_name}-a", directory)
    assert saved.returncode == 0, saved.stderr
    assert f"at version 3 into {directory}" in saved.stdout
    arrays = ocp.PyTreeCheckpointer().restore(f"{directory}/arrays")  # orbax alone reads it
    assert len(arrays["params"]) == len(SHAPES)
    uninterrupted = _train(source, range(3, 5))
    restored = optserve("restore", f"{unique_name}-b", directory)
    assert restored.returncode == 0, restored.stderr
    assert "at version 3" in restored.stdout
    again = client.session(f"{unique_name}-b")
    assert again.version == 3
    continued = _train(again, range(3, 5))
    for name in SHAPES:
        np.testing.assert_allclose(continued[name], uninterrupted[name], rtol=1e-6, atol=1e-6, err_msg=name)
    refused = optserve("save", f"{unique_name}-a", directory)  # the directory exists: one line, exit 2
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "exists" in refused.stderr
    source.close()
    again.close()


def test_a_session_created_from_a_saved_state_keeps_the_saved_sessions_options(client, unique_name):
    options = dict(mode="async", max_staleness=3, staleness_policy="scale", allow_nonfinite=True)
    source = client.create_session(f"{unique_name}-a", _params(), OPTIMIZERS[0], **options)
    saved = source.state()
    source.close()
    restored = client.create_session(f"{unique_name}-b", state=saved)
    got = client.session_options(f"{unique_name}-b")
    assert (got.mode, got.max_staleness, got.staleness_policy, got.allow_nonfinite) == ("async", 3, "scale", True)
    restored.close()
    again = client.create_session(f"{unique_name}-c", state=saved, max_staleness=5)  # what is given wins
    assert client.session_options(f"{unique_name}-c").max_staleness == 5
    again.close()


def test_a_saved_states_hyperparameters_are_checked_as_set_hyperparams_checks_them(client, unique_name):
    source = client.create_session(f"{unique_name}-a", _params(), OPTIMIZERS[0])
    saved = source.state()
    source.close()
    bad = {**saved, "hyperparams": {"default": {**saved["hyperparams"]["default"], "learning_rate": float("nan")}}}
    with pytest.raises(InvalidArgumentError, match="learning_rate"):
        client.create_session(f"{unique_name}-b", state=bad)
    assert f"{unique_name}-b" not in client.list_sessions()
    changed = {**saved, "hyperparams": {"default": {**saved["hyperparams"]["default"], "learning_rate": 0.5}}}
    restored = client.create_session(f"{unique_name}-c", state=changed)
    assert restored.status().hyperparams["default"]["learning_rate"] == pytest.approx(0.5)
    restored.close()
