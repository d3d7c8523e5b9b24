"""Optimizer arguments are checked by value (shape, finiteness, documented range) when built.

Each registry entry declares one rule per constructor option (:mod:`optserve.optim_kernels.arg_rules`);
:func:`build_optimizer` refuses a value that breaks its rule with a ``ValueError`` naming the
optimizer, the option, the value and the rule. For every rule with a range, :data:`BOUNDARIES`
holds one accepted value at the boundary and one refused value just past it, both built through
the registry (so the constructor accepts the boundary too).
"""

from __future__ import annotations

import inspect
import math

import jax.numpy as jnp
import numpy as np
import pytest

from optserve.optim_kernels import OPTIMIZERS, build_optimizer, optimizer_names
from optserve.optim_kernels import arg_rules as rules
from optserve.optim_kernels.arg_rules import ArgumentRuleError, RuleKind

# Smallest arguments that build each optimizer (options without a usable default).
BASE = {
    "adam": {"learning_rate": 0.1},
    "adamw": {"learning_rate": 0.1},
    "sgd": {"learning_rate": 0.1},
    "adafactor": {"learning_rate": 0.1},
    "adafactor_hf": {"lr": 0.01, "relative_step": False},
    "adafactor_t2t": {},
    "shampoo": {"learning_rate": 0.1},
    "scaled_adam": {},
    "muon": {"learning_rate": 0.1},
    "soap": {},
    "delayed_nesterov": {"learning_rate": 0.1, "delay": 1},
}

TINY = 1e-30  # accepted where the rule is "> 0": the boundary itself (0) is refused

