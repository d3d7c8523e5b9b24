"""Sessions with the same tensor structure and optimizer share one compiled update.

Compilations are counted with JAX's own monitoring events (one per XLA compilation), in this
process for the updater and in the shard actor's process for a real server.
"""

from __future__ import annotations

import numpy as np
import pytest

from optserve.client import Client
from optserve.optim_kernels import build_optimizer
from optserve.server.compute import compile_cache
from optserve.server.compute.compile_cache import compile_stats
from optserve.server.compute.updater import Updater

from _service_helpers import InProcess, make_grads, make_params

ADAFACTOR = {"name": "adafactor_hf", "args": {"lr": 1e-2, "scale_parameter": False, "relative_step": False}}
T5X = {"name": "adafactor", "args": {"learning_rate": 1e-2, "clipping_threshold": 1.0}}  # a cross-shard statistic


def _compiles() -> int:
    return compile_stats()["compiles"]


def _run(spec: dict, params: dict, steps: int) -> dict:
    updater = Updater(build_optimizer(spec["name"], spec["args"]))
    updater.initialize(params)
    for step in range(steps):
        updater.apply(make_grads(params, step), 1.0, lambda partial: partial)
    return {name: np.array(value) for name, value in updater.host_params().items()}


@pytest.mark.parametrize("spec", [ADAFACTOR, T5X], ids=lambda s: s["name"])
def test_first_updater_compiles_when_initialized_so_its_first_step_compiles_nothing(spec):
    params = make_params(seed=6, shapes={f"{spec['name']}/ahead/w": (5, 7)})
    updater = Updater(build_optimizer(spec["name"], spec["args"]))
    before = _compiles()
    updater.initialize(params)
    assert _compiles() - before >= 2, "init and step compiled at initialization"
    before = _compiles()
    updater.apply(make_grads(params, 0), 1.0, lambda partial: partial)
    updater.apply(make_grads(params, 1), 1.0, lambda partial: partial)
    assert _compiles() - before == 0
    reference = InProcess(spec["name"], spec["args"], params)
    reference.step(make_grads(params, 0))
    expected = reference.step(make_grads(params, 1))
    np.testing.assert_allclose(updater.host_params()[f"{spec['name']}/ahead/w"], expected[f"{spec['name']}/ahead/w"],
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["adam", "shampoo"])
def test_the_step_compiles_once_the_state_init_makes_being_the_state_a_step_returns(name):
    """init's state has the step's types and placement, so initialize compiles init and one step
    program (it compiled the step twice: for init's uncommitted state, then for the step's)."""
    args = {"learning_rate": 1e-2, **({"block_size": 4} if name == "shampoo" else {})}
    params = make_params(seed=8, shapes={f"{name}/once/w": (6, 9), f"{name}/once/b": (9,)})
    updater = Updater(build_optimizer(name, args))
    before = _compiles()
    updater.initialize(params)
    assert _compiles() - before == 2, "init and one step program"
    before = _compiles()
    for step in range(3):
        updater.apply(make_grads(params, step), 1.0, lambda partial: partial)
    assert _compiles() - before == 0


@pytest.mark.parametrize("name", ["adam", "shampoo"])
def test_the_step_a_shard_compiles_to_measure_its_working_memory_is_the_one_its_steps_run(name):
    """At create a shard compiles the step abstractly for its memory figure: initialize then
    compiles only init, and the steps nothing."""
    args = {"learning_rate": 1e-2, **({"block_size": 4} if name == "shampoo" else {})}
    params = make_params(seed=9, shapes={f"{name}/measured/w": (7, 9), f"{name}/measured/b": (9,)})
    specs = {key: (value.shape, value.dtype) for key, value in params.items()}
    updater = Updater(build_optimizer(name, args), param_specs=specs)
    before = _compiles()
    working = updater.step_working_bytes()
    assert working is not None and working >= 0 and _compiles() - before == 1, "the step, once"
    before = _compiles()
    updater.initialize(params)
    assert _compiles() - before == 1, "init only: the step compiled already"
    before = _compiles()
    for step in range(3):
        updater.apply(make_grads(params, step), 1.0, lambda partial: partial)
    assert _compiles() - before == 0


@pytest.mark.parametrize("spec", [ADAFACTOR, T5X], ids=lambda s: s["name"])
def test_second_updater_with_same_structure_and_optimizer_compiles_nothing(spec):
    params = make_params(seed=3, shapes={f"{spec['name']}/sharing/w": (7, 5), "b": (5,)})
    reference = InProcess(spec["name"], spec["args"], params)
    expected = [reference.step(make_grads(params, step)) for step in range(3)][-1]
    Updater(build_optimizer(spec["name"], spec["args"]))  # starts the counting
    before = _compiles()
    first = _run(spec, params, 3)
    compiled = _compiles() - before
    assert compiled >= 2, "the first updater compiles its init and step"
    before = _compiles()
    second = _run(spec, params, 3)
    assert _compiles() - before == 0, "the second updater reused the first one's compiled update"
    for result in (first, second):
        for name in params:
            np.testing.assert_allclose(result[name], expected[name], rtol=0, atol=1e-6, err_msg=name)


