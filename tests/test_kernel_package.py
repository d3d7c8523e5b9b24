"""The kernel package exposes each constructor as a function, whatever was imported before."""

import importlib

import optax


def test_constructors_stay_functions_after_their_modules_are_imported():
    for module in ("adafactor", "shampoo", "scaled_adam", "matrix_roots"):
        importlib.import_module(f"optserve.optim_kernels.{module}")
    from optserve.optim_kernels import adafactor, adafactor_hf, adafactor_t2t, scaled_adam, shampoo

    for constructor in (adafactor, adafactor_hf, adafactor_t2t, scaled_adam, shampoo):
        assert callable(constructor) and not isinstance(constructor, type(importlib)), constructor
    assert isinstance(shampoo(learning_rate=0.1, block_size=4), optax.GradientTransformation)


def test_every_registry_entry_resolves_to_its_constructor():
    from optserve.optim_kernels import OPTIMIZERS

    for name, entry in OPTIMIZERS.items():
        assert callable(entry.load()), name
