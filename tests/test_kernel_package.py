"""The kernel package: constructors stay functions, the registry's entries and seam, typed configs."""

import importlib

import optax
import pytest


def test_constructors_stay_functions_after_their_modules_are_imported():
    for module in ("adafactor", "adafactor.kernel", "shampoo", "shampoo.kernel", "shampoo.seam", "scaled_adam",
                   "scaled_adam.kernel", "linalg", "linalg.matrix_roots"):
        importlib.import_module(f"optserve.optim_kernels.{module}")
    from optserve.optim_kernels import adafactor, adafactor_hf, adafactor_t2t, scaled_adam, shampoo

    for constructor in (adafactor, adafactor_hf, adafactor_t2t, scaled_adam, shampoo):
        assert callable(constructor) and not isinstance(constructor, type(importlib)), constructor
    assert isinstance(shampoo(learning_rate=0.1, block_size=4), optax.GradientTransformation)


def test_every_registry_entry_resolves_to_its_constructor():
    from optserve.optim_kernels import OPTIMIZERS

    for name, entry in OPTIMIZERS.items():
        assert callable(entry.constructor), name


# ----------------------------------------------------------------------------- registry


def test_every_registry_entry_builds_and_its_built_optimizer_carries_the_entry_seam():
    import jax.numpy as jnp

    from optserve.optim_kernels import OPTIMIZERS, build_optimizer

    minimal = {"adafactor_hf": {"lr": 0.01, "relative_step": False}, "scaled_adam": {},
               "delayed_nesterov": {"learning_rate": 0.01, "delay": 2}}
    for name, entry in OPTIMIZERS.items():
        built = build_optimizer(name, minimal.get(name, {"learning_rate": 0.01}))
        assert isinstance(built.transformation, optax.GradientTransformation), name
        assert built.root_offload is entry.root_offload
        params = {"w": jnp.ones((3, 2))}
        built.transformation.init(params)


def test_only_shampoo_and_soap_declare_a_root_offload_seam():
    from optserve.optim_kernels import OPTIMIZERS

    with_seam = sorted(name for name, entry in OPTIMIZERS.items() if entry.root_offload is not None)
    assert with_seam == ["shampoo", "soap"]


def test_partial_statistic_factories_are_built_with_the_optimizer_options():
    from optserve.optim_kernels import build_optimizer

    assert build_optimizer("scaled_adam", {"clipping_scale": 2.0}).partial_statistic is not None
    assert build_optimizer("scaled_adam", {}).partial_statistic is None
    clipped = {"learning_rate": 0.1, "global_norm_clip_threshold": 1.0}
    assert build_optimizer("adafactor", clipped).partial_statistic is not None
    assert build_optimizer("shampoo", {"learning_rate": 0.1}).partial_statistic is None


@pytest.mark.parametrize(
    "name, args, option",
    [
        ("shampoo", {"learning_rate": "fast"}, "learning_rate"),
        ("shampoo", {"learning_rate": 0.1, "block_size": "big"}, "block_size"),
        ("shampoo", {"learning_rate": 0.1, "merge_small_dims_block_size": [4]}, "merge_small_dims_block_size"),
        ("scaled_adam", {"lr": "fast"}, "lr"),
        ("scaled_adam", {"betas": "0.9,0.98"}, "betas"),
        ("adafactor", {"learning_rate": "fast"}, "learning_rate"),
        ("adafactor_hf", {"lr": "fast", "relative_step": False}, "lr"),
        ("adam", {"learning_rate": "fast"}, "learning_rate"),
        ("adam", {"learning_rate": 0.1, "b1": "high"}, "b1"),
        ("adamw", {"learning_rate": 0.1, "weight_decay": "some"}, "weight_decay"),
        ("sgd", {"learning_rate": 0.1, "nesterov": "yes"}, "nesterov"),
    ],
)
def test_a_value_of_the_wrong_type_is_a_value_error_naming_the_optimizer_and_option(name, args, option):
    from optserve.optim_kernels import build_optimizer

    with pytest.raises(ValueError, match=rf"{name}.*'{option}'"):
        build_optimizer(name, args)


