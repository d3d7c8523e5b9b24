"""adafactor_hf against the real transformers.Adafactor (torch, CPU): params and state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from transformers.optimization import Adafactor as TorchAdafactor

from optserve.optim_kernels.adafactor import adafactor_hf
from optserve.optim_kernels.adafactor import FactoredRmsState, MomentumState

# 0-D to 4-D, with dims of size 1 in factored positions.
SHAPES = {
    "scalar": (),
    "vector": (5,),
    "matrix": (4, 6),
    "row_of_one": (1, 7),
    "col_of_one": (6, 1),
    "three_d": (2, 3, 5),
    "four_d": (2, 1, 3, 4),
}
STEPS = 50

CONFIGS = {
    "defaults_relative_step": ({}, "f32"),
    "beta1_weight_decay": ({"beta1": 0.9, "weight_decay": 0.01}, "f32"),
    "manual_lr_no_scale_with_decay": (
        {"lr": 1e-2, "relative_step": False, "scale_parameter": False, "weight_decay": 0.1},
        "f32",
    ),
    "warmup_init_beta1": ({"warmup_init": True, "beta1": 0.5}, "f32"),
    "manual_lr_scaled_clip_decay_rate": (
        {"lr": 3e-3, "relative_step": False, "clip_threshold": 0.5, "decay_rate": -0.6},
        "f32",
    ),
    "bf16_params_beta1_weight_decay": ({"beta1": 0.9, "weight_decay": 0.01}, "bf16"),
}


def _assert_close(ours, theirs, what):
    """1e-5 relative per entry; entries that cancel to near zero are held to 1e-6 of the
    tensor's largest magnitude instead (a signed EMA can pass through zero)."""
    theirs = np.asarray(theirs)
    floor = 1e-6 * float(np.max(np.abs(theirs), initial=0.0))
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-5, atol=floor, err_msg=what)


def _find(state, kind):
    return next(s for s in state if isinstance(s, kind))


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_matches_transformers_adafactor_params_and_state_for_50_steps(config):
    kwargs, dtype = CONFIGS[config]
    torch.manual_seed(0)
    rng = np.random.default_rng(1)
    jdt, tdt = (jnp.bfloat16, torch.bfloat16) if dtype == "bf16" else (jnp.float32, torch.float32)
    init = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    ref_params = {k: torch.nn.Parameter(torch.tensor(v).to(tdt)) for k, v in init.items()}
    ref = TorchAdafactor(list(ref_params.values()), **kwargs)

    tx = adafactor_hf(**kwargs)
    params = {k: jnp.asarray(v).astype(jdt) for k, v in init.items()}
    state = tx.init(params)

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for i in range(STEPS):
        grads = {k: (rng.normal(size=s) * (0.1 + i % 4)).astype(np.float32) for k, s in SHAPES.items()}
        for k, g in grads.items():
            ref_params[k].grad = torch.tensor(g).to(tdt)
        ref.step()
        params, state = step(params, state, {k: jnp.asarray(g).astype(jdt) for k, g in grads.items()})

    moments = _find(state, FactoredRmsState)
    bf16_matches = []
    for k, shape in SHAPES.items():
        assert params[k].dtype == jdt
        ours, theirs = np.asarray(params[k].astype(jnp.float32)), ref_params[k].detach().float().numpy()
        if dtype == "bf16":
            bf16_matches.append(ours == theirs)
            # Updates come back in bf16 (optax's contract). Where a step is not much smaller than
            # its param (a param crossing zero), the step itself is rounded to bf16 before the
            # add: off by one bf16 ulp of the param or of the step (steps here stay below 1% of
            # the tensor's largest entry). Elsewhere the result is bit-identical.
            step_ulp = 2.0**-8 * 0.01 * float(np.max(np.abs(theirs)))
            np.testing.assert_allclose(ours, theirs, rtol=2.0**-8, atol=step_ulp, err_msg=f"param {k}")
        else:
            _assert_close(ours, theirs, f"param {k}")
        ref_state = ref.state[ref_params[k]]
        if len(shape) >= 2:
            pairs = [(moments.v_row[k], "exp_avg_sq_row"), (moments.v_col[k], "exp_avg_sq_col")]
            assert moments.v[k] is None
        else:
            pairs = [(moments.v[k], "exp_avg_sq")]
        if "beta1" in kwargs:
            pairs.append((_find(state, MomentumState).m[k], "exp_avg"))
        for ours, name in pairs:
            theirs = ref_state[name].float().numpy()
            assert ours.shape == theirs.shape, (k, name)
            _assert_close(ours, theirs, f"{k} {name}")
    if bf16_matches:
        assert np.mean(np.concatenate([m.ravel() for m in bf16_matches])) > 0.95


@pytest.mark.parametrize(
    "kwargs, option",
    [
        ({"lr": 1e-3}, "relative_step"),
        ({"warmup_init": True, "relative_step": False, "lr": 1e-3}, "warmup_init"),
        ({"relative_step": False}, "lr"),
        ({"beta1": 1.5}, "beta1"),
        ({"eps": 1e-30}, "eps"),
    ],
)
def test_invalid_option_combinations_raise_value_error_naming_the_option(kwargs, option):
    with pytest.raises(ValueError, match=option):
        adafactor_hf(**kwargs)


def test_reference_rejects_the_same_combinations_we_reject():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError):
        TorchAdafactor(p, lr=1e-3)
    with pytest.raises(ValueError):
        TorchAdafactor(p, lr=1e-3, relative_step=False, warmup_init=True)