# (optimizer, option, accepted at the boundary, refused just past it, the rule as the message states it)
BOUNDARIES = [
    # optax baselines
    ("adam", "learning_rate", 0.0, -1e-8, "learning_rate >= 0"),
    ("adam", "b1", 0.0, 1.0, "0 <= b1 < 1"),
    ("adam", "b1", 0.999, 1.5, "0 <= b1 < 1"),
    ("adam", "b2", 0.0, 1.0, "0 <= b2 < 1"),
    ("adam", "b2", 0.5, -0.1, "0 <= b2 < 1"),
    ("adam", "eps", 0.0, -1e-8, "eps >= 0"),
    ("adam", "eps_root", 0.0, -1e-8, "eps_root >= 0"),
    ("adamw", "learning_rate", 0.0, -0.1, "learning_rate >= 0"),
    ("adamw", "b1", 0.0, 1.0, "0 <= b1 < 1"),
    ("adamw", "b2", 0.0, 1.0, "0 <= b2 < 1"),
    ("adamw", "eps", 0.0, -1e-8, "eps >= 0"),
    ("adamw", "eps_root", 0.0, -1e-8, "eps_root >= 0"),
    ("adamw", "weight_decay", 0.0, -1e-4, "weight_decay >= 0"),
    ("sgd", "learning_rate", 0.0, -1e-8, "learning_rate >= 0"),
    ("sgd", "momentum", 0.0, -1e-8, "momentum >= 0"),
    ("sgd", "momentum", None, -0.5, "momentum >= 0"),
    # adafactor (T5X)
    ("adafactor", "learning_rate", 0.0, -1e-8, "learning_rate >= 0"),
    ("adafactor", "beta1", 0.0, 1.0, "0 <= beta1 < 1"),
    ("adafactor", "decay_rate", 0.0, -0.1, "decay_rate >= 0"),
    ("adafactor", "step_offset", 0, -1, "step_offset >= 0"),
    ("adafactor", "clipping_threshold", TINY, 0.0, "clipping_threshold > 0"),
    ("adafactor", "clipping_threshold", None, -1.0, "clipping_threshold > 0"),
    ("adafactor", "weight_decay_rate", 0.0, -0.01, "weight_decay_rate >= 0"),
    ("adafactor", "min_dim_size_to_factor", 0, -1, "min_dim_size_to_factor >= 0"),
    ("adafactor", "epsilon1", TINY, 0.0, "epsilon1 > 0"),
    ("adafactor", "epsilon2", 0.0, -1e-3, "epsilon2 >= 0"),
    ("adafactor", "weight_decay_rate_lr_exponent", -2.0, math.inf, "weight_decay_rate_lr_exponent is finite"),
    ("adafactor", "global_norm_clip_threshold", TINY, 0.0, "global_norm_clip_threshold > 0"),
    ("adafactor", "max_parameter_scale", TINY, 0.0, "max_parameter_scale > 0"),
    # adafactor (HuggingFace)
    ("adafactor_hf", "lr", 0.0, -1e-8, "lr >= 0"),
    ("adafactor_hf", "eps", [TINY, 0.0], [0.0, 1e-3], "eps[0] > 0 and eps[1] >= 0"),
    ("adafactor_hf", "eps", (TINY, 0.0), [TINY, -1e-3], "eps[0] > 0 and eps[1] >= 0"),
    ("adafactor_hf", "clip_threshold", TINY, 0.0, "clip_threshold > 0"),
    ("adafactor_hf", "decay_rate", 0.0, 0.1, "decay_rate <= 0"),
    ("adafactor_hf", "beta1", 0.0, 1.0, "0 <= beta1 < 1"),
    ("adafactor_hf", "weight_decay", 0.0, -0.1, "weight_decay >= 0"),
    # adafactor (tensor2tensor)
    ("adafactor_t2t", "learning_rate", 0.0, -1e-8, "learning_rate >= 0"),
    ("adafactor_t2t", "decay_rate", 0.0, 1.0, "0 <= decay_rate < 1"),
    ("adafactor_t2t", "beta1", 0.0, 1.0, "0 <= beta1 < 1"),
    ("adafactor_t2t", "clipping_threshold", TINY, 0.0, "clipping_threshold > 0"),
    ("adafactor_t2t", "beta2", 0.0, 1.0, "0 <= beta2 < 1"),
    ("adafactor_t2t", "memory_exponent", 0.0, -0.8, "memory_exponent >= 0"),
    ("adafactor_t2t", "rounding_seed", 0, -1, "0 <= rounding_seed < 9223372036854775808"),
    ("adafactor_t2t", "rounding_seed", 2**63 - 1, 2**63, "0 <= rounding_seed < 9223372036854775808"),
    # shampoo
    ("shampoo", "learning_rate", 0.0, -1e-8, "learning_rate >= 0"),
    ("shampoo", "block_size", 0, -1, "block_size >= 0"),
    ("shampoo", "beta1", 0.0, 1.0, "0 <= beta1 < 1"),
    ("shampoo", "beta2", 1.0, 1.5, "0 <= beta2 <= 1"),
    ("shampoo", "beta2", 0.0, -0.1, "0 <= beta2 <= 1"),
    ("shampoo", "diagonal_epsilon", 0.0, -1e-10, "diagonal_epsilon >= 0"),
    ("shampoo", "matrix_epsilon", 0.0, -1e-6, "matrix_epsilon >= 0"),
    ("shampoo", "weight_decay", 0.0, -0.1, "weight_decay >= 0"),
    ("shampoo", "start_preconditioning_step", 0, -1, "start_preconditioning_step >= 0"),
    ("shampoo", "preconditioning_compute_steps", 1, 0, "preconditioning_compute_steps >= 1"),
    ("shampoo", "statistics_compute_steps", 1, 0, "statistics_compute_steps >= 1"),
    ("shampoo", "exponent_override", 0, -1, "exponent_override >= 0"),
    ("shampoo", "inverse_failure_threshold", TINY, 0.0, "inverse_failure_threshold > 0"),
    ("shampoo", "skip_preconditioning_dim_size_gt", 1, 0, "skip_preconditioning_dim_size_gt >= 1"),
    ("shampoo", "clip_by_scaled_gradient_norm", TINY, 0.0, "clip_by_scaled_gradient_norm > 0"),
    ("shampoo", "merge_small_dims_block_size", 1, 0, "merge_small_dims_block_size >= 1"),
    ("shampoo", "root_num_iters", 1, 0, "root_num_iters >= 1"),
    # scaled_adam
    ("scaled_adam", "lr", 0.0, -1e-8, "lr >= 0"),
    ("scaled_adam", "clipping_scale", TINY, 0.0, "clipping_scale > 0"),
    ("scaled_adam", "betas", [0.0, 0.0], [0.9, 1.0], "0 <= betas[0] < 1 and 0 <= betas[1] < 1"),
    ("scaled_adam", "betas", (0.999, 0.999), [-0.1, 0.98], "0 <= betas[0] < 1 and 0 <= betas[1] < 1"),
    ("scaled_adam", "scalar_lr_scale", 0.0, -0.1, "scalar_lr_scale >= 0"),
    ("scaled_adam", "eps", TINY, 0.0, "eps > 0"),
    ("scaled_adam", "param_min_rms", 0.0, -1e-5, "param_min_rms >= 0"),
    ("scaled_adam", "scalar_max", TINY, 0.0, "scalar_max > 0"),
    ("scaled_adam", "size_update_period", 1, 0, "size_update_period >= 1"),
    ("scaled_adam", "clipping_update_period", 1, 0, "clipping_update_period >= 1"),
    # muon
    ("muon", "learning_rate", 0.0, -1e-8, "learning_rate >= 0"),
    ("muon", "ns_steps", 1, 0, "ns_steps >= 1"),
    ("muon", "beta", 0.0, 1.0, "0 <= beta < 1"),
    ("muon", "eps", 0.0, -1e-8, "eps >= 0"),
    ("muon", "weight_decay", 0.0, -0.1, "weight_decay >= 0"),
    ("muon", "adam_b1", 0.0, 1.0, "0 <= adam_b1 < 1"),
    ("muon", "adam_b2", 0.0, 1.0, "0 <= adam_b2 < 1"),
    ("muon", "adam_eps_root", 0.0, -1e-8, "adam_eps_root >= 0"),
    ("muon", "adam_weight_decay", 0.0, -0.1, "adam_weight_decay >= 0"),
    ("muon", "adam_learning_rate", 0.0, -1e-8, "adam_learning_rate >= 0"),
    ("muon", "adam_learning_rate", None, -0.1, "adam_learning_rate >= 0"),
    ("muon", "consistent_rms", TINY, 0.0, "consistent_rms > 0"),
    # soap
    ("soap", "learning_rate", 0.0, -1e-8, "learning_rate >= 0"),
    ("soap", "betas", [0.0, 0.0], [0.95, 1.0], "0 <= betas[0] < 1 and 0 <= betas[1] < 1"),
    ("soap", "betas", (0.999, 0.999), [-0.1, 0.95], "0 <= betas[0] < 1 and 0 <= betas[1] < 1"),
    ("soap", "shampoo_beta", 0.0, 1.0, "0 <= shampoo_beta < 1"),
    ("soap", "shampoo_beta", None, -0.1, "0 <= shampoo_beta < 1"),
    ("soap", "weight_decay", 0.0, -0.01, "weight_decay >= 0"),
    ("soap", "precondition_frequency", 1, 0, "precondition_frequency >= 1"),
    ("soap", "max_precondition_dim", 1, 0, "max_precondition_dim >= 1"),
    ("soap", "eps", 0.0, -1e-8, "eps >= 0"),
    # delayed_nesterov (BASE has delay 1, so momentum_activation's own upper end, 1, is also 1 / delay)
    ("delayed_nesterov", "learning_rate", 0.0, -1e-8, "learning_rate >= 0"),
    ("delayed_nesterov", "momentum", 0.0, 1.0, "0 <= momentum < 1"),
    ("delayed_nesterov", "delay", 1, 0, "delay >= 1"),
    ("delayed_nesterov", "momentum_activation", 0.0, -0.1, "0 <= momentum_activation <= 1"),
    ("delayed_nesterov", "momentum_activation", 1.0, 1.5, "0 <= momentum_activation <= 1"),
]