def test_json_values_of_the_admitted_types_pass_the_type_check():
    from optserve.optim_kernels import build_optimizer

    build_optimizer("scaled_adam", {"lr": 1, "betas": [0.9, 0.98], "clipping_scale": None})
    build_optimizer("shampoo", {"learning_rate": 1, "graft_type": "adagrad", "root_method": "eigh",
                                "merge_small_dims_block_size": None})
    build_optimizer("sgd", {"learning_rate": 0.1, "momentum": 0.9, "nesterov": True})
    build_optimizer("adafactor", {"learning_rate": 0.1, "dtype_momentum": "bfloat16",
                                  "multiply_by_parameter_scale": {".*": True}})


# ------------------------------------------------------------------------- typed configs


def _fields_and_defaults(cls):
    import dataclasses

    return {f.name: f.default for f in dataclasses.fields(cls)}


def _parameters_and_defaults(fn):
    import inspect

    return {name: p.default for name, p in inspect.signature(fn).parameters.items()}


def test_flat_constructors_mirror_their_typed_configs_option_for_option():
    import dataclasses

    from optserve.optim_kernels.scaled_adam import ScaledAdamConfig, scaled_adam
    from optserve.optim_kernels.shampoo import ShampooConfig, shampoo

    assert _parameters_and_defaults(scaled_adam) == _fields_and_defaults(ScaledAdamConfig)
    expected = _fields_and_defaults(ShampooConfig)
    expected["learning_rate"] = inspect_empty()
    assert _parameters_and_defaults(shampoo) == expected
    assert dataclasses.fields(ShampooConfig)[0].default is dataclasses.MISSING


def inspect_empty():
    import inspect

    return inspect.Parameter.empty


def test_scaled_adam_config_validates_once_for_constructor_and_statistic():
    from optserve.optim_kernels.scaled_adam import ScaledAdamConfig, scaled_adam, scaled_adam_partial_statistic

    config = ScaledAdamConfig(betas=[0.5, 0.9])
    assert config.betas == (0.5, 0.9) and hash(config) == hash(ScaledAdamConfig(betas=(0.5, 0.9)))
    for build in (ScaledAdamConfig, scaled_adam, scaled_adam_partial_statistic):
        with pytest.raises(ValueError, match="scaled_adam option 'eps'"):
            build(eps=0.0)
    with pytest.raises(ValueError, match="'clip'"):
        scaled_adam_partial_statistic(clip=1.0)


def test_shampoo_defaults_follow_the_seed_merge_up_to_block_size_and_coupled_newton_roots():
    from optserve.optim_kernels.linalg import CoupledNewtonConfig, RootConfig
    from optserve.optim_kernels.shampoo import ShampooConfig

    config = ShampooConfig(0.1, block_size=32)
    assert config.merge_max_dim == 32 and config.layout((3, 8, 24)).working_shape == (24, 24)
    assert ShampooConfig(0.1, block_size=32, merge_small_dims_block_size=4096).layout((3, 8, 24)).working_shape \
        == (576,)
    assert config.root_config == RootConfig(CoupledNewtonConfig(num_iters=100), 1e-6, True)
    assert config.method == "coupled_newton"


def test_root_method_names_map_onto_typed_choices_and_auto_resolves_by_backend():
    from optserve.optim_kernels.linalg import AutoRootConfig, CoupledNewtonConfig, EigenConfig, root_method_config
    from optserve.optim_kernels.shampoo import ShampooConfig

    assert root_method_config("eigh") == EigenConfig()
    assert root_method_config("coupled_newton", num_iters=7) == CoupledNewtonConfig(num_iters=7)
    auto = root_method_config("auto", num_iters=7)
    assert auto == AutoRootConfig(accelerator=CoupledNewtonConfig(num_iters=7))
    assert auto.resolve("cpu") == EigenConfig() and auto.resolve("gpu") == CoupledNewtonConfig(num_iters=7)
    assert ShampooConfig(0.1, root_method=CoupledNewtonConfig(num_iters=3)).root_config.method.num_iters == 3
    with pytest.raises(ValueError, match="root_method"):
        ShampooConfig(0.1, root_method="qr")
    with pytest.raises(ValueError, match="num_iters"):
        CoupledNewtonConfig(num_iters=0)


