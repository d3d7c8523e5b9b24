"""A shard's state named by tensor (server/compute/state_leaves.py), on real updaters: the names do
not depend on how the tensors are spread over shards, even where parameter-group labels ("0",
"1", ...) equal tensor names, and a state read from one layout installs into another."""

from __future__ import annotations

import numpy as np

from optserve.optim_kernels import build_optimizer
from optserve.server.compute import state_leaves
from optserve.server.compute.updater import Updater

SHAPES = {"0": (4, 3), "1": (3,)}  # a JAX list pytree's tensor names
ARGS = {"learning_rate": 0.01, "param_groups": [{"tensors": ["1"], "weight_decay": 0.0}]}


def _updater(names) -> Updater:
    rng = np.random.default_rng(0)
    params = {name: rng.standard_normal(SHAPES[name]).astype(np.float32) for name in names}
    updater = Updater(build_optimizer("adamw", ARGS), param_specs={k: (v.shape, v.dtype) for k, v in params.items()})
    updater.initialize(params)
    grads = {name: np.ones(SHAPES[name], np.float32) for name in names}
    updater.apply(grads, 1.0, lambda partial: partial)
    return updater


def _by_tensor(leaves: dict) -> dict:
    return {key: value for key, value in leaves.items() if not key.startswith(state_leaves.PARAM)}


def test_group_labels_equal_to_tensor_names_are_not_taken_for_tensors():
    whole = _by_tensor(state_leaves.export_leaves(_updater(["0", "1"])))
    assert "shared/0.0.count" in whole and "shared/default.0.count" in whole  # each group's step count
    assert {"tensor/1/0.0.mu", "tensor/1/0.0.nu", "tensor/0/default.0.mu"} <= set(whole)
    # the same names whichever tensors a shard holds: one shard per tensor gives the same leaves
    apart = {**_by_tensor(state_leaves.export_leaves(_updater(["0"]))),
             **_by_tensor(state_leaves.export_leaves(_updater(["1"])))}
    assert sorted(apart) == sorted(whole)
    for key in whole:
        np.testing.assert_array_equal(apart[key], whole[key], err_msg=key)


def test_a_state_read_on_one_shard_installs_on_two():
    source = state_leaves.export_leaves(_updater(["0", "1"]))
    for names in (["0"], ["1"]):
        target = _updater(names)
        wanted = {key for key in state_leaves.leaf_specs(target)}
        state_leaves.install_leaves(target, {key: value for key, value in source.items() if key in wanted})
        got = state_leaves.export_leaves(target)
        for key in wanted:
            np.testing.assert_array_equal(got[key], source[key], err_msg=key)
