"""An optimizer that cannot build its state for a session's tensors is refused at CreateSession
(INVALID_ARGUMENT), and leaves nothing behind (issue 28: "no INTERNAL, no tracebacks").

Options are validated by value when a session is created, yet a kernel can still fail while it
builds its state (``init``) for the tensors it is given. Real cases, with no mocking:

* T5X Adafactor (``adafactor``) on a tensor of rank > 2 with no factor rule (``ValueError``);
* adamw with a ``mask`` given as ``{tensor name: bool}`` on a session split over two shards: each
  shard holds part of the tree, so the whole map did not match its part. Such a map is what the
  registry documents ("a pytree of bools like the params"), so each shard now builds its
  optimizer with the part naming its own tensors and the session WORKS; a map naming tensors the
  session does not have (or missing some) is refused, naming them.

Each shard traces ``init`` abstractly when the session is opened (nothing allocated): a failure
is answered with one line naming the session, the optimizer, the tensors (shape, dtype) and the
kernel's error; the session exists on no shard and not in the coordinator, so the same name can be
created again, and the server's other sessions go on. A failure only the real ``init`` shows (run
when the initial values arrive) is INVALID_ARGUMENT too, and installs nothing.

The service cases use the run's shared 2-shard server (small tensors spread over both shards).
"""

from __future__ import annotations

import numpy as np
import optax
import pytest

from _service_helpers import make_grads
from optserve.client import Client, InvalidArgumentError

T5X = {"name": "adafactor", "args": {"learning_rate": 0.01}}


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address, timeout=60.0) as c:
        yield c


def _held_anywhere(client, server, name: str) -> bool:
    """Whether the coordinator lists the session or any shard holds a part of it."""
    return name in client.list_sessions() or name in server.fleet.session_activity()


def _assert_one_clean_line(message: str) -> None:
    assert "\n" not in message and "\x1b" not in message, repr(message)
    assert "Traceback" not in message and "ray::" not in message and "internal error" not in message, message


def test_adafactor_on_a_3d_tensor_is_refused_at_create_leaving_nothing_and_other_sessions_step(client, server,
                                                                                             unique_name):
    params = {"conv/w": np.ones((2, 3, 4), np.float32), "dense/w": np.ones((3, 2), np.float32),
              "dense/b": np.ones((2,), np.float32)}
    healthy_params = {"w": np.ones((3, 2), np.float32), "b": np.ones((2,), np.float32)}
    healthy = client.create_session(f"{unique_name}-healthy", healthy_params, optimizer=T5X)
    try:
        with pytest.raises(InvalidArgumentError) as info:
            client.create_session(unique_name, params, optimizer=T5X)
        message = str(info.value)
        _assert_one_clean_line(message)
        assert message.startswith(f"session {unique_name!r}: optimizer 'adafactor' cannot build its state for "
                                  f"tensor 'conv/w' (shape [2, 3, 4], float32): ValueError: "), message
        assert "no factor rule" in message and "dense/" not in message, message
        assert not _held_anywhere(client, server, unique_name)

        # the server's other session goes on
        assert healthy.push(make_grads(healthy_params, 0)) == 1
        # the name is free: a valid optimizer (T5X Adafactor unfactored) creates it and steps
        fixed = {"name": "adafactor", "args": {"learning_rate": 0.01, "factored": False}}
        session = client.create_session(unique_name, params, optimizer=fixed)
        try:
            assert len(session.info.shards) == 2
            assert session.push(make_grads(params, 0)) == 1
        finally:
            session.close()
        assert healthy.push(make_grads(healthy_params, 1)) == 2
    finally:
        healthy.close()


def test_tensors_failing_on_both_shards_are_all_named(client, server, unique_name):
    params = {"a/w": np.ones((2, 3, 4), np.float32), "b/w": np.ones((2, 2, 3, 4), np.float32)}
    with pytest.raises(InvalidArgumentError) as info:
        client.create_session(unique_name, params, optimizer=T5X)
    message = str(info.value)
    _assert_one_clean_line(message)
    assert "tensor 'a/w' (shape [2, 3, 4], float32)" in message, message
    assert "tensor 'b/w' (shape [2, 2, 3, 4], float32)" in message, message
    assert not _held_anywhere(client, server, unique_name)


def test_adamw_mask_by_tensor_name_works_on_a_session_split_over_two_shards(client, unique_name):
    params = {"dense/w": np.full((2, 3), 2.0, np.float32), "dense/b": np.full((3,), 2.0, np.float32),
              "out/w": np.full((3, 2), 2.0, np.float32)}
    mask = {"dense/w": True, "dense/b": False, "out/w": True}
    args = {"learning_rate": 0.1, "weight_decay": 0.5, "mask": mask}
    session = client.create_session(unique_name, params, optimizer={"name": "adamw", "args": args})
    try:
        assert len(session.info.shards) == 2
        tx = optax.adamw(**args)  # the whole tree in process: the reference
        reference, state = dict(params), tx.init(params)
        for step in range(2):
            grads = make_grads(params, step)
            updates, state = tx.update(grads, state, reference)
            reference = optax.apply_updates(reference, updates)
            pulled = session.push_pull(grads)
        for name in params:
            np.testing.assert_allclose(pulled[name], reference[name], rtol=0, atol=1e-6, err_msg=name)
    finally:
        session.close()


