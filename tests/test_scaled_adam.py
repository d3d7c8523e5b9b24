"""ScaledAdam against a float64 NumPy re-implementation, plus its contracts.

The reference below is written tensor by tensor from icefall's definitions, deliberately
unlike the kernel (no stacking, no JAX, Python control flow on the step number), so that
agreement is evidence rather than a tautology. It counts the events a golden run must
exercise, and each golden test asserts they happened.

One reading is deliberate: the clipping factor scales the gradient of the whole step, as the
seed's docstring says and later icefall does; the seed's code applies it only to the scale
gradients (its Adam step re-reads the unclipped gradient), which we treat as a bug.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from optserve.optim_kernels import build_optimizer
from optserve.optim_kernels.scaled_adam import batching
from optserve.optim_kernels.scaled_adam import scaled_adam, scaled_adam_partial_statistic
from optserve.optim_kernels.scaled_adam.clipping import clip_by_median_norm, median_index


@dataclasses.dataclass
class Events:
    clipped_steps: int = 0
    heavily_clipped_steps: int = 0
    threshold_updates: int = 0
    scale_updates_free: int = 0
    scale_updates_too_small: int = 0
    scale_updates_too_large: int = 0
    scalar_clamps: int = 0
    uncorrected_adam_steps: int = 0


class NumpyScaledAdam:
    def __init__(
        self,
        params,
        lr=0.03,
        clipping_scale=None,
        betas=(0.9, 0.98),
        scalar_lr_scale=0.1,
        eps=1e-8,
        param_min_rms=1e-5,
        param_max_rms=3.0,
        scalar_max=10.0,
        size_update_period=4,
        clipping_update_period=100,
    ):
        self.lr = lr
        self.clipping_scale = clipping_scale
        self.beta1, self.beta2 = betas
        self.scalar_lr_scale = scalar_lr_scale
        self.eps = eps
        self.min_rms = param_min_rms
        self.max_rms = param_max_rms
        self.scalar_max = scalar_max
        self.size_period = size_update_period
        self.clip_period = clipping_update_period
        self.t = 0
        self.norms = np.zeros(clipping_update_period)
        self.threshold = None
        self.events = Events()
        self.tensors = {}
        for name, p in params.items():
            p = np.asarray(p, np.float64)
            entry = {"momentum": np.zeros_like(p), "sq_avg": np.zeros_like(p)}
            if p.size > 1:
                entry["rms"] = float(np.sqrt(np.mean(p * p)))
                entry["scale_sq_avg"] = 0.0
                entry["scale_grads"] = [0.0] * size_update_period
            self.tensors[name] = entry

    def _lr(self):
        """This step's learning rate: a float, or a schedule of the step number."""
        return float(self.lr(self.t)) if callable(self.lr) else self.lr

    def _clip_factor(self, grads):
        """Factor for this step's gradients; also keeps the norm history."""
        if self.clipping_scale is None or self.t == 0:
            return 1.0
        total = 0.0
        for name, g in grads.items():
            weight = self.tensors[name].get("rms", 1.0)
            total += float(np.sum((g * weight) ** 2))
        norm = np.sqrt(total)
        self.norms[self.t % self.clip_period] = norm
        if self.t % self.clip_period == 0:
            ranked = np.sort(self.norms)
            middle = ranked[min(self.clip_period - 1, (self.clip_period // 4) * 2)]
            self.threshold = self.clipping_scale * middle
            self.events.threshold_updates += 1
        if self.t < self.clip_period:
            return 1.0
        factor = min(1.0, self.threshold / (norm + 1e-20))
        if factor < 1.0:
            self.events.clipped_steps += 1
        if factor < 0.1:
            self.events.heavily_clipped_steps += 1
        return factor

    def step(self, params, grads):
        """Returns the new params (dict of float64 arrays)."""
        factor = self._clip_factor(grads)
        t, b1, b2 = self.t, self.beta1, self.beta2
        new_params = {}
        for name, p in params.items():
            p = np.asarray(p, np.float64)
            g = np.asarray(grads[name], np.float64) * factor
            s = self.tensors[name]
            s["momentum"] = b1 * s["momentum"]
            s["sq_avg"] = b2 * s["sq_avg"] + (1 - b2) * g * g
            if p.size > 1:
                s["scale_grads"][t % self.size_period] = float(np.sum(p * g))
                if t % self.size_period == self.size_period - 1:
                    s["rms"] = float(np.sqrt(np.mean(p * p)))
                    if t > 0:
                        self._learn_scale(s, p)
                correction = 1 - b2 ** (t + 1)
                second = s["sq_avg"] / correction if correction < 0.99 else s["sq_avg"]
                if correction >= 0.99:
                    self.events.uncorrected_adam_steps += 1
                size = max(s["rms"], self.min_rms)
                s["momentum"] += -self._lr() * (1 - b1) * size * g / (np.sqrt(second) + self.eps)
                new_params[name] = p + s["momentum"]
            else:
                correction = 1 - b2 ** (t + 1)
                lr = self._lr() * self.scalar_lr_scale
                s["momentum"] += -lr * (1 - b1) * g / (np.sqrt(s["sq_avg"] / correction) + self.eps)
                clamped = np.clip(p, -self.scalar_max, self.scalar_max)
                if np.any(clamped != p):
                    self.events.scalar_clamps += 1
                new_params[name] = clamped + s["momentum"]
        self.t += 1
        return new_params

    def _learn_scale(self, s, p):
        """Gradient step on log-scale s of p = u * exp(s), by Adam over period-mean grads."""
        period = self.size_period
        lr = self._lr() * self.scalar_lr_scale
        decay = self.beta2**period
        grads = np.asarray(s["scale_grads"])
        s["scale_sq_avg"] = decay * s["scale_sq_avg"] + (1 - decay) * float(np.mean(grads**2))
        updates_so_far = (self.t + 1) // period
        correction = 1 - decay**updates_so_far
        rms_grad = np.sqrt(s["scale_sq_avg"]) + self.eps
        change = -lr * np.sqrt(correction) * float(np.sum(grads)) / rms_grad
        if s["rms"] < self.min_rms:
            change = 0.0
            self.events.scale_updates_too_small += 1
        elif s["rms"] > self.max_rms:
            change = -lr * period
            self.events.scale_updates_too_large += 1
        else:
            self.events.scale_updates_free += 1
        s["momentum"] += (1 - self.beta1) * change * p


# --------------------------------------------------------------------------- golden runs

STEPS = 200
SHAPES = {
    "w1": (4, 3),
    "w2": (4, 3),
    "w3": (4, 3),  # three tensors of one shape: one stacked kernel
    "b1": (3,),
    "b2": (3,),
    "big": (2, 5),  # starts at RMS 4 > param_max_rms and is pulled larger
    "tiny": (6,),  # starts at RMS 1e-6 < param_min_rms
    "s": (),  # scalars, pulled past scalar_max in the configs that set it low
    "s2": (),
    "gain": (1,),
}
# Gradient spikes (step -> tensor, factor): large enough to be clipped below 0.1.
SPIKES = {23: ("w2", 1e3), 57: ("big", 3e2), 131: ("b1", 1e3), 177: ("s", 1e4)}


@dataclasses.dataclass
class Problem:
    params: dict
    targets: dict
    curvature: dict
    noise: dict


def golden_problem(seed: int = 0) -> Problem:
    rng = np.random.default_rng(seed)
    params, targets, curvature, noise = {}, {}, {}, {}
    for name, shape in SHAPES.items():
        params[name] = rng.normal(size=shape)
        targets[name] = rng.normal(size=shape)
        curvature[name] = rng.uniform(0.5, 2.0)
        noise[name] = 0.1 * rng.normal(size=(STEPS, *shape))
    params["big"] = 4.0 * np.sign(rng.normal(size=SHAPES["big"]))
    targets["big"] = 1.2 * params["big"]
    params["tiny"] = 1e-6 * np.sign(rng.normal(size=SHAPES["tiny"]))
    targets["tiny"] = np.zeros(SHAPES["tiny"])
    params["s"], targets["s"] = np.array(0.4), np.array(3.0)
    params["gain"], targets["gain"] = np.array([-0.3]), np.array([-2.0])
    return Problem(params, targets, curvature, noise)


def golden_grads(problem: Problem, params: dict, step: int) -> dict:
    """Gradient of a noisy quadratic, evaluated at ``params`` (float64)."""
    grads = {}
    for name in SHAPES:
        p = np.asarray(params[name], np.float64)
        pull = problem.curvature[name] * (p - problem.targets[name])
        grads[name] = pull + problem.noise[name][step]
    if step in SPIKES:
        name, factor = SPIKES[step]
        grads[name] = grads[name] * factor
    return grads


GOLDEN_CONFIGS = {
    "clip_every_10_scalar_max_1": dict(
        lr=0.05, clipping_scale=2.0, clipping_update_period=10, scalar_max=1.0
    ),
    "defaults_with_clipping": dict(clipping_scale=1.0),
    "lr_schedule_clip_every_7": dict(
        lr=optax.linear_schedule(0.08, 0.01, STEPS), clipping_scale=3.0, clipping_update_period=7
    ),
    "size_period_1_clip_period_3_low_beta2": dict(
        lr=0.02,
        betas=(0.8, 0.9),
        size_update_period=1,
        clipping_scale=1.5,
        clipping_update_period=3,
        scalar_max=0.5,
        eps=1e-6,
    ),
}


def run_golden(options: dict):
    problem = golden_problem()
    reference = NumpyScaledAdam(problem.params, **options)
    opt = scaled_adam(**options)
    params = {k: jnp.asarray(v, jnp.float32) for k, v in problem.params.items()}
    state = opt.init(params)
    update = jax.jit(opt.update)
    ref_params = dict(problem.params)
    worst = 0.0
    for step in range(STEPS):
        grads = golden_grads(problem, {k: np.asarray(v) for k, v in params.items()}, step)
        grads = {k: jnp.asarray(v, jnp.float32) for k, v in grads.items()}
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        ref_params = reference.step(ref_params, golden_grads(problem, ref_params, step))
        for name in SHAPES:
            # f32 rounding of p + delta grows with |p|: absolute below 1, relative above.
            gap = np.abs(np.asarray(params[name], np.float64) - ref_params[name])
            worst = max(worst, float(np.max(gap / np.maximum(1.0, np.abs(ref_params[name])))))
    return worst, reference.events, params, ref_params


@pytest.mark.parametrize("config", sorted(GOLDEN_CONFIGS))
def test_golden_trajectory_matches_numpy_reference_for_200_steps(config):
    options = GOLDEN_CONFIGS[config]
    worst, events, params, ref_params = run_golden(options)
    assert worst <= 1e-5, f"max deviation over {STEPS} steps: {worst:.3e} (of max(1, |p|))"
    # The run must exercise what it claims to pin.
    assert events.clipped_steps > 0
    assert events.heavily_clipped_steps > 0
    period = options["clipping_update_period"] if "clipping_update_period" in options else 100
    assert events.threshold_updates == (STEPS - 1) // period
    assert events.scale_updates_free > 0
    assert events.scale_updates_too_small > 0
    assert events.scale_updates_too_large > 0
    if options.get("scalar_max", 10.0) < 3.0:
        assert events.scalar_clamps > 0
    if options.get("betas", (0.9, 0.98))[1] < 0.97:
        assert events.uncorrected_adam_steps > 0
    # And the trajectory moved: the quadratic pulled the free tensors toward their targets.
    problem = golden_problem()
    for name in ("w1", "w2", "w3"):
        before = np.linalg.norm(problem.params[name] - problem.targets[name])
        after = np.linalg.norm(ref_params[name] - problem.targets[name])
        assert after < 0.8 * before


# ---------------------------------------------------------------- cross-shard statistic


def _random_tree(rng, shapes):
    return {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}


def test_summed_partials_of_a_split_tree_reproduce_the_whole_tree_updates():
    options = dict(clipping_scale=1.0, clipping_update_period=3, size_update_period=2)
    shapes = {"w1": (4, 3), "w2": (4, 3), "b": (3,), "s": (), "g": (1,)}
    shard_keys = (("w1", "b", "s"), ("w2", "g"))  # w1 and w2 share a shape but not a shard
    rng = np.random.default_rng(1)
    params = _random_tree(rng, shapes)
    opt = scaled_adam(**options)
    partial = scaled_adam_partial_statistic(**options)
    update = jax.jit(opt.update)
    pick = lambda tree, keys: {k: tree[k] for k in keys}  # noqa: E731

    whole, whole_state = params, opt.init(params)
    shard_params = [pick(params, keys) for keys in shard_keys]
    shard_states = [opt.init(p) for p in shard_params]
    clipped_steps = 0
    for step in range(12):
        grads = _random_tree(rng, shapes)
        grads["w2"] = grads["w2"] * (1.0 + 5.0 * (step % 4 == 0))  # varied norms: some clip
        whole_sq = partial(grads, whole_state, whole)
        whole_updates, whole_state = update(grads, whole_state, whole)
        whole = optax.apply_updates(whole, whole_updates)
        if step >= 3 and np.sqrt(float(whole_sq)) > float(whole_state[0].threshold):
            clipped_steps += 1

        shard_grads = [pick(grads, keys) for keys in shard_keys]
        total = sum(partial(g, s, p) for g, s, p in zip(shard_grads, shard_states, shard_params))
        np.testing.assert_allclose(total, whole_sq, rtol=1e-6)
        for i in range(2):
            u, shard_states[i] = update(
                shard_grads[i], shard_states[i], shard_params[i], global_grad_sq_norm=total
            )
            shard_params[i] = optax.apply_updates(shard_params[i], u)
        for i, keys in enumerate(shard_keys):
            for k in keys:
                # Equal up to f32 summation order: a partition adds the same terms differently.
                np.testing.assert_allclose(shard_params[i][k], whole[k], rtol=1e-6, atol=1e-9)
            np.testing.assert_allclose(
                shard_states[i][0].norm_history, whole_state[0].norm_history, rtol=1e-6
            )
    assert clipped_steps > 0


def test_partial_statistic_is_none_without_clipping_and_registered():
    assert scaled_adam_partial_statistic() is None
    # The global statistic is accepted, and ignored, when there is no clipping.
    params = {"w": jnp.ones((2, 2))}
    opt = scaled_adam()
    plain, _ = opt.update(params, opt.init(params), params)
    extra, _ = opt.update(params, opt.init(params), params, global_grad_sq_norm=jnp.float32(1e6))
    np.testing.assert_array_equal(plain["w"], extra["w"])
    built = build_optimizer("scaled_adam", {"clipping_scale": 2.0})
    assert built.partial_statistic is not None
    assert build_optimizer("scaled_adam", {}).partial_statistic is None


def test_partial_statistic_weights_tensors_by_rms_and_scalars_by_one():
    params = {"w": jnp.full((2, 2), 3.0), "s": jnp.asarray(5.0)}
    grads = {"w": jnp.full((2, 2), 0.5), "s": jnp.asarray(2.0)}
    opt = scaled_adam(clipping_scale=2.0)
    partial = scaled_adam_partial_statistic(clipping_scale=2.0)
    value = float(partial(grads, opt.init(params), params))
    assert value == pytest.approx(4 * (0.5 * 3.0) ** 2 + 2.0**2, rel=1e-6)


# ----------------------------------------------------------------------- clipping schedule


@pytest.mark.parametrize("period, index", [(100, 50), (10, 4), (4, 2), (3, 0), (2, 0), (1, 0)])
def test_median_index_follows_the_reference_quartile_rule(period, index):
    assert median_index(period) == index


def test_threshold_is_set_at_step_period_from_norms_of_steps_1_to_period():
    period, scale = 4, 1.5
    clip = clip_by_median_norm(scale, period, size_update_period=1000)
    params = {"w": jnp.ones((2, 2)), "s": jnp.asarray(0.5)}  # rms(w) = 1 throughout
    state = clip.init(params)
    update = jax.jit(clip.update)
    # Step 0's huge norm is neither clipped nor recorded; steps 1..4 fill the history.
    norms = [100.0, 1.0, 2.0, 3.0, 9.0, 9.0]
    for step, norm in enumerate(norms):
        grads = {"w": jnp.full((2, 2), norm / 2.0), "s": jnp.asarray(0.0)}
        clipped, state = update(grads, state, params)
        if step == 0:
            np.testing.assert_array_equal(state.norm_history, np.zeros(period))
        expected = 1.0 if step < period else scale * 3.0 / norm  # median of {1, 2, 3, 9} is 3
        np.testing.assert_allclose(clipped["w"], grads["w"] * expected, rtol=1e-6)
    np.testing.assert_allclose(np.sort(state.norm_history), [2.0, 3.0, 9.0, 9.0], rtol=1e-6)
    np.testing.assert_allclose(state.threshold, scale * 3.0, rtol=1e-6)  # kept until step 8
    assert int(state.num_clipped) == 2


def test_heavy_clipping_logs_the_dominant_tensor_under_jit(caplog):
    opt = scaled_adam(clipping_scale=1.0, clipping_update_period=2)
    params = {"w1": jnp.ones((3, 2)), "w2": jnp.ones((3, 2)), "s": jnp.asarray(1.0)}
    state = opt.init(params)
    update = jax.jit(opt.update)
    with caplog.at_level(logging.INFO, logger="optserve.optim_kernels.scaled_adam.clipping"):
        for step in range(6):
            grads = {k: jnp.full_like(v, 0.1) for k, v in params.items()}
            if step == 4:
                grads["w2"] = grads["w2"] * 1e4
            _, state = update(grads, state, params)
        jax.effects_barrier()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "scaling gradients" in warnings[0].getMessage()
    dominant = [r.getMessage() for r in caplog.records if "dominates" in r.getMessage()]
    assert len(dominant) == 1 and "['w2']" in dominant[0] and "proportion 1.00" in dominant[0]
    assert any("quartiles" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------- stacking


def test_shape_groups_stack_same_shape_and_dtype_and_unstack_in_order():
    leaves = [jnp.ones((2, 3)), jnp.zeros((3,)), 2 * jnp.ones((2, 3))]
    leaves.append(jnp.ones((2, 3), jnp.bfloat16))
    groups = batching.shape_groups(leaves)
    assert groups.members == ((0, 2), (1,), (3,))
    stacked = batching.stack(groups, leaves)
    assert [s.shape for s in stacked] == [(2, 2, 3), (1, 3), (1, 2, 3)]
    for before, after in zip(leaves, batching.unstack(groups, stacked)):
        np.testing.assert_array_equal(before, after)
        assert before.dtype == after.dtype


def test_stacked_tensors_update_as_if_each_were_alone():
    rng = np.random.default_rng(2)
    shapes = {"a": (3, 4), "b": (3, 4), "s": (), "t": ()}
    params = _random_tree(rng, shapes)
    opt = scaled_adam(lr=0.1, size_update_period=2)
    together, alone = params, {k: {k: v} for k, v in params.items()}
    state = opt.init(together)
    alone_states = {k: opt.init(v) for k, v in alone.items()}
    update = jax.jit(opt.update)
    for _ in range(5):
        grads = _random_tree(rng, shapes)
        u, state = update(grads, state, together)
        together = optax.apply_updates(together, u)
        for k in shapes:
            u, alone_states[k] = update({k: grads[k]}, alone_states[k], alone[k])
            alone[k] = optax.apply_updates(alone[k], u)
    for k in shapes:
        np.testing.assert_allclose(together[k], alone[k][k], rtol=1e-6, atol=1e-7)
        assert not np.allclose(together[k], params[k])


# -------------------------------------------------------------------------- dtypes, input


def test_bf16_params_get_bf16_updates_and_f32_state():
    params = {"w": jnp.ones((4, 4), jnp.bfloat16), "s": jnp.asarray(0.5, jnp.bfloat16)}
    opt = scaled_adam(clipping_scale=2.0, clipping_update_period=2)
    state = opt.init(params)
    update = jax.jit(opt.update)
    for _ in range(4):
        grads = jax.tree_util.tree_map(lambda p: p * 0.5, params)
        updates, state = update(grads, state, params)
        assert all(u.dtype == jnp.bfloat16 for u in jax.tree_util.tree_leaves(updates))
        params = optax.apply_updates(params, updates)
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree_util.tree_leaves(params))
    assert state[1].delta["w"].dtype == jnp.float32
    assert float(params["w"][0, 0]) < 1.0


def test_gradient_with_wrong_shape_is_rejected_naming_path_and_shapes():
    params = {"layer": {"w": jnp.ones((3, 2))}, "s": jnp.asarray(1.0)}
    opt = scaled_adam()
    grads = {"layer": {"w": jnp.ones((2, 3))}, "s": jnp.asarray(1.0)}
    with pytest.raises(ValueError, match=r"\['layer'\]\['w'\].*\(2, 3\).*\(3, 2\)"):
        opt.update(grads, opt.init(params), params)


def test_integer_params_are_rejected_naming_path_and_dtype():
    params = {"w": jnp.ones((3, 2), jnp.int32)}
    opt = scaled_adam()
    with pytest.raises(ValueError, match=r"\['w'\].*int32"):
        opt.update(params, opt.init(params), params)


BAD_OPTIONS = [
    ({"lr": -0.1}, "lr"),
    ({"lr": float("nan")}, "lr"),
    ({"clipping_scale": 0.0}, "clipping_scale"),
    ({"betas": (0.9,)}, "betas"),
    ({"betas": (0.9, 1.0)}, "betas"),
    ({"betas": (-0.1, 0.98)}, "betas"),
    ({"scalar_lr_scale": -1.0}, "scalar_lr_scale"),
    ({"eps": 0.0}, "eps"),
    ({"param_min_rms": -1e-5}, "param_min_rms"),
    ({"param_max_rms": 1e-6}, "param_max_rms"),
    ({"scalar_max": 0.0}, "scalar_max"),
    ({"size_update_period": 0}, "size_update_period"),
    ({"size_update_period": 2.5}, "size_update_period"),
    ({"clipping_update_period": 0}, "clipping_update_period"),
    ({"show_dominant_parameters": "yes"}, "show_dominant_parameters"),
]


@pytest.mark.parametrize(
    "options, name", BAD_OPTIONS, ids=[f"{n}-{i}" for i, (_, n) in enumerate(BAD_OPTIONS)]
)
def test_bad_option_raises_value_error_naming_it(options, name):
    with pytest.raises(ValueError, match=f"'{name}'"):
        scaled_adam(**options)
    with pytest.raises(ValueError, match=f"'{name}'"):
        scaled_adam_partial_statistic(**options)
    with pytest.raises(ValueError, match=f"scaled_adam.*'{name}'"):
        build_optimizer("scaled_adam", options)


def test_defaults_are_icefalls():
    import inspect

    defaults = {k: p.default for k, p in inspect.signature(scaled_adam).parameters.items()}
    assert defaults == dict(
        lr=0.03,
        clipping_scale=None,
        betas=(0.9, 0.98),
        scalar_lr_scale=0.1,
        eps=1e-8,
        param_min_rms=1e-5,
        param_max_rms=3.0,
        scalar_max=10.0,
        size_update_period=4,
        clipping_update_period=100,
        show_dominant_parameters=True,
    )