def _ids(cases):
    return [f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(cases)]


def _refusal(name, args):
    with pytest.raises(ValueError) as info:
        build_optimizer(name, args)
    return info.value


def _assert_names(error, name, option, value, rule_text):
    message = str(error)
    assert f"optimizer {name!r}" in message, message
    assert f"argument {option!r}" in message, message
    assert f"= {value!r}" in message, message
    assert rule_text in message, message


# ------------------------------------------------------------------------- the tables


def test_every_entry_declares_one_rule_per_constructor_option():
    for name, entry in OPTIMIZERS.items():
        options = set(inspect.signature(entry.constructor).parameters)
        assert entry.arg_rules.names == options, (name, entry.arg_rules.names ^ options)


def test_every_default_satisfies_its_own_rule():
    for name, entry in OPTIMIZERS.items():
        for option, parameter in inspect.signature(entry.constructor).parameters.items():
            if parameter.default is not parameter.empty:
                error = entry.arg_rules[option].error(name, parameter.default)
                assert error is None, error


@pytest.mark.parametrize("name", optimizer_names())
def test_every_optimizer_builds_with_every_default_given_explicitly(name):
    entry = OPTIMIZERS[name]
    defaults = {option: p.default for option, p in inspect.signature(entry.constructor).parameters.items()
                if p.default is not p.empty}
    built = build_optimizer(name, {**defaults, **BASE[name]})
    built.transformation.init({"w": jnp.ones((3, 2))})