def test_adamw_mask_naming_other_tensors_is_refused_naming_them(client, server, unique_name):
    params = {"dense/w": np.ones((2, 3), np.float32), "dense/b": np.ones((3,), np.float32)}
    optimizer = {"name": "adamw", "args": {"learning_rate": 0.1, "mask": {"dense/w": True, "typo/b": False}}}
    with pytest.raises(InvalidArgumentError) as info:
        client.create_session(unique_name, params, optimizer=optimizer)
    message = str(info.value)
    _assert_one_clean_line(message)
    assert message.startswith(f"session {unique_name!r}: optimizer 'adamw': option 'mask' "), message
    assert "names 'typo/b' that the session does not have" in message and "lacks 'dense/b'" in message, message
    assert not _held_anywhere(client, server, unique_name)


# ------------------------------------------------------------------ in process: the updater's check
SHAPES = {"0-d": (), "1-d": (5,), "3-d": (2, 3, 4), "4-d": (2, 3, 4, 5), "zero-length": (0, 4)}
DEFAULTS = {"adafactor": {"learning_rate": 0.01}, "adafactor_hf": {"lr": 0.01, "relative_step": False},
            "adafactor_t2t": {"learning_rate": 0.01}, "adam": {"learning_rate": 0.01},
            "adamw": {"learning_rate": 0.01}, "delayed_nesterov": {"learning_rate": 0.01, "delay": 2},
            "muon": {"learning_rate": 0.01}, "scaled_adam": {}, "sgd": {"learning_rate": 0.01},
            "shampoo": {"learning_rate": 0.01}, "soap": {"learning_rate": 0.01}}


def test_every_registry_optimizer_builds_its_state_at_defaults_or_names_the_tensor():
    """Of the registry's kernels at their defaults, only T5X Adafactor cannot build a state, for a
    tensor of rank > 2 (no factor rule); init_problem names exactly those tensors."""
    from optserve.optim_kernels import OPTIMIZERS
    from optserve.server.compute.root_offload import build_shard_optimizer
    from optserve.server.compute.updater import Updater

    assert set(DEFAULTS) == set(OPTIMIZERS), "a new kernel: add its required options here"
    for name, args in DEFAULTS.items():
        for dtype in (np.float32, "bfloat16"):
            specs = {label: (shape, np.dtype(dtype)) for label, shape in SHAPES.items()}
            optimizer, preconditioners = build_shard_optimizer(name, args, {n: s for n, (s, _) in specs.items()}, None)
            problem = Updater(optimizer, preconditioners, specs).init_problem()
            if name != "adafactor":
                assert problem is None, (name, problem)
                continue
            dtype_name = np.dtype(dtype).name
            assert problem is not None and problem.startswith(
                f"optimizer 'adafactor' cannot build its state for tensors '3-d' (shape [2, 3, 4], {dtype_name}), "
                f"'4-d' (shape [2, 3, 4, 5], {dtype_name}): ValueError: "), problem


def _init_fails_on_huge_values():
    """SGD whose init asks a host callback about the parameters, and the callback raises for a value
    above 1e6: a failure the abstract trace does not show, only the real init."""
    import jax
    import jax.numpy as jnp

    from optserve.optim_kernels import BuiltOptimizer

    def check(p):
        if np.max(np.abs(p)) > 1e6:
            raise FloatingPointError("parameter past 1e6")
        return np.float32(0.0)

    def init(params):
        return jax.tree.map(lambda p: jax.pure_callback(check, jax.ShapeDtypeStruct((), jnp.float32), p), params)

    transformation = optax.GradientTransformation(init, lambda updates, state, params=None: (updates, state))
    return BuiltOptimizer("init_fails_on_huge_values", {}, transformation, None, None)


def test_init_failing_only_when_run_is_invalid_argument_and_installs_nothing():
    from optserve.protos.optserve.v1 import tensor_pb2
    from optserve.server.compute.updater import Updater
    from optserve.server.domain.clock.home_clock import HomeClock
    from optserve.server.domain.config import DType, SessionConfig, TensorSpec
    from optserve.server.domain.errors import InvalidArgument
    from optserve.server.domain.shard.shard_session import ShardSession

    config = SessionConfig(name="init at run time", tensors=(TensorSpec("w", DType.FLOAT32, (4,)),),
                           optimizer_name="init_fails_on_huge_values", optimizer_args={})
    updater = Updater(_init_fails_on_huge_values(), param_specs={"w": ((4,), np.float32)})
    assert updater.init_problem() is None  # the abstract trace passes
    session = ShardSession(config, ["w"], 0, HomeClock(config), updater, step_timeout_s=30.0, vote_timeout_s=30.0)

    def chunk(value: float):
        return tensor_pb2.TensorChunk(name="w", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[4],
                                      data=np.full(4, value, np.float32).tobytes())

    with pytest.raises(InvalidArgument) as info:
        session.initialize([chunk(1e7)])
    message = str(info.value)
    _assert_one_clean_line(message)
    assert message.startswith("session 'init at run time': optimizer 'init_fails_on_huge_values' could not build "
                              "its state for tensor 'w' (shape [4], float32) on shard 0: "), message
    assert "parameter past 1e6" in message, message
    assert not session.initialized
    assert session.initialize([chunk(1.0)]) == 0  # nothing was installed: good values go in
