"""Any optax optimizer by name (``optax.NAME`` / ``optax.contrib.NAME``): built through the registry it
trains exactly as optax does in process (also served over gRPC), takes schedule specs where optax
takes a schedule, refuses what is not a served optimizer or a bad option naming it, reports the
options that change between steps without recompiling, and gives schedule-free evaluation params."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest

from _service_helpers import InProcess, make_grads, make_params, max_abs_diff
from optserve.client import Client
from optserve.optim_kernels import args_for_tensors, build_optimizer
from optserve.optim_kernels.arg_rules import RuleKind
from optserve.optim_kernels.optax_catalog import optax_entry, optax_optimizer_names

SHAPES = {"w": (4, 3), "b": (3,), "v": (5,)}
STEPS = 20
F = np.float32

# name -> (args through the registry, the same optimizer written with optax)
CASES = {
    "optax.lion": ({"learning_rate": 0.01, "b1": 0.8, "weight_decay": 0.05},
                   lambda: optax.lion(0.01, b1=0.8, weight_decay=0.05)),
    "optax.contrib.ademamix": ({"learning_rate": 0.02, "b3": 0.99, "alpha": 3.0, "weight_decay": 0.01},
                               lambda: optax.contrib.ademamix(0.02, b3=0.99, alpha=3.0, weight_decay=0.01)),
    "optax.contrib.schedule_free_adamw": ({"learning_rate": 0.05, "warmup_steps": 4, "b1": 0.8},
                                          lambda: optax.contrib.schedule_free_adamw(0.05, warmup_steps=4, b1=0.8)),
}


def _run(name, args, transformation, steps=STEPS):
    """Trains the registry's optimizer and optax's side by side; returns both and the worst gap."""
    params = make_params(seed=2, shapes=SHAPES)
    served, reference = InProcess(name, args, params), InProcess(name, {}, params, transformation=transformation)
    worst = 0.0
    for step in range(steps):
        grads = make_grads(params, step, seed=4)
        worst = max(worst, max_abs_diff(served.step(grads), reference.step(grads)))
    return served, reference, worst


@pytest.mark.parametrize("name", list(CASES))
def test_an_optax_optimizer_by_name_equals_optax_in_process(name):
    args, optax_optimizer = CASES[name]
    _, reference, worst = _run(name, args, optax_optimizer())
    assert worst <= 1e-6, worst
    trained = {k: np.asarray(v) for k, v in reference.params.items()}
    assert max_abs_diff(trained, make_params(seed=2, shapes=SHAPES)) > 1e-3  # it trained


def test_schedule_free_evaluation_params_are_optax_schedule_free_eval_params():
    name = "optax.contrib.schedule_free_adamw"
    args, optax_optimizer = CASES[name]
    served, reference, _ = _run(name, args, optax_optimizer())
    evaluate = optax_entry(name).evaluation
    expected = optax.contrib.schedule_free_eval_params(reference.state, reference.params)
    got = evaluate(served.state, served.params)
    assert max_abs_diff({k: np.asarray(v) for k, v in got.items()},
                        {k: np.asarray(v) for k, v in expected.items()}) <= 1e-6
    # they are not the trained params themselves
    assert max_abs_diff({k: np.asarray(v) for k, v in got.items()},
                        {k: np.asarray(v) for k, v in served.params.items()}) > 1e-4
    assert optax_entry("optax.contrib.schedule_free_sgd").evaluation is not None
    assert optax_entry("optax.lion").evaluation is None and optax_entry("optax.adamw").evaluation is None


def test_a_schedule_spec_for_lion_learning_rate_equals_the_optax_schedule():
    spec = {"schedule": "warmup_cosine_decay_schedule", "init_value": 0.0, "peak_value": 0.02, "warmup_steps": 5,
            "decay_steps": 15, "end_value": 0.001}
    schedule = optax.schedules.warmup_cosine_decay_schedule(0.0, 0.02, 5, 15, 0.001)
    _, _, worst = _run("optax.lion", {"learning_rate": spec}, optax.lion(schedule))
    assert worst <= 1e-6, worst
    _, _, constant_gap = _run("optax.lion", {"learning_rate": 0.02}, optax.lion(schedule))
    assert constant_gap > 1e-3  # the schedule is followed, not a constant rate


@pytest.mark.parametrize("name, args, named", [
    ("optax.no_such_optimizer", {}, ["'optax.no_such_optimizer'", "no such name", "'optax.lion'"]),
    ("optax.chain", {}, ["'optax.chain'", "not an optimizer", "'optax.contrib.ademamix'"]),
    ("optax.apply_updates", {}, ["'optax.apply_updates'", "not an optimizer"]),
    ("optax.contrib.schedule_free", {"learning_rate": 0.1}, ["'optax.contrib.schedule_free'", "wraps"]),
    ("optax.contrib.prodigy", {}, ["'optax.contrib.prodigy'", "all tensors"]),
    ("optax.lion", {"learning_rate": 0.1, "momentum": 0.9}, ["'optax.lion'", "no option 'momentum'"]),
    ("optax.lion", {}, ["'optax.lion'", "'learning_rate'"]),
    ("optax.lion", {"learning_rate": float("inf")}, ["'optax.lion'", "'learning_rate'", "not finite"]),
    ("optax.contrib.ademamix", {"learning_rate": 0.1, "b3": float("nan")}, ["'optax.contrib.ademamix'", "'b3'"]),
    ("optax.lion", {"learning_rate": 0.1, "b2": float("-inf")}, ["'optax.lion'", "'b2'", "not finite"]),
    ("optax.contrib.muon", {"learning_rate": 0.1, "ns_steps": 2.5}, ["'optax.contrib.muon'", "'ns_steps'", "integer"]),
    ("optax.lion", {"learning_rate": 0.1, "b1": {"schedule": "constant_schedule", "value": 0.9}},
     ["'optax.lion'", "'b1' takes no schedule"]),
    ("optax.adamw", {"learning_rate": 0.1, "mu_dtype": "int32"}, ["'optax.adamw'", "'mu_dtype'"]),
    ("optax.contrib.galore", {"learning_rate": 0.1, "rank": 2.5}, ["'optax.contrib.galore'", "'rank'"]),
    ("optax.contrib.galore", {"learning_rate": 0.1, "base_optimizer": {"name": "adam"}},
     ["'optax.contrib.galore'", "'base_optimizer'"]),
])
def test_what_is_not_a_served_optimizer_or_a_good_option_is_refused_naming_it(name, args, named):
    with pytest.raises(ValueError) as caught:
        build_optimizer(name, args)
    for part in named:
        assert part in str(caught.value)


def test_the_catalog_serves_optimizer_constructors_only_each_with_a_rule_per_option():
    names = optax_optimizer_names()
    assert names == sorted(names) and len(set(names)) == len(names)
    assert {"optax.adam", "optax.lion", "optax.lamb", "optax.lars", "optax.adan", "optax.contrib.adopt",
            "optax.contrib.ademamix", "optax.contrib.schedule_free_adamw", "optax.contrib.schedule_free_sgd"} <= set(names)
    assert not {"optax.chain", "optax.scale", "optax.contrib.schedule_free", "optax.lookahead"} & set(names)
    for name in names:
        entry = optax_entry(name)
        assert entry is optax_entry(name)  # cached
        parameters = inspect.signature(entry.constructor).parameters
        assert entry.arg_rules.names == set(parameters), name
        required = {p: 0.01 for p, info in parameters.items() if info.default is info.empty}
        assert isinstance(build_optimizer(name, required).transformation, optax.GradientTransformation)


def test_adamw_hyperparameters_are_its_float_options_not_ints_or_bools():
    hyper = optax_entry("optax.adamw").hyperparameter_names()
    assert {"learning_rate", "eps", "weight_decay"} <= set(hyper) and not {"b1", "b2"} & set(hyper)
    assert "nesterov" not in hyper and "mu_dtype" not in hyper and "mask" not in hyper
    for name in optax_optimizer_names():
        entry = optax_entry(name)
        parameters = inspect.signature(entry.constructor).parameters
        for option in entry.hyperparameter_names():
            default = parameters[option].default
            assert entry.arg_rules[option].kind is RuleKind.REAL, (name, option)
            assert default is inspect.Parameter.empty or type(default) is float, (name, option)
    assert "warmup_steps" not in optax_entry("optax.contrib.schedule_free_adamw").hyperparameter_names()
    assert "ns_steps" not in optax_entry("optax.contrib.muon").hyperparameter_names()
    # schedule-free keeps b1 in its state from init (its evaluation params use it): not changeable
    assert "b1" not in optax_entry("optax.contrib.schedule_free_adamw").hyperparameter_names()


@pytest.mark.parametrize("name", ["optax.adamw", *CASES])
def test_hyperparameters_change_between_steps_in_one_compiled_step_as_with_numbers(name):
    """One jitted step takes the hyperparameters as values; switching them half way equals optax
    built with the numbers before and after, and compiles once."""
    base = dict(CASES.get(name, ({"learning_rate": 0.01},))[0])
    hyper = optax_entry(name).hyperparameter_names()
    assert {"learning_rate", "weight_decay"} <= set(hyper), hyper
    first = {option: base.get(option, inspect.signature(optax_entry(name).constructor).parameters[option].default)
             for option in hyper}
    second = {option: value * 0.5 for option, value in first.items()}
    fixed = {k: v for k, v in base.items() if k not in hyper}
    constructor = optax_entry(name).constructor
    traces = []

    @jax.jit
    def step(values, params, state, grads):
        traces.append(1)
        updates, state = constructor(**fixed, **values).update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params = {k: jnp.asarray(v) for k, v in make_params(seed=3, shapes=SHAPES).items()}
    traced = (params, constructor(**fixed, **{k: F(v) for k, v in first.items()}).init(params))
    plain = traced
    for i in range(6):
        values = first if i < 3 else second
        grads = make_grads(params, i, seed=5)
        traced = step({k: jnp.float32(v) for k, v in values.items()}, *traced, grads)
        tx = constructor(**fixed, **{k: F(v) for k, v in values.items()})
        updates, state = tx.update(grads, plain[1], plain[0])
        plain = (optax.apply_updates(plain[0], updates), state)
    assert len(traces) == 1
    assert max_abs_diff({k: np.asarray(v) for k, v in traced[0].items()},
                        {k: np.asarray(v) for k, v in plain[0].items()}) <= 1e-6


def test_a_mask_option_is_a_tensor_tree_restricted_to_a_shards_tensors():
    assert optax_entry("optax.lion").tensor_tree_args == ("mask",)
    args = {"learning_rate": 0.1, "mask": {"a": True, "b": False}}
    assert args_for_tensors("optax.lion", args, ["a", "b"], ["b"])["mask"] == {"b": False}


@pytest.mark.parametrize("name", list(CASES))
def test_a_session_with_an_optax_optimizer_equals_optax_in_process(server, unique_name, name):
    args, optax_optimizer = CASES[name]
    params = make_params(seed=5, shapes={"embed": (16, 12), "hidden/w": (12, 10), "hidden/b": (10,)})
    reference = InProcess(name, {}, params, transformation=optax_optimizer())
    with Client(server.address, timeout=120) as client:
        session = client.create_session(unique_name, params, optimizer={"name": name, "args": args})
        try:
            assert len(session.info.shards) == 2
            worst = 0.0
            for step in range(STEPS):
                grads = make_grads(params, step, seed=3)
                worst = max(worst, max_abs_diff(session.push_pull(grads), reference.step(grads)))
            assert worst <= 1e-6, worst
            trained = {k: np.asarray(v) for k, v in reference.params.items()}
            assert max_abs_diff(session.pull(), trained) <= 1e-6
            if name.startswith("optax.contrib.schedule_free"):  # the evaluation parameters are apart
                expected = optax.contrib.schedule_free_eval_params(reference.state, reference.params)
                evaluated = session.pull(evaluation=True)
                assert max_abs_diff(evaluated, {k: np.asarray(v) for k, v in expected.items()}) <= 1e-6
                assert max_abs_diff(evaluated, trained) > 1e-4
            else:
                assert max_abs_diff(session.pull(evaluation=True), session.pull()) == 0.0
        finally:
            session.close()
