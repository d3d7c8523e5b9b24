"""Hyperparameter values at their boundaries are served as torch.optim and optax serve them.

Every value torch.optim (for its option names: ``lr >= 0``, ``eps >= 0``, ``0 <= beta < 1``,
``weight_decay >= 0``, ``momentum >= 0``) and the reference implementations accept is accepted,
at creation and when set mid-run, with the same result: a learning rate of 0 leaves the parameters
as they are (AdamW's decoupled weight decay is scaled by it too); ``b1 = 0``, ``weight_decay = 0``
and ``momentum = 0`` step as ``torch.optim`` does. Adam's decay rates may change between steps
(a scheduler cycling ``betas``) without recompiling, a changed rate runs as torch runs it, and an
unchanged one still equals ``optax.adam`` bit for bit (it travels with its complement ``1 - b``,
see :mod:`optserve.optim_kernels.hyperparams`).

Kernel level, in process: each step is the shard's jitted step (``step_function``) with the
hyperparameters as its values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from optserve.optim_kernels import OPTIMIZERS, build_optimizer
from optserve.optim_kernels.hyperparams import complement_key, values_at
from optserve.server.compute.compile_cache import compile_stats
from optserve.server.compute.updater import Updater, step_function

SHAPES = {"w": (6, 4), "b": (4,)}

# Each optimizer at a learning rate of 0, with its other options at their defaults (those that
# need one given: their usual values; SGD with momentum, Shampoo / SOAP preconditioning at once).
AT_LR_ZERO = {
    "adam": {"learning_rate": 0.0},
    "adamw": {"learning_rate": 0.0, "weight_decay": 0.1},
    "sgd": {"learning_rate": 0.0, "momentum": 0.9, "nesterov": True},
    "adafactor": {"learning_rate": 0.0},
    "adafactor_hf": {"lr": 0.0, "relative_step": False, "weight_decay": 0.1},
    "adafactor_t2t": {"learning_rate": 0.0},
    "shampoo": {"learning_rate": 0.0, "block_size": 4, "start_preconditioning_step": 1},
    "scaled_adam": {"lr": 0.0},
    "muon": {"learning_rate": 0.0, "weight_decay": 0.1},
    "soap": {"learning_rate": 0.0, "precondition_frequency": 1},
    "delayed_nesterov": {"learning_rate": 0.0, "delay": 2},
}
LR_OPTION = {"adafactor_hf": "lr", "scaled_adam": "lr"}
# icefall's ScaledAdam keeps a momentum of steps already scaled by the learning rate (its ``delta``):
# after the rate drops to 0 the parameters go on moving by it, as in the reference.
MOMENTUM_OF_SCALED_STEPS = {"scaled_adam"}


def _params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}


def _grads(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 + step)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}


class Shard:
    """One optimizer run as a shard runs it: the jitted step, hyperparameters as its values."""

    def __init__(self, name: str, args: dict, params: dict[str, np.ndarray]):
        self.built = build_optimizer(name, args)
        self.params = {k: jnp.asarray(v) for k, v in params.items()}
        self.state = self.built.transformation.init(self.params)
        self.hyper = self.built.hyperparams
        self._step = jax.jit(step_function(self.built))

    def set(self, **values: float) -> None:
        for label, options in self.built.checked_hyperparams(values).items():
            self.hyper[label].update(options)

    def step(self, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        partial = self.built.partial_statistic
        total = np.float32(partial(grads, self.state, self.params)) if partial is not None else np.float32(0.0)
        self.params, self.state = self._step(self.params, self.state, grads, np.float32(1.0), total, self.hyper)
        return {k: np.asarray(v) for k, v in self.params.items()}


def _lr_zero_cases():
    for name in sorted(AT_LR_ZERO):
        yield pytest.param(name, id=name)


def test_every_registry_optimizer_has_a_learning_rate_zero_case():
    assert set(AT_LR_ZERO) == set(OPTIMIZERS)


@pytest.mark.parametrize("name", _lr_zero_cases())
def test_a_learning_rate_of_zero_is_accepted_and_leaves_the_parameters_unchanged(name):
    params = _params()
    shard = Shard(name, AT_LR_ZERO[name], params)
    for step in range(4):
        after = shard.step(_grads(step))
    for tensor, value in params.items():
        np.testing.assert_array_equal(after[tensor], value, err_msg=f"{name}: {tensor}")


@pytest.mark.parametrize("name", _lr_zero_cases())
def test_a_learning_rate_set_to_zero_mid_run_is_accepted_and_the_parameters_stop_moving(name):
    option = LR_OPTION.get(name, "learning_rate")
    shard = Shard(name, {**AT_LR_ZERO[name], option: 0.01}, _params())
    for step in range(2):
        moved = shard.step(_grads(step))
    assert not np.array_equal(moved["w"], _params()["w"])
    shard.set(**{option: 0.0})
    for step in range(2, 4):
        after = shard.step(_grads(step))
    if name in MOMENTUM_OF_SCALED_STEPS:  # accepted; the momentum of earlier steps still moves them
        return
    for tensor, value in moved.items():
        np.testing.assert_array_equal(after[tensor], value, err_msg=f"{name}: {tensor}")


@pytest.mark.parametrize("name, option, refused", [
    ("adamw", "learning_rate", -1e-3), ("adamw", "b1", 1.0), ("adamw", "b2", float("nan")),
    ("adamw", "weight_decay", -0.1), ("adamw", "eps", -1e-8), ("sgd", "momentum", -0.5),
    ("sgd", "learning_rate", float("inf")),
])
def test_what_torch_refuses_stays_refused_at_creation_and_mid_run(name, option, refused):
    args = {"learning_rate": 0.01, **({"momentum": 0.9} if name == "sgd" else {})}
    with pytest.raises(ValueError, match=f"'{option}'"):
        build_optimizer(name, {**args, option: refused})
    with pytest.raises(ValueError, match=f"'{option}'"):
        build_optimizer(name, args).checked_hyperparams({option: refused})


# ---------------------------------------------------------------------------- against torch.optim


def _torch_run(make, params: dict[str, np.ndarray], steps: int, before_step=None) -> dict[str, np.ndarray]:
    tensors = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in params.items()}
    optimizer = make(list(tensors.values()))
    for step in range(steps):
        if before_step is not None:
            before_step(optimizer, step)
        for name, tensor in tensors.items():
            tensor.grad = torch.from_numpy(_grads(step)[name])
        optimizer.step()
    return {k: v.detach().numpy() for k, v in tensors.items()}


def _served_run(name: str, args: dict, params: dict[str, np.ndarray], steps: int, before_step=None):
    shard = Shard(name, args, params)
    for step in range(steps):
        if before_step is not None:
            before_step(shard, step)
        after = shard.step(_grads(step))
    return after


TORCH_CASES = {
    "adamw b1=0": ("adamw", {"learning_rate": 0.01, "b1": 0.0, "weight_decay": 0.01},
                   lambda p: torch.optim.AdamW(p, lr=0.01, betas=(0.0, 0.999), weight_decay=0.01)),
    "adamw weight_decay=0": ("adamw", {"learning_rate": 0.01, "weight_decay": 0.0},
                             lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.0)),
    "adamw lr=0": ("adamw", {"learning_rate": 0.0, "weight_decay": 0.1},
                   lambda p: torch.optim.AdamW(p, lr=0.0, weight_decay=0.1)),
    "adamw b2=0 eps=0": ("adamw", {"learning_rate": 0.01, "b2": 0.0, "eps": 0.0, "weight_decay": 0.01},
                         lambda p: torch.optim.AdamW(p, lr=0.01, betas=(0.9, 0.0), eps=0.0, weight_decay=0.01)),
    "adam b1=0": ("adam", {"learning_rate": 0.01, "b1": 0.0},
                  lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.0, 0.999))),
    "sgd momentum=0": ("sgd", {"learning_rate": 0.05, "momentum": 0.0},
                       lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.0)),
    "sgd momentum=1": ("sgd", {"learning_rate": 0.05, "momentum": 1.0},
                       lambda p: torch.optim.SGD(p, lr=0.05, momentum=1.0)),
    "sgd lr=0": ("sgd", {"learning_rate": 0.0, "momentum": 0.9}, lambda p: torch.optim.SGD(p, lr=0.0, momentum=0.9)),
}


@pytest.mark.parametrize("case", list(TORCH_CASES))
def test_a_boundary_value_steps_as_torch_optim_does(case):
    name, args, make = TORCH_CASES[case]
    params = _params(seed=2)
    served = _served_run(name, args, params, steps=5)
    expected = _torch_run(make, params, steps=5)
    for tensor in params:
        np.testing.assert_allclose(served[tensor], expected[tensor], rtol=1e-6, atol=1e-6, err_msg=f"{case}: {tensor}")


# One-cycle betas: b1 falls from 0.95 to 0.85 and rises again, b2 changes once.
BETAS = [(0.95, 0.999), (0.93, 0.999), (0.9, 0.999), (0.87, 0.99), (0.85, 0.99), (0.88, 0.99), (0.92, 0.99),
         (0.95, 0.99)]


@pytest.mark.parametrize("name, make", [
    ("adamw", lambda p: torch.optim.AdamW(p, lr=0.01, betas=BETAS[0], weight_decay=0.05)),
    ("adam", lambda p: torch.optim.Adam(p, lr=0.01, betas=BETAS[0])),
], ids=["adamw", "adam"])
def test_betas_changed_at_each_step_run_as_torch_runs_them(name, make):
    params = _params(seed=3)

    def torch_betas(optimizer, step):
        optimizer.param_groups[0]["betas"] = BETAS[step]

    def served_betas(shard, step):
        shard.set(b1=BETAS[step][0], b2=BETAS[step][1])

    args = {"learning_rate": 0.01, "b1": BETAS[0][0], "b2": BETAS[0][1],
            **({"weight_decay": 0.05} if name == "adamw" else {})}
    served = _served_run(name, args, params, len(BETAS), served_betas)
    expected = _torch_run(make, params, len(BETAS), torch_betas)
    for tensor in params:
        np.testing.assert_allclose(served[tensor], expected[tensor], rtol=1e-6, atol=1e-6, err_msg=tensor)


@pytest.mark.parametrize("args, reference", [
    ({"learning_rate": 0.01}, optax.adam(0.01)),
    ({"learning_rate": 0.01, "b1": 0.8, "b2": 0.95}, optax.adam(0.01, b1=0.8, b2=0.95)),
    ({"learning_rate": 0.01, "nesterov": True}, optax.adam(0.01, nesterov=True)),
    ({"learning_rate": 0.01, "b2": 0.9999, "mu_dtype": "bfloat16"}, optax.adam(0.01, b2=0.9999, mu_dtype=jnp.bfloat16)),
], ids=["defaults", "own betas", "nesterov", "bfloat16 first moment"])
def test_unchanged_betas_equal_optax_adam_bit_for_bit(args, reference):
    params = _params(seed=4)
    shard = Shard("adam", args, params)
    state = reference.init({k: jnp.asarray(v) for k, v in params.items()})

    @jax.jit
    def step(p, s, g):
        updates, s = reference.update(g, s, p)
        return optax.apply_updates(p, updates), s

    expected = {k: jnp.asarray(v) for k, v in params.items()}
    for index in range(6):
        expected, state = step(expected, state, _grads(index))
        served = shard.step(_grads(index))
    for tensor in params:
        np.testing.assert_array_equal(served[tensor], np.asarray(expected[tensor]), err_msg=tensor)


def test_a_beta_set_back_to_its_value_runs_the_values_it_started_with():
    built = build_optimizer("adamw", {"learning_rate": 0.01, "b2": 0.999})
    start = built.hyperparams["default"]
    assert start["b2"] == 0.999 and start[complement_key("b2")] == 1.0 - 0.999  # the double-precision difference
    changed = built.checked_hyperparams({"b2": 0.95})["default"]
    assert changed == {"b2": 0.95, complement_key("b2"): 1.0 - 0.95}
    assert built.checked_hyperparams({"b2": 0.999})["default"] == {"b2": 0.999, complement_key("b2"): start["1-b2"]}


def test_a_complement_is_no_option_of_its_own_it_cannot_be_set_nor_is_it_listed():
    built = build_optimizer("adam", {"learning_rate": 0.01})
    with pytest.raises(ValueError, match="'1-b1' is not a hyperparameter that can be set"):
        built.checked_hyperparams({"1-b1": 0.2})
    options = {option for _, option, _, _ in values_at(built.groups, built.hyperparams, 0)}
    assert options == {"b1", "b2", "eps", "eps_root", "learning_rate"}


def test_changed_betas_reuse_the_compiled_update():
    params = _params(seed=5)
    optimizer = build_optimizer("adamw", {"learning_rate": 0.01})
    updater = Updater(optimizer, param_specs={k: (v.shape, v.dtype) for k, v in params.items()})
    updater.initialize(params)
    updater.apply(_grads(0), 1.0, lambda partial: partial)
    before = compile_stats()["compiles"]
    for step, (b1, b2) in enumerate(BETAS[1:4], start=1):
        updater.set_hyper(optimizer.checked_hyperparams({"b1": b1, "b2": b2}))
        updater.apply(_grads(step), 1.0, lambda partial: partial)
    assert compile_stats()["compiles"] == before
    assert updater.hyper["default"]["b1"] == BETAS[3][0]
