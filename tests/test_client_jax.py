"""The JAX adapter: pytrees in and out of a real server, named after their key paths."""

from __future__ import annotations

import dataclasses

import typing

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optserve.client.jax as ojax
from optserve.client import InvalidArgumentError, SessionOptions

STEPS = 20


def _init_mlp(seed: int = 0) -> dict:
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    return {
        "dense": {"w": jax.random.normal(k1, (5, 8)) * 0.5, "b": jnp.zeros((8,))},
        "layers": [{"w": jax.random.normal(k2, (8, 8)) * 0.3}, {"w": jax.random.normal(k3, (8, 2)) * 0.3}],
    }


def _loss(params, x, y):
    h = jnp.tanh(x @ params["dense"]["w"] + params["dense"]["b"])
    h = jnp.tanh(h @ params["layers"][0]["w"])
    return jnp.mean((h @ params["layers"][1]["w"] - y) ** 2)


def _data():
    kx, ky = jax.random.split(jax.random.PRNGKey(42))
    return jax.random.normal(kx, (32, 5)), jax.random.normal(ky, (32, 2))


class _Pair(typing.NamedTuple):
    left: jnp.ndarray
    right: jnp.ndarray


def test_tensor_names_come_from_key_paths_in_leaf_order():
    tree = {"dense": {"w": 1.0, "b": 2.0}, "layers": [{"w": 0.0}, {"w": 0.0}], "pair": _Pair(3.0, 4.0)}
    assert ojax.tensor_names(tree) == ["dense/b", "dense/w", "layers/0/w", "layers/1/w", "pair/left", "pair/right"]
    assert ojax.tensor_names(jnp.zeros(3)) == ["value"]


def test_colliding_key_paths_are_refused():
    with pytest.raises(ValueError, match="a/b"):
        ojax.tensor_names({"a/b": 1.0, "a": {"b": 2.0}})


@pytest.mark.parametrize(
    "spec, reference",
    [
        ({"name": "adam", "args": {"learning_rate": 1e-2}}, optax.adam(1e-2)),
        ({"name": "sgd", "args": {"learning_rate": 0.05, "momentum": 0.9}}, optax.sgd(0.05, momentum=0.9)),
    ],
    ids=["adam", "sgd-momentum"],
)
def test_pure_jax_mlp_through_server_matches_in_process_optax(server, unique_name, spec, reference):
    x, y = _data()
    grad_fn = jax.jit(jax.value_and_grad(_loss))
    params = _init_mlp()
    session = ojax.create_session(server.address, unique_name, params, optimizer=spec)
    remote_losses = []
    for _ in range(STEPS):
        loss, grads = grad_fn(params, x, y)
        params = session.push_pull(grads)
        remote_losses.append(float(loss))

    local = _init_mlp()
    state = reference.init(local)
    local_losses = []
    for _ in range(STEPS):
        loss, grads = grad_fn(local, x, y)
        updates, state = reference.update(grads, state, local)
        local = optax.apply_updates(local, updates)
        local_losses.append(float(loss))

    assert local_losses[-1] < 0.8 * local_losses[0]
    np.testing.assert_allclose(remote_losses, local_losses, rtol=1e-6)
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(local)
    for remote_leaf, local_leaf in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(local)):
        assert isinstance(remote_leaf, jax.Array) and remote_leaf.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(remote_leaf), np.asarray(local_leaf), rtol=1e-5, atol=1e-6)
    assert session.version == STEPS
    session.close()