def test_every_range_rule_has_a_boundary_case():
    covered = {(name, option) for name, option, *_ in BOUNDARIES}
    ranged = {(name, rule.name) for name, entry in OPTIMIZERS.items() for rule in entry.arg_rules
              if rule.kind in (RuleKind.REAL, RuleKind.INT, RuleKind.PAIR) and rule.name not in ("param_max_rms",)}
    assert ranged - covered == set()


# ------------------------------------------------------------------------- boundaries


@pytest.mark.parametrize("name, option, accepted, refused, rule_text", BOUNDARIES, ids=_ids(BOUNDARIES))
def test_the_boundary_value_builds_and_the_value_past_it_is_refused_naming_option_value_and_rule(
        name, option, accepted, refused, rule_text):
    build_optimizer(name, {**BASE[name], option: accepted})
    error = _refusal(name, {**BASE[name], option: refused})
    assert isinstance(error, ArgumentRuleError)
    _assert_names(error, name, option, refused, rule_text)
    assert (error.optimizer, error.argument, error.value) == (name, option, refused)


def test_scaled_adam_param_max_rms_boundary_is_zero_and_not_below_param_min_rms():
    build_optimizer("scaled_adam", {"param_min_rms": 0.0, "param_max_rms": 0.0})
    _assert_names(_refusal("scaled_adam", {"param_min_rms": 0.0, "param_max_rms": -1.0}),
                  "scaled_adam", "param_max_rms", -1.0, "param_max_rms >= 0")
    with pytest.raises(ValueError, match="param_max_rms.*param_min_rms"):
        build_optimizer("scaled_adam", {"param_min_rms": 0.5, "param_max_rms": 0.25})


# The constructors check the same tables when called directly (their own message style).
DIRECT = [case for case in BOUNDARIES if case[0] in ("adafactor", "adafactor_hf", "adafactor_t2t", "shampoo",
                                                     "scaled_adam")]


@pytest.mark.parametrize("name, option, accepted, refused, rule_text", DIRECT, ids=_ids(DIRECT))
def test_constructors_called_directly_refuse_the_same_values(name, option, accepted, refused, rule_text):
    constructor = OPTIMIZERS[name].constructor
    constructor(**{**BASE[name], option: accepted})
    with pytest.raises(ValueError, match=rf"'{option}'.*{_re(rule_text)}"):
        constructor(**{**BASE[name], option: refused})


def _re(text):
    import re

    return re.escape(text)


# ------------------------------------------------------------------------- the issue's cases


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name, option", [("adam", "learning_rate"), ("sgd", "learning_rate"),
                                          ("adafactor_hf", "lr"), ("shampoo", "learning_rate"),
                                          ("scaled_adam", "lr"), ("adafactor", "learning_rate")])
def test_a_non_finite_learning_rate_is_refused(name, option, value):
    error = _refusal(name, {**BASE[name], option: value})
    _assert_names(error, name, option, value, f"{option} >= 0")
    assert "not finite" in str(error)


@pytest.mark.parametrize("value, shape_words", [
    ([1, 2], "a list of 2 items"),
    ([0.1], "a list of 1 items"),
    (np.array([0.1, 0.2]), "an array of shape (2,)"),
    (np.ones((1, 1)), "an array of shape (1, 1)"),
])
def test_a_list_or_array_for_a_scalar_option_is_refused(value, shape_words):
    error = _refusal("adam", {"learning_rate": value})
    assert "argument 'learning_rate'" in str(error) and shape_words in str(error), str(error)
    error = _refusal("adam", {"learning_rate": 0.1, "b2": value})
    assert "argument 'b2'" in str(error) and shape_words in str(error), str(error)


def test_adam_b1_of_1_5_is_refused_with_the_rule():
    error = _refusal("adam", {"learning_rate": 0.1, "b1": 1.5})
    assert str(error) == "optimizer 'adam': argument 'b1' = 1.5 must satisfy 0 <= b1 < 1 (one finite number)"


def test_scalars_of_other_number_types_and_schedules_are_accepted():
    build_optimizer("adam", {"learning_rate": np.float32(0.1), "b1": np.asarray(0.9), "b2": jnp.asarray(0.99)})
    build_optimizer("adam", {"learning_rate": 1})
    build_optimizer("adam", {"learning_rate": lambda count: 0.1})
    build_optimizer("shampoo", {"learning_rate": lambda count: 0.1, "block_size": np.int64(4)})
    build_optimizer("adafactor_t2t", {"decay_rate": lambda count: 0.5, "decay_type": "ADAM"})


