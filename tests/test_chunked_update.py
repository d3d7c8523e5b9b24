"""A shard of many tensors is updated in chunks: the same numbers as one step over the whole tree,
and chunks of one program compile it once."""

from __future__ import annotations

import numpy as np
import pytest

from optserve.optim_kernels import build_optimizer
from optserve.server.compute.chunked_update import CHUNK_TENSORS, plan_chunks
from optserve.server.compute.compile_cache import compile_stats
from optserve.server.compute.updater import Updater

from _service_helpers import InProcess, make_grads, make_params, max_abs_diff

T5X_CLIPPED = {"name": "adafactor", "args": {"learning_rate": 1e-2, "clipping_threshold": 1.0,
                                             "global_norm_clip_threshold": 0.5}}  # a partial statistic
ADAMW = {"name": "adamw", "args": {"learning_rate": 1e-2, "weight_decay": 0.1}}
SCHEDULE_FREE = {"name": "optax.contrib.schedule_free_adamw", "args": {"learning_rate": 1e-2}}


def _model(count: int, seed: int = 0) -> dict[str, np.ndarray]:
    shapes = [(6, 5), (7,), (3, 4)]
    return make_params(seed, {f"layer{i:04d}/{'wbk'[i % 3]}": shapes[i % 3] for i in range(count)})


def _updater(spec: dict, params: dict, chunk_tensors=None) -> Updater:
    specs = {name: (value.shape, value.dtype) for name, value in params.items()}
    updater = Updater(build_optimizer(spec["name"], spec["args"]), param_specs=specs)
    if chunk_tensors is not None:
        updater.use_chunks(chunk_tensors)
    updater.initialize(params)
    return updater


def _host(updater: Updater) -> dict[str, np.ndarray]:
    return {name: np.array(value) for name, value in updater.host_params().items()}


def test_chunks_group_tensors_of_one_shape_and_cover_every_tensor_once():
    params = _model(200)
    chunks = plan_chunks({n: (p.shape, p.dtype) for n, p in params.items()}, 64)
    assert sorted(n for chunk in chunks for n in chunk) == sorted(params)
    assert all(len(chunk) <= 64 for chunk in chunks)
    assert sum(len({params[n].shape for n in chunk}) == 1 for chunk in chunks) >= 3  # most chunks hold one shape


def test_a_shard_of_more_than_the_chunk_size_is_chunked_and_a_small_one_is_not():
    assert _updater(ADAMW, _model(CHUNK_TENSORS + 1)).chunk_tensors == CHUNK_TENSORS
    assert _updater(ADAMW, _model(CHUNK_TENSORS)).chunk_tensors == 0


@pytest.mark.parametrize("spec", [T5X_CLIPPED, ADAMW], ids=lambda s: s["name"])
def test_chunked_steps_equal_the_whole_tree_kernel(spec):
    params = _model(150, seed=1)
    updater = _updater(spec, params)
    assert updater.chunk_tensors == CHUNK_TENSORS and isinstance(updater.opt_state, tuple)
    reference = InProcess(spec["name"], spec["args"], params)
    for step in range(3):
        grads = make_grads(params, step)
        updater.apply(grads, 1.0, lambda partial: partial)
        expected = reference.step(grads)
    assert max_abs_diff(_host(updater), expected) <= 1e-6


def test_tensors_without_a_gradient_are_left_alone_in_chunks_as_in_one_tree():
    params = _model(140, seed=2)
    chunked, whole = _updater(ADAMW, params), _updater(ADAMW, params, chunk_tensors=0)
    absent = [name for name in sorted(params)[::7]]
    for step in range(3):
        grads = make_grads(params, step)
        for updater in (chunked, whole):
            updater.apply(grads, 1.0, lambda partial: partial, absent=absent if step == 1 else ())
    got, expected = _host(chunked), _host(whole)
    assert max_abs_diff(got, expected) <= 1e-6
    assert not np.array_equal(got[absent[0]], params[absent[0]])  # moved in steps 0 and 2