def test_other_shapes_compile_their_own_step_and_other_option_values_give_their_own_results():
    """A learning rate is an argument of the step, not part of its program: a session with
    another one runs the same executable (found by its text), with its own rate."""
    params = make_params(seed=4, shapes={"options/w": (6, 3)})
    other_lr = {"name": "adafactor_hf", "args": dict(ADAFACTOR["args"], lr=5e-2)}
    _run(ADAFACTOR, params, 1)
    before = _compiles()
    _run(ADAFACTOR, make_params(seed=4, shapes={"options/w": (6, 4)}), 2)
    assert _compiles() - before >= 2, "init and step of the new shape"
    result = _run(other_lr, params, 2)
    expected = InProcess(other_lr["name"], other_lr["args"], params)
    expected.step(make_grads(params, 0))
    np.testing.assert_allclose(result["options/w"], expected.step(make_grads(params, 1))["options/w"],
                               rtol=0, atol=1e-6)


def test_compiled_programs_are_bounded_least_recently_used_first():
    cache = compile_cache.Executables(capacity=3)
    lowered = []

    class Lowered:  # what ``jax.jit(f).lower(...)`` gives, for a program whose text is its key
        def __init__(self, key):
            self.key = key

        def as_text(self, debug_info=True):
            return self.key

        def compile(self):
            return f"program {self.key}"

    # each program is filed under its structure and its text's hash: three entries hold one and a half
    for key in ["a", "b", "a", "c", "b"]:
        cache.compiled_for(("structure", key), lambda: lowered.append(key) or Lowered(key))
    assert lowered == ["a", "b", "c", "b"]  # "b" was the least recently used when "c" came
    assert cache.stats() == {"entries": 3, "hits": 1, "misses": 4} and cache.compiles == 4


@pytest.fixture(scope="module")
def one_shard_server(ray_local):
    """One shard, so every session of a structure lands on the same process."""
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig

    running = start_server(ServerConfig(host="127.0.0.1", port=0, shards=1))
    yield running
    running.stop()


def _shard_compiles(server) -> dict:
    import ray

    return ray.get(server.fleet.actors[0].compile_stats.remote())


@pytest.mark.parametrize("spec", [ADAFACTOR, T5X], ids=lambda s: s["name"])
def test_new_session_with_same_structure_steps_without_compiling_on_the_shard(one_shard_server, unique_name, spec):
    client = Client(one_shard_server.address)
    params = make_params(seed=5, shapes={f"{unique_name}/w": (9, 4), "b": (4,)})  # a structure no other test has
    reference = InProcess(spec["name"], spec["args"], params)
    expected = [reference.step(make_grads(params, step)) for step in range(3)]
    at_create, in_steps, trajectories = [], [], []
    try:
        for index in range(2):
            before = _shard_compiles(one_shard_server)["compiles"]
            session = client.create_session(f"{unique_name}-{index}", params, optimizer=spec)
            created = _shard_compiles(one_shard_server)["compiles"]
            trajectories.append([session.push_pull(make_grads(params, step)) for step in range(3)])
            at_create.append(created - before)
            in_steps.append(_shard_compiles(one_shard_server)["compiles"] - created)
            session.close()
        # the first session compiles when it is created (ahead of its first step); the second never
        assert at_create[0] >= 2 and at_create[1] == 0 and in_steps == [0, 0], (at_create, in_steps)
        for step in range(3):
            for name in params:  # the shared executable gives the second session the first one's bits
                np.testing.assert_array_equal(trajectories[1][step][name], trajectories[0][step][name], err_msg=name)
                np.testing.assert_allclose(trajectories[1][step][name], expected[step][name], rtol=0, atol=1e-6)
    finally:
        client.close()


def _anonymous_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon"))


def test_a_shard_hands_back_the_memory_compiling_a_sessions_step_freed(one_shard_server, unique_name):
    """Compiling Shampoo's blocked step (roots inside it: this server has no preconditioner
    workers) frees several times the code it keeps; a shard keeps up to 1 GiB of free heap between
    steps (``heap.keep_large_buffers_on_heap``), so without a trim after the compile that memory
    stayed resident for as long as nothing else trimmed (here the shard grew by 560 MB, 170 with it)."""
    shampoo = {"name": "shampoo", "args": {"learning_rate": 1e-2}}
    pid = one_shard_server.fleet.pids()[0]
    with Client(one_shard_server.address) as client:
        client.create_session(f"{unique_name}-warm", make_params(seed=2, shapes={"w": (256, 256)}),
                              optimizer=shampoo).close()  # the runtime's first costs; a close trims
        before = _anonymous_bytes(pid)
        params = make_params(seed=3, shapes={"a": (1024, 1024), "b": (1024, 1024)})  # 2 x 16 blocks of 256
        session = client.create_session(unique_name, params, optimizer=shampoo)
        grown = _anonymous_bytes(pid) - before
        session.close()
    # what the part holds: parameters, statistics, roots, momentum, grafting (7 copies of 8 MB),
    # a gradient buffer, the compiled step (about 36 MB: bench/code_size.py), the runtime's caches
    assert grown < 280e6, f"the shard's anonymous memory grew by {grown / 1e6:.0f} MB at create"