def test_a_bool_is_not_a_number_and_a_number_is_not_a_bool():
    error = _refusal("adam", {"learning_rate": True})
    assert "argument 'learning_rate'" in str(error) and "got a bool" in str(error)
    error = _refusal("sgd", {"learning_rate": 0.1, "nesterov": 1})
    _assert_names(error, "sgd", "nesterov", 1, "nesterov is true or false")


def test_an_integer_option_refuses_a_float_even_when_whole():
    error = _refusal("shampoo", {"learning_rate": 0.1, "block_size": 4.0})
    _assert_names(error, "shampoo", "block_size", 4.0, "block_size >= 0 (an integer)")


@pytest.mark.parametrize("name, option, refused, rule_text", [
    ("adafactor_t2t", "decay_type", "lion", "decay_type is one of 'pow', 'adam'"),
    ("adafactor", "dtype_momentum", "int32", "dtype_momentum is a floating-point dtype"),
    ("adafactor", "dtype_momentum", "not_a_dtype", "dtype_momentum is a floating-point dtype"),
    ("adam", "mu_dtype", "int8", "mu_dtype is a floating-point dtype"),
    ("sgd", "accumulator_dtype", "uint8", "accumulator_dtype is a floating-point dtype"),
    ("scaled_adam", "show_dominant_parameters", 0, "show_dominant_parameters is true or false"),
    ("shampoo", "nesterov", 1, "nesterov is true or false"),
    ("adafactor_hf", "eps", [1e-30], "eps is a pair"),
    ("adafactor_hf", "eps", [1e-30, 1e-3, 1.0], "eps is a pair"),
    ("scaled_adam", "betas", [0.9, float("nan")], "betas is a pair"),
])
def test_choices_dtypes_flags_and_pairs_refuse_naming_option_value_and_rule(name, option, refused, rule_text):
    _assert_names(_refusal(name, {**BASE[name], option: refused}), name, option, refused, rule_text)


def test_accepted_choices_dtypes_and_none():
    build_optimizer("adafactor_t2t", {"decay_type": "adam"})
    build_optimizer("adafactor", {"learning_rate": 0.1, "dtype_momentum": "bfloat16", "beta1": None,
                                  "clipping_threshold": None})
    build_optimizer("adam", {"learning_rate": 0.1, "mu_dtype": None})
    build_optimizer("adam", {"learning_rate": 0.1, "mu_dtype": "bfloat16"})
    build_optimizer("sgd", {"learning_rate": 0.1, "momentum": None, "accumulator_dtype": "float32"})
    build_optimizer("scaled_adam", {"clipping_scale": None})
    build_optimizer("shampoo", {"learning_rate": 0.1, "merge_small_dims_block_size": None,
                                "clip_by_scaled_gradient_norm": None})


def test_none_is_refused_where_the_option_has_no_off_value():
    error = _refusal("shampoo", {"learning_rate": 0.1, "beta1": None})
    assert "'beta1'" in str(error)


# ------------------------------------------------------------------------- the rule module itself


def test_rule_descriptions():
    assert rules.positive("lr", schedule=True).describe() == "lr > 0 (one finite number, or a schedule)"
    assert rules.unit_interval("b", none=True, schedule=True).describe() == \
        "0 <= b < 1 (one finite number, a schedule, or None)"
    assert rules.integer("n", 1, none=True).describe() == "n >= 1 (an integer, or None)"
    assert rules.real("x", high=0).describe() == "x <= 0 (one finite number)"
    assert rules.real("x").describe() == "x is finite (one finite number)"
    assert rules.pair("p", rules.positive("p[0]"), rules.non_negative("p[1]")).describe() == \
        "p is a pair of finite numbers with p[0] > 0 and p[1] >= 0"


def test_a_schedule_is_refused_where_the_rule_does_not_admit_one():
    assert rules.unit_interval("b1").violation(lambda count: 0.5) is not None
    assert rules.positive("lr", schedule=True).violation(lambda count: 0.5) is None


def test_a_table_refuses_two_rules_for_one_option():
    with pytest.raises(ValueError, match="'x'"):
        rules.ArgRules(rules.flag("x"), rules.positive("x"))


def test_a_long_value_is_shortened_in_the_message():
    error = _refusal("adam", {"learning_rate": list(range(1000))})
    assert len(str(error)) < 400 and "..." in str(error)
