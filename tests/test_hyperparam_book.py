"""The home clock's hyperparameter book across a restart: changes carried by journaled tickets are
in force and listed, a change asked for but not carried is pending again, one already carried is
not pending twice, and a journal that lost tickets is made good from the shards' step records."""

from __future__ import annotations

import json

import numpy as np
import pytest

from optserve.optim_kernels import build_optimizer
from optserve.server.compute.updater import Updater
from optserve.server.domain.clock.home_clock import HomeClock
from optserve.server.domain.config import DType, Mode, SessionConfig, TensorSpec
from optserve.server.domain.durability import StepRecord
from optserve.server.domain.shard.replay import replayed_tickets

LR = {"default": {"learning_rate": 0.05}}


def _config() -> SessionConfig:
    return SessionConfig("book", (TensorSpec("w", DType.FLOAT32, (4, 3)),), "adam", {"learning_rate": 0.1},
                         mode=Mode.ASYNC)


def _restored(journal: list, replayed=()) -> HomeClock:
    clock = HomeClock(_config())
    clock.restore(None, json.loads(json.dumps(journal)), replayed)
    return clock


def test_a_restored_clock_has_the_carried_changes_in_force_and_none_pending():
    journal: list = []
    live = HomeClock(_config(), journal=journal.append)
    assert live.set_hyperparams(LR) == (1, True)
    first = live.commit("a", 1, 0)
    assert json.loads(first.hyperparams) == LR
    assert live.set_hyperparams({"default": {"learning_rate": 0.02}}) == (2, True)
    live.commit("a", 2, 1)
    restored = _restored(journal)
    assert restored.set_hyperparams({"default": {"learning_rate": 0.02}}) == live.set_hyperparams(
        {"default": {"learning_rate": 0.02}}) == (2, False)
    assert restored.commit("a", 3, 2).hyperparams == ""  # nothing pending: no change rides on it
    assert [(c.version, c.values) for c in restored.hyperparam_history(0)] == [
        (1, LR), (2, {"default": {"learning_rate": 0.02}})]


def test_a_change_asked_for_but_not_yet_carried_is_pending_after_a_restart():
    journal: list = []
    live = HomeClock(_config(), journal=journal.append)
    live.commit("a", 1, 0)
    live.set_hyperparams(LR)  # acknowledged, journaled; no push since
    restored = _restored(journal)
    assert json.loads(restored.commit("a", 2, 1).hyperparams) == LR
    assert [c.version for c in restored.hyperparam_history(0)] == [2]


def test_changes_lost_with_the_journal_come_back_from_the_step_records():
    start = {"default": {"learning_rate": 0.1, "eps": 1e-8}}
    records = [StepRecord(1, ((0, "a", 1),), 1.0, 0.0, start),
               StepRecord(2, ((1, "a", 2),), 1.0, 0.0, {"default": {"learning_rate": 0.05, "eps": 1e-8}}),
               StepRecord(3, ((2, "a", 3),), 1.0, 0.0, {"default": {"learning_rate": 0.05, "eps": 1e-8}})]
    restored = _restored([], replayed_tickets(records, start))
    assert [(c.version, c.values) for c in restored.hyperparam_history(0)] == [(2, LR)]
    assert restored.set_hyperparams(LR) == (2, False)


def test_a_value_past_float32_is_refused_naming_it():
    with pytest.raises(ValueError, match="'learning_rate'.*finite in float32"):
        build_optimizer("adamw", {"learning_rate": 0.1}).checked_hyperparams({"learning_rate": 1e300})


def test_a_group_needing_the_cross_shard_statistic_gets_it_though_the_default_group_does_not():
    built = build_optimizer("adafactor", {"learning_rate": 0.01, "param_groups": [
        {"tensors": ["b"], "global_norm_clip_threshold": 1.0}]})
    assert built.partial_statistic is not None


def test_a_tensor_named_like_a_group_without_a_gradient_leaves_the_groups_shared_count_moving():
    params = {"default": np.ones(3, np.float32), "w": np.ones(3, np.float32), "other": np.ones(3, np.float32)}
    built = build_optimizer("adam", {"learning_rate": 0.1, "param_groups": [{"tensors": ["other"]}]})
    updater = Updater(built, param_specs={k: (v.shape, v.dtype) for k, v in params.items()})
    updater.initialize(params)
    grads = {k: np.full(3, 0.5, np.float32) for k in params}
    updater.apply(grads, 1.0, lambda partial: partial, absent={"default"})
    state = updater.opt_state["default"][0]  # the default group's ScaleByAdamState
    assert int(state.count) == 1
    assert float(np.abs(np.asarray(state.mu["w"])).max()) > 0 and float(np.abs(np.asarray(state.mu["default"])).max()) == 0
    assert np.array_equal(updater.host_params()["default"], params["default"])
