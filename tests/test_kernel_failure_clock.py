"""A step that fails in the kernel never advances the clock, and is applied on no shard (issue 28).

Optimizer options are validated by value when a session is created, yet a kernel can still fail
when its step runs. A real case, with no mocking: Muon accepts a tensor with a zero-length axis
(its state builds), but its update raises ``ZeroDivisionError`` while it is traced (the shape
factor of a ``0 x 4`` matrix); Shampoo fails likewise on such a tensor (``TypeError``). The
failure depends on the optimizer and the tensors, never on a gradient's values, so a shard finds
it before it stages the push: it refuses with INVALID_ARGUMENT naming the optimizer and the tensor,
its peers drop their parts, the clock decides nothing, and the next call is answered the same way
at once (the session is neither stale nor wedged; pulls still work).

A kernel failure that only shows while the step runs (an XLA error at run time: here a host
callback of a test-only transformation that raises for huge gradients) comes after the clock
decided the step, and the update has donated the shard's parameters by then: the session ends
with one clear DATA_LOSS (SessionLost) naming the session, the optimizer and the step, instead of
INTERNAL errors and shards that silently disagree. Those cases run in process, on one shard.

The service cases use the run's shared 2-shard server (small tensors).
"""

from __future__ import annotations

import concurrent.futures
import time

import numpy as np
import pytest

from optserve.client import Client, InvalidArgumentError
from optserve.protos.optserve.v1 import tensor_pb2

MUON = {"name": "muon", "args": {"learning_rate": 0.1}}
ANSWER_S = 10.0  # a refused push is answered at once; far below any step or vote timeout


def _params(shards: int) -> dict[str, np.ndarray]:
    """A model whose ``empty/w`` (0 x 4) Muon cannot update; with 2 shards a healthy tensor
    (on the other shard) beside it."""
    params = {"empty/w": np.zeros((0, 4), np.float32)}
    if shards == 2:
        params["dense/w"] = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
    return params


def _grads(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: np.ones(p.shape, np.float32) for name, p in params.items()}


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address, timeout=60.0) as c:
        yield c


def _push_all(workers, grads) -> tuple[list, float]:
    """Each worker pushes at once (a sync step's pushes); returns their outcomes and the time taken."""
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(len(workers)) as pool:
        futures = [pool.submit(worker.push, grads) for worker in workers]
        outcomes = [f.exception() or f.result() for f in futures]
    return outcomes, time.monotonic() - started


@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_step_the_kernel_cannot_run_is_refused_before_the_clock_on_every_shard(client, server, unique_name,
                                                                              mode, shards):
    params = _params(shards)
    workers_per_step = 2 if mode == "sync" else 1
    session = client.create_session(unique_name, params, optimizer=MUON, mode=mode, num_workers=workers_per_step)
    try:
        assert len(session.info.shards) == shards
        workers = [session] + [Client(server.address, timeout=60.0).session(unique_name)
                               for _ in range(workers_per_step - 1)]
        for attempt in range(2):  # the next step is answered the same way, at once: not stale, not wedged
            outcomes, took = _push_all(workers, _grads(params))
            assert took < ANSWER_S, f"attempt {attempt}: answered after {took:.1f} s"
            for outcome in outcomes:
                assert isinstance(outcome, InvalidArgumentError), repr(outcome)
                message = str(outcome)
                assert repr(unique_name) in message and "optimizer 'muon'" in message
                assert "tensor 'empty/w' (shape [0, 4], float32)" in message and "ZeroDivisionError" in message
                assert "'dense/w'" not in message and "Traceback" not in message
                assert "applied nowhere" in message
            status = session.status()
            assert status.version == 0 and status.pushes_accepted == 0, status
            assert [s.version for s in status.shards] == [0] * shards
            assert status.rejected.get("invalid", 0) >= (attempt + 1) * workers_per_step
        pulled = workers[-1].pull()  # the healthy shard applied nothing either
        assert workers[-1].version == 0
        for name, value in params.items():
            np.testing.assert_array_equal(pulled[name], value)
    finally:
        session.close()


def test_healthy_session_beside_it_steps_on_the_same_shards(client, unique_name):
    # The refusal is the session's own: the same optimizer on healthy tensors steps as usual.
    params = {"dense/w": np.ones((4, 3), np.float32), "other/w": np.ones((3, 2), np.float32)}
    session = client.create_session(unique_name, params, optimizer=MUON, mode="async")
    try:
        assert session.push(_grads(params)) == 1
        assert session.status().version == 1
    finally:
        session.close()


