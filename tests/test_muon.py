"""Muon against optax.contrib.muon (optax 0.2.8), plus its AdamW labels, argument rules and pieces.

The equivalence tests run 50 jitted steps of ours (built through the registry from JSON-like
arguments) and of ``optax.contrib.muon`` with the same arguments on deterministic random
gradients, over a model with square, wide and tall matrices, 1-D tensors, a scalar, a 3-D and a
4-D tensor, and compare every step's update of every tensor (and the final params). Our kernel is
written independently (its own Newton–Schulz, shape and selection code), so agreement is
evidence, not a tautology.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers
from optserve.optim_kernels import build_optimizer
from optserve.optim_kernels.muon import (
    DEFAULT_AXES,
    MatrixAxes,
    MuonConfig,
    TensorSelection,
    coefficient_schedule,
    muon,
    orthogonalize,
)
from optserve.optim_kernels.muon.axes import matrix_view, normalize_axes
from optserve.optim_kernels.muon.newton_schulz import DION_COEFFS, STANDARD_COEFFS

STEPS = 50
RTOL = 1e-5
SHAPES = {
    "embed": (16, 12),
    "attn/qkv": (12, 36),  # wide
    "attn/out": (12, 12),  # square
    "mlp/down": (40, 12),  # tall
    "mlp/b": (40,),
    "norm/scale": (12,),
    "gain": (),
    "experts": (3, 12, 8),
    "conv": (3, 3, 4, 8),
}


def _params(shapes=SHAPES, seed=0):
    rng = np.random.default_rng(seed)
    return {name: jnp.asarray(rng.standard_normal(shape), jnp.float32) for name, shape in shapes.items()}


def _grads(step, shapes=SHAPES, seed=1):
    rng = np.random.default_rng(seed * 10_000 + step)
    return {name: jnp.asarray(rng.standard_normal(shape), jnp.float32) for name, shape in shapes.items()}


def _trajectory(tx, params, steps=STEPS):
    """(updates of each step, final params) of ``steps`` jitted steps; the gradients of the
    tensors of ``params`` are those of the whole model (:data:`SHAPES`)."""

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, updates

    state = tx.init(params)
    history = []
    for i in range(steps):
        grads = {name: g for name, g in _grads(i).items() if name in params}
        params, state, updates = step(params, state, grads)
        history.append(updates)
    return history, params


def _assert_close(got, expected, rtol=RTOL, what=""):
    """Per tensor: max |got - expected| <= rtol * max |expected| (plus a floor for all-zero tensors)."""
    assert set(got) == set(expected)
    for name in expected:
        a, b = np.asarray(got[name], np.float64), np.asarray(expected[name], np.float64)
        assert a.shape == b.shape and got[name].dtype == expected[name].dtype, name
        scale = max(float(np.max(np.abs(b), initial=0.0)), 1e-30)
        error = float(np.max(np.abs(a - b), initial=0.0))
        assert error <= rtol * scale, f"{what}{name}: max abs error {error:.3g} vs scale {scale:.3g}"


def _assert_same_trajectory(ours, theirs, params):
    got, got_params = _trajectory(ours, params)
    expected, expected_params = _trajectory(theirs, params)
    for step, (a, b) in enumerate(zip(got, expected)):
        _assert_close(a, b, what=f"step {step}: ")
    _assert_close(got_params, expected_params, what="final params: ")


# ------------------------------------------------------------------ equivalence with optax


ARG_SETS = {
    "defaults": {},
    "no_nesterov_3_steps_weight_decay": {"nesterov": False, "ns_steps": 3, "weight_decay": 0.1},
    "adaptive_consistent_rms_beta": {"adaptive": True, "consistent_rms": 0.2, "beta": 0.8},
    "aol": {"preconditioning": "aol"},
    "schatten": {"preconditioning": "schatten", "ns_steps": 4},
    "spectral": {"preconditioning": "spectral"},
    "dion_preset": {"ns_coeffs": "dion"},
    "custom_triple": {"ns_coeffs": [3.0, -3.2, 1.2], "ns_steps": 7},
    "triple_list": {"ns_coeffs": [list(row) for row in DION_COEFFS[:3]], "ns_steps": 3},
    "adam_options": {"adam_b1": 0.8, "adam_b2": 0.95, "adam_eps_root": 1e-8, "adam_weight_decay": 0.01,
                     "adam_learning_rate": 0.003, "eps": 1e-6},
    "mu_bfloat16": {"mu_dtype": "bfloat16", "weight_decay": 0.01},
}


def _optax_kwargs(args):
    kwargs = dict(args)
    if "mu_dtype" in kwargs:
        kwargs["mu_dtype"] = jnp.dtype(kwargs["mu_dtype"])
    if isinstance(kwargs.get("ns_coeffs"), list):
        kwargs["ns_coeffs"] = tuple(tuple(r) if isinstance(r, list) else r for r in kwargs["ns_coeffs"])
    return kwargs


@pytest.mark.parametrize("case", list(ARG_SETS))
def test_fifty_steps_equal_optax_contrib_muon_with_the_same_arguments(case):
    args = {"learning_rate": 0.02, **ARG_SETS[case]}
    ours = build_optimizer("muon", args).transformation
    theirs = optax.contrib.muon(**_optax_kwargs(args))
    _assert_same_trajectory(ours, theirs, _params())


def test_a_learning_rate_schedule_matches_optax_on_both_paths():
    schedule = optax.linear_schedule(0.05, 0.001, STEPS)
    adam_schedule = optax.cosine_decay_schedule(0.01, STEPS)
    ours = muon(schedule, weight_decay=0.05, adam_learning_rate=adam_schedule)
    theirs = optax.contrib.muon(schedule, weight_decay=0.05, adam_learning_rate=adam_schedule)
    _assert_same_trajectory(ours, theirs, _params())


def test_dimension_numbers_by_name_match_optax_dimension_number_trees():
    # 3-D experts: one matrix per expert (axis 0 is a batch axis); 4-D conv (kh, kw, in, out) as one
    # (kh*kw*in) x out matrix; both would take AdamW by default.
    ours = build_optimizer("muon", {
        "learning_rate": 0.02,
        "muon_weight_dimension_numbers": {
            "experts": {"reduction_axis": 1, "output_axis": -1},
            "conv": {"reduction_axis": [0, 1, 2], "output_axis": 3},
            "attn/out": None,
        },
    }).transformation
    tree = {name: MuonDimensionNumbers() if len(shape) == 2 else None for name, shape in SHAPES.items()}
    tree.update(experts=MuonDimensionNumbers(1, -1), conv=MuonDimensionNumbers((0, 1, 2), 3))
    tree["attn/out"] = None
    theirs = optax.contrib.muon(0.02, muon_weight_dimension_numbers=tree)
    _assert_same_trajectory(ours, theirs, _params())


def test_weight_decay_mask_patterns_match_an_optax_mask_tree():
    args = {"learning_rate": 0.02, "weight_decay": 0.1, "weight_decay_mask": ["attn/*"]}
    ours = build_optimizer("muon", args).transformation
    mask = {name: name.startswith("attn/") for name in SHAPES}
    theirs = optax.contrib.muon(0.02, weight_decay=0.1, weight_decay_mask=mask)
    _assert_same_trajectory(ours, theirs, _params())


# ------------------------------------------------------------------ the AdamW label


def test_a_labelled_matrix_takes_the_adamw_path_exactly_as_optax_labels_it():
    adam_args = {"adam_b1": 0.85, "adam_b2": 0.99, "adam_weight_decay": 0.01, "adam_learning_rate": 0.004}
    ours = build_optimizer("muon", {"learning_rate": 0.02, "adam_tensors": ["emb*", "*/out"], **adam_args})
    tree = {name: MuonDimensionNumbers() if len(shape) == 2 else None for name, shape in SHAPES.items()}
    tree["embed"] = tree["attn/out"] = None
    theirs = optax.contrib.muon(0.02, muon_weight_dimension_numbers=tree, **adam_args)
    params = _params()
    got, _ = _trajectory(ours.transformation, params)
    expected, _ = _trajectory(theirs, params)
    for step, (a, b) in enumerate(zip(got, expected)):
        _assert_close(a, b, rtol=1e-6, what=f"step {step}: ")

    # ... which is plain AdamW on those tensors (the same options, eps and nesterov shared) ...
    adamw = optax.adamw(0.004, b1=0.85, b2=0.99, eps=1e-8, weight_decay=0.01, nesterov=True)
    labelled = {"embed": params["embed"], "attn/out": params["attn/out"]}
    alone, _ = _trajectory(adamw, labelled)
    for step, (a, b) in enumerate(zip(got, alone)):
        _assert_close({k: a[k] for k in labelled}, b, rtol=1e-6, what=f"step {step} vs optax.adamw: ")

    # ... and not what the Muon path gives them.
    unlabelled, _ = _trajectory(build_optimizer("muon", {"learning_rate": 0.02, **adam_args}).transformation, params)
    assert not np.allclose(unlabelled[3]["embed"], got[3]["embed"], rtol=1e-2)
    _assert_close({k: v for k, v in unlabelled[3].items() if k not in labelled},
                  {k: v for k, v in got[3].items() if k not in labelled})


def test_labelled_tensors_hold_adam_moments_and_matrices_hold_muon_momentum():
    params = _params()
    state = build_optimizer("muon", {"learning_rate": 0.02, "adam_tensors": ["embed"]}).transformation.init(params)
    muon_momentum = state.inner_states["muon"].inner_state[0].mu
    adam_moments = state.inner_states["adam"].inner_state[0].mu
    assert _arrays(muon_momentum) == {"attn/qkv", "attn/out", "mlp/down"}
    assert _arrays(adam_moments) == {"embed", "mlp/b", "norm/scale", "gain", "experts", "conv"}


def _arrays(tree):
    """Names of the entries that hold arrays (the other path's entries are empty masked nodes)."""
    return {name for name, value in tree.items() if isinstance(value, jax.Array)}


def test_a_shard_holding_part_of_the_model_labels_its_tensors_as_the_whole_model_does():
    selection = MuonConfig(learning_rate=0.1, adam_tensors=["embed"]).selection
    whole = selection.labels(_params())
    part = selection.labels({k: v for k, v in _params().items() if k in ("embed", "attn/qkv", "gain")})
    assert part == {k: whole[k] for k in part}
    nested = selection.labels({"attn": {"qkv": jnp.ones((12, 36))}, "embed": jnp.ones((4, 4))})
    assert nested == {"attn": {"qkv": "muon"}, "embed": "adam"}


@pytest.mark.parametrize("mu_dtype", [None, "bfloat16"])
def test_the_state_keeps_its_structure_shapes_and_dtypes_across_an_update(mu_dtype):
    tx = build_optimizer("muon", {"learning_rate": 0.02, "mu_dtype": mu_dtype}).transformation
    params = _params()
    state = tx.init(params)
    _, new_state = jax.jit(tx.update)(_grads(0), state, params)
    assert _signature(new_state) == _signature(state)
    momentum = state.inner_states["muon"].inner_state[0].mu["attn/qkv"]
    assert momentum.dtype == (jnp.float32 if mu_dtype is None else jnp.bfloat16)


def _signature(tree):
    return jax.tree.structure(tree), [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]


# ------------------------------------------------------------------ argument rules


@pytest.mark.parametrize("args, option", [
    ({"learning_rate": float("nan")}, "learning_rate"),
    ({"learning_rate": 0.02, "beta": 1.5}, "beta"),
    ({"learning_rate": 0.02, "ns_steps": 0}, "ns_steps"),
    ({"learning_rate": 0.02, "ns_steps": 2.0}, "ns_steps"),
    ({"learning_rate": 0.02, "eps": -1.0}, "eps"),
    ({"learning_rate": 0.02, "weight_decay": float("inf")}, "weight_decay"),
    ({"learning_rate": 0.02, "adam_b2": 1.0}, "adam_b2"),
    ({"learning_rate": 0.02, "consistent_rms": 0.0}, "consistent_rms"),
    ({"learning_rate": 0.02, "nesterov": 1}, "nesterov"),
    ({"learning_rate": 0.02, "preconditioning": "qr"}, "preconditioning"),
    ({"learning_rate": 0.02, "mu_dtype": "int8"}, "mu_dtype"),
    ({"learning_rate": 0.02, "ns_coeffs": [3.4, -4.7]}, "ns_coeffs"),
    ({"learning_rate": 0.02, "ns_coeffs": [3.4, float("nan"), 2.0]}, "ns_coeffs"),
    ({"learning_rate": 0.02, "ns_coeffs": "fastest"}, "ns_coeffs"),
    ({"learning_rate": 0.02, "ns_coeffs": "dion", "ns_steps": 3}, "ns_coeffs"),
    ({"learning_rate": 0.02, "adam_tensors": "embed"}, "adam_tensors"),
    ({"learning_rate": 0.02, "adam_tensors": ["embed", 3]}, "adam_tensors"),
    ({"learning_rate": 0.02, "weight_decay_mask": [""]}, "weight_decay_mask"),
    ({"learning_rate": 0.02, "muon_weight_dimension_numbers": {"conv": {"reduction_axis": "0"}}},
     "muon_weight_dimension_numbers"),
    ({"learning_rate": 0.02, "muon_weight_dimension_numbers": {"conv": [[0, 1], []]}},
     "muon_weight_dimension_numbers"),
    ({"learning_rate": 0.02, "muon_weight_dimension_numbers": ["conv"]}, "muon_weight_dimension_numbers"),
    ({"learning_rate": 0.02, "no_such_option": 1}, "no_such_option"),
])
def test_bad_arguments_are_a_value_error_naming_the_option(args, option):
    with pytest.raises(ValueError, match=rf"muon.*'{option}'"):
        build_optimizer("muon", args)


def test_the_constructor_called_directly_refuses_with_the_registry_message():
    with pytest.raises(ValueError) as direct:
        muon(0.02, beta=1.5)
    with pytest.raises(ValueError) as registry:
        build_optimizer("muon", {"learning_rate": 0.02, "beta": 1.5})
    assert str(direct.value) == str(registry.value) == \
        "optimizer 'muon': argument 'beta' = 1.5 must satisfy 0 <= beta < 1 (one finite number)"


def test_json_arguments_of_every_option_build():
    built = build_optimizer("muon", {
        "learning_rate": 1, "ns_coeffs": [[4.0, -6.9, 2.9], [3.4445, -4.775, 2.0315]], "ns_steps": 2, "beta": 0.9,
        "eps": 1e-7, "weight_decay": 0.01, "weight_decay_mask": ["attn/*"], "mu_dtype": "float32",
        "nesterov": False, "adaptive": True, "preconditioning": "AOL", "adam_b1": 0.8, "adam_b2": 0.95,
        "adam_eps_root": 0.0, "adam_weight_decay": 0.0, "adam_learning_rate": 0.001,
        "muon_weight_dimension_numbers": {"conv": [[0, 1, 2], 3], "experts": None}, "consistent_rms": 0.2,
        "adam_tensors": ["embed"],
    })
    built.transformation.init(_params())


def test_a_tensor_whose_axes_do_not_fit_or_that_two_patterns_match_is_refused_at_init_naming_it():
    tx = muon(0.02, muon_weight_dimension_numbers={"mlp/*": {"reduction_axis": 0, "output_axis": 1}})
    with pytest.raises(ValueError, match=r"'mlp/b'.*\(40,\)"):
        tx.init(_params())
    tx = muon(0.02, muon_weight_dimension_numbers={"attn/*": None, "*/out": None})
    with pytest.raises(ValueError, match=r"'attn/out'.*several"):
        tx.init(_params())


# ------------------------------------------------------------------ the pieces


@pytest.mark.parametrize("shape", [(8, 8), (6, 20), (20, 6), (3, 5, 9)])
def test_newton_schulz_maps_singular_values_into_a_band_around_one_keeping_vectors(shape):
    x = jax.random.normal(jax.random.key(0), shape, jnp.float32)
    o = orthogonalize(x, coefficient_schedule(STANDARD_COEFFS, 5))
    assert o.shape == x.shape and o.dtype == x.dtype
    u, _, vt = np.linalg.svd(np.asarray(x, np.float64), full_matrices=False)
    so = np.linalg.svd(np.asarray(o, np.float64), compute_uv=False)
    assert np.all(so > 0.6) and np.all(so < 1.25), so
    # Same singular vectors: U^T O V is diagonal.
    core = np.swapaxes(u, -1, -2) @ np.asarray(o, np.float64) @ np.swapaxes(vt, -1, -2)
    off = core - np.einsum("...ii->...i", core)[..., None] * np.eye(core.shape[-1])
    assert np.max(np.abs(off)) < 1e-4


def test_newton_schulz_of_a_transposed_matrix_is_the_transposed_result():
    x = jax.random.normal(jax.random.key(1), (7, 19), jnp.float32)
    schedule = coefficient_schedule("standard", 5)
    np.testing.assert_allclose(orthogonalize(x.T, schedule), orthogonalize(x, schedule).T, rtol=1e-5, atol=1e-6)


def test_newton_schulz_of_zero_stays_zero():
    for preconditioning in ("frobenius", "spectral", "aol", "schatten"):
        o = orthogonalize(jnp.zeros((4, 6)), coefficient_schedule(STANDARD_COEFFS, 5), preconditioning)
        assert not np.any(np.asarray(o)), preconditioning


def test_coefficient_schedules():
    assert coefficient_schedule(STANDARD_COEFFS, 3) == (STANDARD_COEFFS,) * 3
    assert coefficient_schedule("DION", 7) == DION_COEFFS
    assert coefficient_schedule([[1, 2, 3]], 5) == ((1.0, 2.0, 3.0),)
    with pytest.raises(ValueError, match="more than ns_steps"):
        coefficient_schedule(DION_COEFFS, 4)


def test_matrix_views_round_trip_and_name_fan_in_and_fan_out():
    x = jnp.arange(2 * 3 * 4 * 5, dtype=jnp.float32).reshape(2, 3, 4, 5)
    view = matrix_view(x.shape, normalize_axes(MatrixAxes((1, 3), (-2,)), 4))
    stack = view.to_stack(x)
    assert (view.fan_in, view.fan_out) == (15, 4) and stack.shape == (2, 15, 4)
    assert float(stack[1, 2 * 5 + 3, 1]) == float(x[1, 2, 1, 3])
    np.testing.assert_array_equal(view.from_stack(stack), x)
    identity = matrix_view((6, 4), DEFAULT_AXES)
    assert identity.to_stack(jnp.ones((6, 4))).shape == (1, 6, 4)
    with pytest.raises(ValueError, match="distinct"):
        normalize_axes(MatrixAxes((0,), (-2,)), 2)


def test_selection_by_shape_then_labels_then_axes():
    selection = TensorSelection(adam_tensors=("head",), axes_rules=(("conv*", MatrixAxes((0, 1, 2), (3,))),
                                                                    ("proj", None)))
    assert selection.matrix_axes("w", (4, 5)) == DEFAULT_AXES
    assert selection.matrix_axes("head", (4, 5)) is None
    assert selection.matrix_axes("proj", (4, 5)) is None
    assert selection.matrix_axes("b", (5,)) is None and selection.matrix_axes("s", ()) is None
    assert selection.matrix_axes("k", (2, 3, 4)) is None
    assert selection.matrix_axes("conv1", (3, 3, 4, 8)) == MatrixAxes((0, 1, 2), (3,))


def test_bfloat16_params_get_bfloat16_updates_from_a_float32_orthogonalisation():
    params = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((8, 12)), jnp.bfloat16)}
    grads = {"w": jnp.asarray(np.random.default_rng(1).standard_normal((8, 12)), jnp.bfloat16)}
    tx = muon(1.0, nesterov=False)
    updates, state = tx.update(grads, tx.init(params), params)
    assert updates["w"].dtype == jnp.bfloat16 and state.inner_states["muon"].inner_state[0].mu["w"].dtype == jnp.bfloat16
    # First step without Nesterov: mu / (1 - beta) is g up to mu's bf16 rounding; NS of it in float32.
    mu = (1 - 0.95) * grads["w"]
    direction = mu.astype(jnp.float32) / (1 - 0.95 ** jnp.ones((), jnp.int32))
    orthogonal = orthogonalize(direction, coefficient_schedule(STANDARD_COEFFS, 5)).astype(jnp.bfloat16)
    expected = -(orthogonal * jnp.asarray(np.sqrt(12 / 8), jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(updates["w"], np.float32), np.asarray(expected, np.float32))
