"""Helpers shared by the service tests: deterministic models and an in-process reference."""

from __future__ import annotations

import numpy as np

# --replicas 2 servers in tests: how long a shard process may not answer before it counts as lost.
# The suite oversubscribes its 2 cores, where a live process can stay silent past the 0.5 s
# default for seconds (its standby forgotten, or a live primary failed over, under a test that
# expects neither); production keeps the default (docs/durability.md: raise it when loaded).
REPLICA_SILENCE_S = 5.0

# Shampoo on a small model of a few blocks per tensor, preconditioning from step 3 (what the tests
# of roots on preconditioner workers across a shard's loss train).
SMALL_SHAMPOO_ARGS = {"learning_rate": 0.01, "block_size": 8, "start_preconditioning_step": 3}
SMALL_SHAMPOO_SHAPES = {"embed": (16, 12), "hidden/w": (12, 10), "hidden/b": (10,), "out/w": (10, 6)}


def exact_offloaded_shampoo(client, name: str) -> tuple:
    """``(session, in-process reference, params)``: small Shampoo with its roots on the server's
    preconditioner workers at age bound 0 (each root an update needs is installed before it, so
    the run equals in-process Shampoo); gradients: ``make_grads(params, step, seed=7)``."""
    params = make_params(4, shapes=SMALL_SHAMPOO_SHAPES)
    session = client.create_session(name, params, optimizer={"name": "shampoo", "args": SMALL_SHAMPOO_ARGS,
                                                             "preconditioners": {"max_age": 0}})
    return session, InProcess("shampoo", SMALL_SHAMPOO_ARGS, params), params


def root_pool(ray, workers: int = 2, batch_blocks: int = 4):
    """Preconditioner workers on the local ``ray`` and the pool over them: a module fixture's
    body (yields the pool, then kills the workers)."""
    from optserve.server.compute.preconditioner_pool import PoolConfig, PreconditionerPool, start_workers

    config = PoolConfig(workers=workers, batch_blocks=batch_blocks)
    started = start_workers(config)
    yield PreconditionerPool(started, config)
    for worker in started:
        ray.kill(worker)


def make_params(seed: int = 0, shapes=None) -> dict[str, np.ndarray]:
    """A small model: a few float32 matrices and vectors (names sorted for determinism)."""
    shapes = shapes or {"dense/w": (8, 6), "dense/b": (6,), "out/w": (6, 4), "out/b": (4,)}
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def make_grads(params: dict[str, np.ndarray], step: int, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed * 10_000 + step)
    return {name: rng.standard_normal(p.shape).astype(np.float32) for name, p in params.items()}


class InProcess:
    """The same kernel run in this process over the whole pytree (the reference)."""

    def __init__(self, name: str, args: dict, params: dict[str, np.ndarray], transformation=None):
        """``transformation``: an optax transformation to run instead of the registry's ``name``
        built with ``args`` (a reference written with optax itself)."""
        import jax
        import optax

        from optserve.optim_kernels import build_optimizer

        from optserve.server.compute.updater import step_function

        self.params = {k: jax.numpy.asarray(v) for k, v in params.items()}
        if transformation is None:  # the registry's kernel, as a shard's step runs it (hyperparameters as values)
            built = build_optimizer(name, args)
            self.state = built.transformation.init(self.params)
            shard_step, partial, hyper = jax.jit(step_function(built)), built.partial_statistic, built.hyperparams
            partial = jax.jit(partial) if partial is not None else None

            def step(params, state, grads):  # scale and statistic are values of the call, as on a shard
                total = partial(grads, state, params) if partial is not None else np.float32(0.0)
                return shard_step(params, state, grads, np.float32(1.0), np.float32(total), hyper)
        else:
            self.state = transformation.init(self.params)

            def whole(params, state, grads):
                updates, state = transformation.update(grads, state, params)
                return optax.apply_updates(params, updates), state

            step = jax.jit(whole)
        self._step = step

    def step(self, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.params, self.state = self._step(self.params, self.state, grads)
        return {k: np.asarray(v) for k, v in self.params.items()}


def max_abs_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert set(a) == set(b)
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)), initial=0.0)) for k in a)


def train_alike(session, reference: "InProcess", params: dict[str, np.ndarray], steps) -> None:
    """Pushes ``make_grads(params, step)`` for each of ``steps`` to ``session`` and to the
    in-process ``reference``; the last answer equals the reference's parameters (1e-6)."""
    got = expected = None
    for step in steps:
        grads = make_grads(params, step)
        got, expected = session.push_pull(grads), reference.step(grads)
    assert max_abs_diff(got, expected) <= 1e-6