def test_evaluation_parameters_come_from_every_chunk():
    params = _model(130, seed=3)
    chunked, whole = _updater(SCHEDULE_FREE, params), _updater(SCHEDULE_FREE, params, chunk_tensors=0)
    for updater in (chunked, whole):
        updater.apply(make_grads(params, 0), 1.0, lambda partial: partial)
    assert max_abs_diff(chunked.evaluation_params(), whole.evaluation_params()) <= 1e-6


def test_a_checkpointed_chunked_state_restores_into_a_fresh_updater_and_trains_on_exactly():
    params = _model(100, seed=4)
    first = _updater(T5X_CLIPPED, params)
    first.apply(make_grads(params, 0), 1.0, lambda partial: partial)
    import jax

    saved_params, saved_state = jax.tree.map(np.array, first.host_state())  # copies, as a checkpoint holds
    specs = {name: (value.shape, value.dtype) for name, value in params.items()}
    second = Updater(build_optimizer(T5X_CLIPPED["name"], T5X_CLIPPED["args"]), param_specs=specs)
    second.use_chunks(first.chunk_tensors)
    abstract = second.abstract_state()
    assert jax.tree.structure(abstract["opt_state"]) == jax.tree.structure(saved_state)
    second.restore(saved_params, saved_state)
    for updater in (first, second):
        updater.apply(make_grads(params, 1), 1.0, lambda partial: partial)
    assert max_abs_diff(_host(first), _host(second)) == 0.0


def test_chunks_of_one_program_compile_it_once():
    """640 tensors of one shape: ten chunks, one step program (and one init program), where
    compiling each chunk would take ten."""
    params = make_params(5, {f"block{i:04d}/w": (4, 3) for i in range(640)})
    _updater(ADAMW, make_params(0, {"warm/w": (2, 2)}))  # starts the counting
    before = compile_stats()["compiles"]
    updater = _updater(ADAMW, params)
    assert len(plan_chunks({n: (p.shape, p.dtype) for n, p in params.items()}, updater.chunk_tensors)) == 10
    compiled = compile_stats()["compiles"] - before
    assert compiled <= 4, compiled
    before = compile_stats()["compiles"]
    updater.apply(make_grads(params, 0), 1.0, lambda partial: partial)
    updater.apply(make_grads(params, 1), 1.0, lambda partial: partial)
    assert compile_stats()["compiles"] - before == 0


def test_chunks_of_two_parameter_groups_each_run_with_their_own_hyperparameters():
    """Same-shaped tensors in two groups of different learning rates: each chunk's program reads
    its own group's hyperparameters (chunks of the two groups must not share an executable), and
    the result equals one step over the whole tree."""
    params = make_params(9, {f"{part}/{i:03d}/w": (4, 3) for part in ("enc", "dec") for i in range(70)})
    spec = {"name": "adamw", "args": {"learning_rate": 1e-2, "weight_decay": 0.0,
                                      "param_groups": [{"tensors": [n for n in params if n.startswith("dec/")],
                                                        "learning_rate": 1e-4}]}}
    chunked, whole = _updater(spec, params), _updater(spec, params, chunk_tensors=0)
    assert chunked.chunk_tensors == CHUNK_TENSORS
    for step in range(2):
        for updater in (chunked, whole):
            updater.apply(make_grads(params, step), 1.0, lambda partial: partial)
    got = _host(chunked)
    assert max_abs_diff(got, _host(whole)) <= 1e-6
    moved = {part: max(float(np.max(np.abs(got[n] - params[n]))) for n in params if n.startswith(part))
             for part in ("enc", "dec")}
    assert moved["dec"] < 0.05 * moved["enc"], moved  # the small learning rate reached the decoder's chunks


def test_evaluation_of_chunks_of_one_program_compiles_it_once():
    """Schedule-free's evaluation parameters over 320 tensors of one shape (five chunks): one
    program, shared as the chunks' steps share theirs, not one compile per chunk."""
    import jax

    params = make_params(6, {f"block{i:04d}/w": (4, 3) for i in range(320)})
    updater = _updater(SCHEDULE_FREE, params)
    updater.apply(make_grads(params, 0), 1.0, lambda partial: partial)
    compiles = []

    def count(event: str, seconds: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        first = updater.evaluation_params()
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert len(first) == 320
    assert len(compiles) <= 1, len(compiles)
