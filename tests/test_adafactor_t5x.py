"""T5X adafactor: vs optax.adafactor (heuristic case), factor rules, sharded global norm, options."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from optserve.optim_kernels import build_optimizer
from optserve.optim_kernels.adafactor import adafactor, adafactor_partial_statistic
from optserve.optim_kernels.adafactor import FactoredRmsState, MomentumState
from optserve.optim_kernels.adafactor.factoring import FactorDim, standard_logical_factor_rules

B, R, C = FactorDim.BATCH, FactorDim.ROW, FactorDim.COLUMN


def _find(state, kind):
    if isinstance(state, kind):
        return state
    for s in state if isinstance(state, tuple) else ():
        found = _find(s, kind)
        if found is not None:
            return found
    return None


def _run(tx, params, grads_seq, **extra):
    state = tx.init(params)

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params, **extra)
        return optax.apply_updates(params, updates), state

    for grads in grads_seq:
        params, state = step(params, state, grads)
    return params, state


def _grads(shapes, steps, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return [
        jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s) * scale * (1 + i % 3), jnp.float32), shapes,
                     is_leaf=lambda x: isinstance(x, tuple))
        for i in range(steps)
    ]


def _params(shapes, seed=100):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s), jnp.float32), shapes,
                        is_leaf=lambda x: isinstance(x, tuple))


def _close(a, b, rtol=1e-5):
    b = np.asarray(b)
    np.testing.assert_allclose(np.asarray(a), b, rtol=rtol, atol=1e-6 * float(np.max(np.abs(b), initial=0)))


HEURISTIC_SHAPES = {"wide": (128, 256), "tall": (256, 128), "square": (128, 128), "small": (4, 128),
                    "vector": (130,), "scalar": ()}


@pytest.mark.parametrize(
    "ours, theirs",
    [
        ({}, {}),
        ({"beta1": 0.9, "weight_decay_rate": 0.01, "clipping_threshold": 0.5},
         {"momentum": 0.9, "weight_decay_rate": 0.01, "clipping_threshold": 0.5}),
    ],
    ids=["defaults", "momentum_decay_clip"],
)
def test_heuristic_case_matches_optax_adafactor_params_and_state_for_50_steps(ours, theirs):
    params = _params(HEURISTIC_SHAPES)
    grads = _grads(HEURISTIC_SHAPES, 50)
    p_ours, s_ours = _run(adafactor(learning_rate=0.01, **ours), params, grads)
    p_ref, s_ref = _run(optax.adafactor(learning_rate=0.01, **theirs), params, grads)
    mine, ref = _find(s_ours, FactoredRmsState), s_ref[0]
    for k in HEURISTIC_SHAPES:
        _close(p_ours[k], p_ref[k])
        for field in ("v_row", "v_col", "v"):
            value = getattr(mine, field)[k]
            if value is not None:
                _close(value, getattr(ref, field)[k])
    assert mine.v["wide"] is None and mine.v_row["small"] is None
    if "beta1" in ours:
        ref_m = _find(s_ref, optax.EmaState).ema
        for k in HEURISTIC_SHAPES:
            _close(_find(s_ours, MomentumState).m[k], ref_m[k])


def test_batch_rule_stack_matches_separate_params_slice_by_slice():
    k, m, n = 3, 4, 6
    kwargs = dict(learning_rate=0.05, beta1=0.8, weight_decay_rate=0.01, min_dim_size_to_factor=1,
                  global_norm_clip_threshold=3.0)
    separate_shapes = {f"w{i}": (m, n) for i in range(k)}
    separate = _params(separate_shapes)
    grads = _grads(separate_shapes, 20)
    stacked = {"stack": jnp.stack([separate[f"w{i}"] for i in range(k)])}
    stacked_grads = [{"stack": jnp.stack([g[f"w{i}"] for i in range(k)])} for g in grads]

    p_sep, s_sep = _run(adafactor(**kwargs), separate, grads)
    tx = adafactor(factor_map={"stack": (B, R, C)}, **kwargs)
    p_stk, s_stk = _run(tx, stacked, stacked_grads)

    v_stk, v_sep = _find(s_stk, FactoredRmsState), _find(s_sep, FactoredRmsState)
    assert v_stk.v_row["stack"].shape == (k, m) and v_stk.v_col["stack"].shape == (k, n)
    for i in range(k):
        _close(p_stk["stack"][i], p_sep[f"w{i}"])
        _close(v_stk.v_row["stack"][i], v_sep.v_row[f"w{i}"])
        _close(v_stk.v_col["stack"][i], v_sep.v_col[f"w{i}"])


def test_row_column_column_rule_equals_the_reshaped_matrix():
    params = {"q": _params({"q": (4, 2, 3)})["q"]}
    grads = _grads({"q": (4, 2, 3)}, 10)
    p3, s3 = _run(adafactor(learning_rate=0.1, factor_map={"q": (R, C, C)}), params, grads)
    flat = lambda t: {"q": t["q"].reshape(4, 6)}  # noqa: E731
    p2, s2 = _run(adafactor(learning_rate=0.1, min_dim_size_to_factor=1), flat(params), [flat(g) for g in grads])
    _close(p3["q"].reshape(4, 6), p2["q"])
    assert _find(s3, FactoredRmsState).v_col["q"].shape == (2, 3)


def test_logical_factor_rules_give_the_same_rules_as_the_equivalent_factor_map():
    shapes = {"layers": {"wi": (2, 4, 6), "scale": (2, 4)}}
    axes = {"layers": {"wi": ("layers", "embed", "mlp"), "scale": ("layers", "embed")}}
    params, grads = _params(shapes), _grads(shapes, 5)
    tx_logical = adafactor(learning_rate=0.1, logical_factor_rules=standard_logical_factor_rules(),
                           param_logical_axes=axes)
    tx_map = adafactor(learning_rate=0.1, factor_map=[("wi", (B, R, C)), ("scale", (B, None))])
    p_a, s_a = _run(tx_logical, params, grads)
    p_b, _ = _run(tx_map, params, grads)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), p_a, p_b)
    moments = _find(s_a, FactoredRmsState)
    assert moments.v_row["layers"]["wi"].shape == (2, 4)
    assert moments.v["layers"]["scale"].shape == (2, 4)  # ROW without COLUMN: unfactored


@pytest.mark.parametrize("beta1, extra", [(None, 0), (0.9, 256 * 512)])
def test_factored_state_of_a_matrix_holds_m_plus_n_floats_plus_mn_only_with_momentum(beta1, extra):
    state = adafactor(learning_rate=0.01, beta1=beta1).init({"w": jnp.zeros((256, 512))})
    floats = sum(x.size for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating))
    assert floats == 256 + 512 + extra


def test_global_norm_clip_split_across_two_shards_matches_the_whole_tree():
    shapes = {"a": (130, 128), "b": (7,), "c": (128, 129), "d": (3, 5)}
    kwargs = dict(learning_rate=0.05, global_norm_clip_threshold=1.0, beta1=0.5)
    params, grads = _params(shapes), _grads(shapes, 4, scale=10.0)  # norm >> 1: clip is active
    whole, _ = _run(adafactor(**kwargs), params, grads)

    partial = adafactor_partial_statistic(**kwargs)
    shard_keys = [("a", "b"), ("c", "d")]
    tx = adafactor(**kwargs)
    shards = [{k: params[k] for k in keys} for keys in shard_keys]
    states = [tx.init(p) for p in shards]
    update = jax.jit(lambda g, s, p, total: tx.update(g, s, p, global_grad_sq_norm=total))
    for g in grads:
        g_shards = [{k: g[k] for k in keys} for keys in shard_keys]
        total = sum(partial(gs, s, p) for gs, s, p in zip(g_shards, states, shards))
        outs = [update(gs, s, p, total) for gs, s, p in zip(g_shards, states, shards)]
        shards = [optax.apply_updates(p, u) for p, (u, _) in zip(shards, outs)]
        states = [s for _, s in outs]
    for shard in shards:
        for k, v in shard.items():
            _close(v, whole[k], rtol=1e-6)

    # Without the global statistic each shard clips by its own norm: a different result.
    alone, _ = _run(adafactor(**kwargs), {k: params[k] for k in ("a", "b")},
                    [{k: g[k] for k in ("a", "b")} for g in grads])
    assert not np.allclose(np.asarray(alone["a"]), np.asarray(whole["a"]), rtol=1e-4)


def test_partial_statistic_is_none_without_global_norm_clipping_and_checks_kwargs():
    assert adafactor_partial_statistic(learning_rate=0.1) is None
    with pytest.raises(ValueError, match="no_such_option"):
        adafactor_partial_statistic(learning_rate=0.1, no_such_option=1)


def test_registry_builds_adafactor_with_its_partial_statistic():
    built = build_optimizer("adafactor", {"learning_rate": 0.01, "global_norm_clip_threshold": 1.0})
    grads = {"w": jnp.full((2, 3), 2.0)}
    assert float(built.partial_statistic(grads, None, grads)) == pytest.approx(24.0)
    assert build_optimizer("adafactor", {"learning_rate": 0.01}).partial_statistic is None
    assert build_optimizer("adafactor_hf", {}).partial_statistic is None


def test_per_path_parameter_scale_applies_only_where_the_map_says():
    shapes = {"dense": {"kernel": (3, 4), "bias": (4,)}}
    params = jax.tree.map(lambda x: x * 5.0, _params(shapes))  # rms ~5: scaling matters
    grads = _grads(shapes, 3)
    mixed, _ = _run(adafactor(learning_rate=0.1, multiply_by_parameter_scale={"bias$": False, ".*": True}),
                    params, grads)
    on, _ = _run(adafactor(learning_rate=0.1), params, grads)
    off, _ = _run(adafactor(learning_rate=0.1, multiply_by_parameter_scale=False), params, grads)
    _close(mixed["dense"]["kernel"], on["dense"]["kernel"])
    _close(mixed["dense"]["bias"], off["dense"]["bias"])
    assert not np.allclose(np.asarray(on["dense"]["bias"]), np.asarray(off["dense"]["bias"]))


def test_max_parameter_scale_caps_the_parameter_scale():
    params = {"w": _params({"w": (3, 4)})["w"] * 10.0}
    grads = _grads({"w": (3, 4)}, 1)
    capped, _ = _run(adafactor(learning_rate=0.1, max_parameter_scale=1.0), params, grads)
    unscaled, _ = _run(adafactor(learning_rate=0.1, multiply_by_parameter_scale=False), params, grads)
    _close(capped["w"], unscaled["w"])


def test_weight_decay_rate_lr_exponent_decays_by_rate_times_lr_power():
    params, grads = {"w": _params({"w": (3, 4)})["w"]}, _grads({"w": (3, 4)}, 3)
    a, _ = _run(adafactor(learning_rate=0.1, weight_decay_rate=0.5, weight_decay_rate_lr_exponent=2.0), params, grads)
    b, _ = _run(adafactor(learning_rate=0.1, weight_decay_rate=0.5 * 0.1**2), params, grads)
    _close(a["w"], b["w"], rtol=1e-6)


def test_skip_nan_updates_keeps_the_param_and_state_entries_that_would_turn_nan():
    shapes = {"bad": (3, 4), "good": (5,)}
    params = _params(shapes)
    grads = _grads(shapes, 2)
    grads[1]["bad"] = grads[1]["bad"].at[0, 0].set(jnp.nan)
    kw = dict(learning_rate=0.1, beta1=0.9)
    kept, kept_state = _run(adafactor(skip_nan_updates=True, **kw), params, grads)
    # The state before the NaN step, from the same program (another program may round its first
    # step differently in the last bit: XLA fuses each program its own way).
    first, first_state = _run(adafactor(skip_nan_updates=True, **kw), params, grads[:1])
    plain, plain_state = _run(adafactor(**kw), params, grads)
    # One NaN gradient entry poisons the clipped update of the whole tensor: all of it is kept.
    assert np.isnan(np.asarray(plain["bad"])).all()
    np.testing.assert_array_equal(np.asarray(kept["bad"]), np.asarray(first["bad"]))
    np.testing.assert_array_equal(np.asarray(_find(kept_state, MomentumState).m["bad"]),
                                  np.asarray(_find(first_state, MomentumState).m["bad"]))
    # The unfactored second moment is NaN in one entry only: that entry is kept, the rest move.
    v_kept = np.asarray(_find(kept_state, FactoredRmsState).v["bad"])
    v_plain = np.asarray(_find(plain_state, FactoredRmsState).v["bad"])
    assert v_kept[0, 0] == np.asarray(_find(first_state, FactoredRmsState).v["bad"])[0, 0]
    np.testing.assert_array_equal(v_kept.ravel()[1:], v_plain.ravel()[1:])
    np.testing.assert_array_equal(np.asarray(kept["good"]), np.asarray(plain["good"]))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({}, "learning_rate"),
        ({"learning_rate": 0.1, "factored": False, "factor_map": {"w": (R, C)}}, "factored"),
        ({"learning_rate": 0.1, "multiply_by_parameter_scale": 1.0}, "multiply_by_parameter_scale"),
        ({"learning_rate": 0.1, "logical_factor_rules": {"embed": "row"}}, "param_logical_axes"),
        ({"learning_rate": 0.1, "beta1": 1.0}, "beta1"),
        ({"learning_rate": 0.1, "dtype_momentum": "not_a_dtype"}, "dtype_momentum"),
    ],
)
def test_invalid_options_raise_value_error_naming_the_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        adafactor(**kwargs)


def test_rank_three_param_without_rule_raises_naming_path_shape_and_option():
    with pytest.raises(ValueError, match=r"'attn/q'.*\(4, 8, 16\).*factor_map"):
        adafactor(learning_rate=0.1).init({"attn": {"q": jnp.zeros((4, 8, 16))}})
    # factored=False has no rule to find, as in T5X.
    adafactor(learning_rate=0.1, factored=False).init({"q": jnp.zeros((4, 8, 16))})


def test_factor_map_without_a_matching_rule_raises_naming_path():
    with pytest.raises(ValueError, match=r"'emb'.*factor_map"):
        adafactor(learning_rate=0.1, factor_map={"dense": (B, R, C)}).init({"emb": jnp.zeros((2, 3, 4))})


def test_gradients_that_do_not_match_params_raise_naming_path_and_shape():
    tx = adafactor(learning_rate=0.1)
    params = {"layer": {"w": jnp.zeros((3, 4)), "b": jnp.zeros(4)}}
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"'layer/w'.*\(4, 3\).*\(3, 4\)"):
        tx.update({"layer": {"w": jnp.zeros((4, 3)), "b": jnp.zeros(4)}}, state, params)
    with pytest.raises(ValueError, match=r"missing paths \['layer/b'\]"):
        tx.update({"layer": {"w": jnp.zeros((3, 4))}}, state, params)
    with pytest.raises(ValueError, match="needs params"):
        tx.update(params, state)


def test_state_built_for_other_params_is_rejected_naming_path():
    tx = adafactor(learning_rate=0.1, factored=False)
    state = tx.init({"w": jnp.zeros((3, 4))})
    with pytest.raises(ValueError, match=r"'w'.*\(3, 5\).*state"):
        tx.update({"w": jnp.zeros((3, 5))}, state, {"w": jnp.zeros((3, 5))})