def test_attached_session_pulls_the_same_pytree_and_async_push_returns_a_future(server, unique_name):
    params = _init_mlp()
    session = ojax.create_session(server.address, unique_name, params, optimizer={"name": "sgd", "args": {"learning_rate": 0.1}})
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    future = session.push_pull_async(grads)
    updated = future.result(timeout=60)
    expected = jax.tree_util.tree_map(lambda p: p - 0.1, params)
    for a, b in zip(jax.tree_util.tree_leaves(updated), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)

    attached = ojax.attach_session(server.address, unique_name, like=params)
    pulled = attached.pull()
    assert jax.tree_util.tree_structure(pulled) == jax.tree_util.tree_structure(params)
    for a, b in zip(jax.tree_util.tree_leaves(pulled), jax.tree_util.tree_leaves(updated)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    session.close()


def test_low_precision_leaves_return_in_their_own_dtype(server, unique_name):
    params = {"w16": jnp.full((4, 4), 1.0, jnp.bfloat16), "w32": jnp.full((3,), 2.0, jnp.float32)}
    session = ojax.create_session(server.address, unique_name, params, optimizer={"name": "sgd", "args": {"learning_rate": 0.5}})
    updated = session.push_pull({"w16": jnp.ones((4, 4), jnp.bfloat16), "w32": jnp.ones((3,), jnp.float32)})
    assert updated["w16"].dtype == jnp.bfloat16 and updated["w32"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(updated["w16"], np.float32), np.full((4, 4), 0.5, np.float32))
    np.testing.assert_array_equal(np.asarray(updated["w32"]), np.full((3,), 1.5, np.float32))
    with pytest.raises(ValueError, match="structure"):
        session.push_pull({"w16": jnp.ones((4, 4))})
    session.close()


SHAMPOO_ARGS = {"learning_rate": 0.01, "block_size": 8, "start_preconditioning_step": 2}


@pytest.mark.parametrize("optimizer, kwargs", [
    ({"name": "shampoo", "args": SHAMPOO_ARGS, "preconditioners": {"in_process": True}}, {}),
    (SessionOptions("shampoo", SHAMPOO_ARGS, preconditioners={"max_age": 3}, mode="async"), {"max_staleness": 4}),
], ids=["spec-in_process", "options-max_age"])
def test_preconditioners_option_reaches_the_server_through_the_jax_adapter(server, unique_name, optimizer, kwargs):
    expected = SessionOptions.from_spec(optimizer, **kwargs)
    x, y = _data()
    params = _init_mlp()
    session = ojax.create_session(server.address, unique_name, params, optimizer=optimizer, **kwargs)
    for _ in range(4):
        params = session.push_pull(jax.grad(_loss)(params, x, y))
    assert session.version == 4
    # as the server reported the configuration at creation (its replicas: the test server's --replicas 1)
    assert session.options == dataclasses.replace(expected, replicas=1)
    attached = ojax.attach_session(server.address, unique_name, like=params)
    assert attached.options.preconditioners == expected.preconditioners
    assert attached.options.max_staleness == kwargs.get("max_staleness")
    status = session.status()
    assert status.version == 4
    # The test server has no preconditioner workers: roots are computed in the update, per block.
    assert all(s.root_offload is not None and not s.root_offload.offloaded for s in status.shards)
    assert [b for s in status.shards for b in s.preconditioners]
    attached.raw.detach()
    session.close()


def test_jax_adapter_refuses_bad_preconditioners_naming_the_option():
    with pytest.raises(InvalidArgumentError, match="max_age"):
        ojax.create_session("127.0.0.1:1", "s", _init_mlp(),
                            optimizer={"name": "shampoo", "preconditioners": {"max_age": -2}})


def test_views_return_jax_arrays_over_the_reply_region_and_train_exactly(server, unique_name):
    """``push_pull(grads, views=True)`` on a same-host server: every float32 leaf is a jax array
    over the session's reply region (no parameter byte copied on the client), and training
    equals in-process optax."""
    x, y = _data()
    grad_fn = jax.jit(jax.value_and_grad(_loss))
    params = _init_mlp(3)
    session = ojax.create_session(server.address, unique_name, params, optimizer={"name": "adam",
                                                                                   "args": {"learning_rate": 1e-2}})
    local, reference = _init_mlp(3), optax.adam(1e-2)
    state = reference.init(local)
    for _ in range(5):
        _, grads = grad_fn(params, x, y)
        params = session.push_pull(grads, views=True)
        updates, state = reference.update(grad_fn(local, x, y)[1], state, local)
        local = optax.apply_updates(local, updates)
    assert set(session.raw.data_paths().values()) == {"shared_memory"}
    region = session.raw.parameter_buffers()
    for name, leaf in zip(session.codec.names, jax.tree_util.tree_leaves(params)):
        assert leaf.unsafe_buffer_pointer() == region[name].ctypes.data, name  # the region's memory itself
    for remote_leaf, local_leaf in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(local)):
        np.testing.assert_allclose(np.asarray(remote_leaf), np.asarray(local_leaf), rtol=1e-5, atol=1e-6)
    copied = session.push_pull(grad_fn(params, x, y)[1])  # without views: arrays of their own
    assert all(leaf.unsafe_buffer_pointer() != region[name].ctypes.data
               for name, leaf in zip(session.codec.names, jax.tree_util.tree_leaves(copied)))
    session.close()


def test_views_over_a_step_that_went_over_grpc_are_that_steps_parameters_not_the_regions(server, unique_name):
    """A bfloat16 wire sends the step over gRPC: the leaves returned are its answer (copied), not
    the reply region's older contents."""
    x, y = _data()
    grad_fn = jax.jit(jax.value_and_grad(_loss))
    params = _init_mlp(4)
    session = ojax.create_session(server.address, unique_name, params, optimizer={"name": "sgd",
                                                                                   "args": {"learning_rate": 0.1}})
    first = session.push_pull(grad_fn(params, x, y)[1], views=True)  # through the regions
    second = session.push_pull(grad_fn(first, x, y)[1], views=True, wire_dtype="bfloat16")
    pulled = session.pull(wire_dtype="bfloat16")  # the same version, as the step's answer came
    for got, expected in zip(jax.tree_util.tree_leaves(second), jax.tree_util.tree_leaves(pulled)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    assert not all(np.array_equal(np.asarray(a), np.asarray(b))
                   for a, b in zip(jax.tree_util.tree_leaves(first), jax.tree_util.tree_leaves(second)))
    session.close()


def test_a_jax_session_created_from_another_ones_state_continues_as_optax_does(server, unique_name):
    x, y = _data()
    grad_fn = jax.jit(jax.grad(_loss))
    spec = {"name": "adam", "args": {"learning_rate": 0.01}}
    params = _init_mlp()
    first = ojax.create_session(server.address, f"{unique_name}-a", params, optimizer=spec)
    for _ in range(3):
        params = first.push_pull(grad_fn(params, x, y))
    saved = first.state()
    assert saved["version"] == 3 and set(saved["params"]) == set(ojax.tensor_names(params))
    first.close()

    second = ojax.create_session(server.address, f"{unique_name}-b", _init_mlp(seed=5), optimizer=spec, state=saved)
    assert second.version == 3
    resumed = second.pull()
    local = _init_mlp()
    reference = optax.adam(0.01)
    state = reference.init(local)
    for _ in range(5):  # the uninterrupted run: 3 steps before the save, 2 after
        updates, state = reference.update(grad_fn(local, x, y), state, local)
        local = optax.apply_updates(local, updates)
    for _ in range(2):
        resumed = second.push_pull(grad_fn(resumed, x, y))
    for remote_leaf, local_leaf in zip(jax.tree_util.tree_leaves(resumed), jax.tree_util.tree_leaves(local)):
        np.testing.assert_allclose(np.asarray(remote_leaf), np.asarray(local_leaf), rtol=1e-5, atol=1e-6)
    second.close()