def test_root_config_is_hashable_and_survives_pickling_unchanged():
    import pickle

    from optserve.optim_kernels import OPTIMIZERS

    seam = OPTIMIZERS["shampoo"].root_offload
    for method in ("coupled_newton", "eigh", "auto"):
        config = seam.root_config(seam.config(learning_rate=0.1, root_method=method, matrix_epsilon=1e-5))
        copy = pickle.loads(pickle.dumps(config))
        assert copy == config and hash(copy) == hash(config)
    assert pickle.loads(pickle.dumps(seam.compute_roots)) is seam.compute_roots


# ------------------------------------------------------------------------------- the seam


def test_shampoo_package_exposes_the_names_the_server_used():
    # ``import optserve.optim_kernels.shampoo as package`` would give the constructor: the parent
    # package binds that name to the function.
    package = importlib.import_module("optserve.optim_kernels.shampoo")

    for name in ("shampoo", "shampoo_config", "ShampooConfig", "export_statistics", "install_preconditioners",
                 "compute_preconditioners", "default_root_method", "BlockLabel"):
        assert hasattr(package, name), name


def test_seam_labels_name_every_exported_statistic_in_order():
    import jax

    from _shampoo_problems import make_params
    from optserve.optim_kernels import OPTIMIZERS, build_optimizer
    from optserve.optim_kernels.shampoo import BlockLabel

    args = {"learning_rate": 0.1, "block_size": 4}
    seam = OPTIMIZERS["shampoo"].root_offload
    config = seam.config(**args)
    params = make_params()
    state = build_optimizer("shampoo", args).transformation.init(params)
    exported = seam.export(state, config)
    labels = seam.block_labels(config, {name: p.shape for name, p in params.items()})
    # b [6] -> blocks 4, 2; k [2, 3, 4] merged up to 4 -> (2, 3, 4), one block; w [8, 6] -> 2 x 2 blocks.
    assert labels[:6] == [BlockLabel("b", 0, 0, 4), BlockLabel("b", 1, 0, 2), BlockLabel("k", 0, 0, 2),
                          BlockLabel("k", 0, 1, 3), BlockLabel("k", 0, 2, 4), BlockLabel("w", 0, 0, 4)]
    assert [label.size for label in labels] == jax.device_get(exported.sizes).tolist()
    count, source, failures, last_error = seam.progress(state)
    assert int(count) == 0 and source.shape == failures.shape == last_error.shape == (len(labels),)


def test_seam_export_compute_install_reproduces_the_inline_roots_kernel():
    import functools

    import jax
    import numpy as np

    from _shampoo_problems import make_params, max_relative_difference, run
    from optserve.optim_kernels import OPTIMIZERS, build_optimizer

    args = {"learning_rate": 0.05, "block_size": 4, "graft_type": "adagrad", "start_preconditioning_step": 2,
            "preconditioning_compute_steps": 2}
    seam = OPTIMIZERS["shampoo"].root_offload
    offloaded_args = seam.without_inline_roots(args)
    assert offloaded_args == dict(args, inline_preconditioners=False) and "inline_preconditioners" not in args
    config = seam.config(**offloaded_args)
    every = seam.compute_steps(config)
    export = jax.jit(lambda state, grads: seam.export(state, config, grads))
    compute = jax.jit(functools.partial(seam.compute_roots, root_config=seam.root_config(config)))
    install = jax.jit(lambda state, roots, errors, step: seam.install(state, config, roots, errors, step))

    def between(state, grads):
        if int(seam.progress(state)[0]) % every == 0:
            exported = export(state, grads)
            roots, errors = compute(exported.statistics, exported.exponents, exported.sizes)
            state = install(state, roots, errors, exported.step)
        return state

    params = make_params()
    inline, _ = run(build_optimizer("shampoo", args).transformation, params, 8)
    offloaded, state = run(build_optimizer("shampoo", offloaded_args).transformation, params, 8, between=between)
    assert max_relative_difference(inline, offloaded) == 0.0
    count, source, failures, _ = jax.device_get(seam.progress(state))
    assert int(count) == 8 and np.all(source == 6) and np.all(failures == 0)