# ------------------------------------------------------------------ in process: the updater's check
@pytest.mark.parametrize("name, args, error", [
    ("muon", {"learning_rate": 0.1}, "ZeroDivisionError"),
    ("shampoo", {"learning_rate": 0.1, "block_size": 4}, "TypeError"),
])
def test_updater_names_the_tensor_its_kernel_cannot_update(name, args, error):
    from optserve.server.compute.root_offload import build_shard_optimizer
    from optserve.server.compute.updater import Updater

    values = {"dense/w": np.ones((4, 3), np.float32), "empty/w": np.zeros((0, 4), np.float32)}
    optimizer, preconditioners = build_shard_optimizer(name, args, {k: v.shape for k, v in values.items()}, None)
    updater = Updater(optimizer, preconditioners)
    updater.initialize(values)  # the state builds: only the update fails
    problem = updater.step_problem()
    assert problem is not None and problem.startswith(f"optimizer {name!r} cannot update tensor 'empty/w' "
                                                      f"(shape [0, 4], float32): {error}"), problem
    assert "dense/w" not in problem

    healthy, _ = build_shard_optimizer(name, args, {"dense/w": (4, 3)}, None)
    fine = Updater(healthy, preconditioners=None)
    fine.initialize({"dense/w": values["dense/w"]})
    assert fine.step_problem() is None


# ------------------------------------------------------------------ in process: a failure at run time
HUGE = 1e6


def _explodes_on_huge_gradients():
    """SGD (learning rate 0.5) whose update asks a host callback about the gradient, and the callback
    raises for a gradient above HUGE: an error only the run shows (an XLA runtime error)."""
    import jax
    import jax.numpy as jnp
    import optax

    from optserve.optim_kernels import BuiltOptimizer

    def check(g):
        if np.max(np.abs(g)) > HUGE:
            raise FloatingPointError(f"gradient of magnitude {np.max(np.abs(g)):g} is past {HUGE:g}")
        return np.float32(1.0)

    def update(updates, state, params=None):
        def one(g):
            ok = jax.pure_callback(check, jax.ShapeDtypeStruct((), jnp.float32), g)
            return -0.5 * g * ok
        return jax.tree.map(one, updates), state

    transformation = optax.GradientTransformation(lambda params: optax.EmptyState(), update)
    return BuiltOptimizer("explodes_on_huge_gradients", {}, transformation, None, None)


def _local_session(name: str, num_workers: int = 1):
    from optserve.server.compute.updater import Updater
    from optserve.server.domain.clock.home_clock import HomeClock
    from optserve.server.domain.config import DType, Mode, SessionConfig, TensorSpec
    from optserve.server.domain.shard.shard_session import ShardSession

    config = SessionConfig(name=name, tensors=(TensorSpec("w", DType.FLOAT32, (4,)),),
                           optimizer_name="explodes_on_huge_gradients", optimizer_args={}, mode=Mode.SYNC,
                           num_workers=num_workers)
    session = ShardSession(config, ["w"], 0, HomeClock(config), Updater(_explodes_on_huge_gradients()),
                           step_timeout_s=30.0, vote_timeout_s=30.0)
    session.initialize([_chunk("w", np.ones(4, np.float32))])
    return session


def _chunk(name, array):
    return tensor_pb2.TensorChunk(name=name, dtype=tensor_pb2.DTYPE_FLOAT32, shape=list(array.shape),
                                  data=np.ascontiguousarray(array, np.float32).tobytes())


def _header(client_id, sequence, base_version):
    from optserve.server.domain.shard.shard_session import PushHeader

    return PushHeader(client_id=client_id, sequence=sequence, base_version=base_version, auto_commit=True)


def test_kernel_failure_at_run_time_ends_the_session_with_one_clear_error():
    from optserve.server.domain.errors import SessionLost

    session = _local_session("runtime failure")
    assert session.push(_header("worker", 1, 0), [_chunk("w", np.full(4, 0.5, np.float32))]).version == 1
    with pytest.raises(SessionLost) as info:
        session.push(_header("worker", 2, 1), [_chunk("w", np.full(4, 10 * HUGE, np.float32))])
    message = str(info.value)
    assert "session 'runtime failure'" in message and "optimizer 'explodes_on_huge_gradients'" in message
    assert "step 2 on shard 0" in message and "close it" in message and "Traceback" not in message
    assert session.version == 1  # the step was not applied here
    for call in (lambda: session.push(_header("worker", 3, 1), [_chunk("w", np.full(4, 0.5, np.float32))]),
                 session.snapshot):
        with pytest.raises(SessionLost, match="failed in step 2"):  # the same error, not "Array has been deleted"
            call()


def test_kernel_failure_at_run_time_ends_a_sync_step_at_once_for_the_push_it_held():
    from optserve.server.domain.errors import SessionLost

    session = _local_session("runtime failure sync", num_workers=2)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(session.push, _header("a", 1, 0), [_chunk("w", np.full(4, 0.5, np.float32))])
        deadline = time.monotonic() + ANSWER_S
        while session.clock.status().accepted < 1 and time.monotonic() < deadline:  # "a" joined the step
            time.sleep(0.01)
        started = time.monotonic()
        with pytest.raises(SessionLost, match="failed in step 1"):
            session.push(_header("b", 1, 0), [_chunk("w", np.full(4, 10 * HUGE, np.float32))])
        with pytest.raises(SessionLost, match="failed in step 1"):  # not after step_timeout_s (30 s)
            held.result(timeout=ANSWER_S)
        assert time.monotonic() - started < ANSWER_S
