"""Hyperparameters that change mid-run (``Session.set_hyperparams``) and parameter groups
(``args["param_groups"]``): each equals optax in process, a change applies once at one version
however many workers ask, never recompiles the update, and bad requests are refused by name."""

from __future__ import annotations

import threading

import numpy as np
import optax
import pytest

from _service_helpers import make_grads, make_params, max_abs_diff
from optserve.client import Client, InvalidArgumentError
from optserve.client.status import HyperparamChange
from optserve.optim_kernels import build_optimizer
from optserve.server.compute.compile_cache import compile_stats
from optserve.server.compute.updater import Updater

SHAPES = {"embed": (16, 12), "hidden/w": (12, 10), "hidden/b": (10,)}


class Reference:
    """``optax`` in process, one jitted step taking the learning rate (and weight decay) as values."""

    def __init__(self, make, params):
        import jax

        self.params = {k: jax.numpy.asarray(v) for k, v in params.items()}
        self.state = make(0.01, 0.01).init(self.params)

        def step(params, state, grads, lr, wd):
            updates, state = make(lr, wd).update(grads, state, params)
            return optax.apply_updates(params, updates), state

        self._step = jax.jit(step)

    def step(self, grads, lr, wd):
        self.params, self.state = self._step(self.params, self.state, grads, np.float32(lr), np.float32(wd))
        return {k: np.asarray(v) for k, v in self.params.items()}


def test_a_learning_rate_set_mid_run_takes_effect_at_the_next_step_as_optax_would(server, unique_name):
    params = make_params(seed=7, shapes=SHAPES)
    reference = Reference(lambda lr, wd: optax.adamw(lr, weight_decay=wd), params)
    rates = {0: 0.01, 4: 0.003, 9: 0.05}  # step -> learning rate set before it
    with Client(server.address, timeout=120) as client:
        session = client.create_session(unique_name, params, optimizer={
            "name": "adamw", "args": {"learning_rate": 0.01, "weight_decay": 0.01}})
        try:
            lr, versions = 0.01, {}
            for step in range(12):
                if step in rates and step:
                    lr = rates[step]
                    versions[step] = session.set_hyperparams(learning_rate=lr)
                grads = make_grads(params, step, seed=2)
                assert max_abs_diff(session.push_pull(grads), reference.step(grads, lr, 0.01)) <= 1e-6
            assert versions == {4: 5, 9: 10}  # the step producing version N is the N-th
            changes = [r for r in session.history() if isinstance(r, HyperparamChange)]
            assert [(c.version, c.group, c.values) for c in changes] == [
                (5, "default", {"learning_rate": pytest.approx(0.003)}),
                (10, "default", {"learning_rate": pytest.approx(0.05)})]
        finally:
            session.close()


def test_two_async_workers_setting_the_same_value_change_it_once_at_one_version(server, unique_name):
    params = make_params(seed=8, shapes=SHAPES)
    with Client(server.address, timeout=120) as creator:
        session = creator.create_session(unique_name, params, optimizer={"name": "adam", "args": {"learning_rate": 0.01}},
                                         mode="async")
        try:
            for step in range(3):
                session.push(make_grads(params, step))
            answers, barrier = [], threading.Barrier(2)

            def worker(index):
                with Client(server.address, timeout=120) as client:
                    attached = client.session(unique_name)
                    barrier.wait()
                    answers.append(attached.set_hyperparams(learning_rate=0.002))
                    attached.push(make_grads(params, 10 + index))
                    answers.append(attached.set_hyperparams(learning_rate=0.002))  # in force already

            threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            changes = [r for r in session.history() if isinstance(r, HyperparamChange)]
            assert len(changes) == 1 and changes[0].values == {"learning_rate": pytest.approx(0.002)}
            assert set(answers) == {changes[0].version} == {4}
        finally:
            session.close()


def test_a_changed_value_reuses_the_compiled_update():
    params = make_params(seed=1, shapes=SHAPES)
    optimizer = build_optimizer("adamw", {"learning_rate": 0.01})
    updater = Updater(optimizer, param_specs={k: (v.shape, v.dtype) for k, v in params.items()})
    updater.initialize(params)
    updater.apply(make_grads(params, 0), 1.0, lambda partial: partial)
    before = compile_stats()["compiles"]
    for step, lr in enumerate([0.02, 0.005, 0.1], start=1):
        updater.set_hyper(optimizer.checked_hyperparams({"learning_rate": lr, "weight_decay": lr / 10}))
        updater.apply(make_grads(params, step), 1.0, lambda partial: partial)
    assert compile_stats()["compiles"] == before


def test_parameter_groups_each_run_their_own_options_as_optax_partition_would(server, unique_name):
    params = make_params(seed=9, shapes=SHAPES)
    groups = [{"tensors": ["hidden/b"], "weight_decay": 0.0, "learning_rate": 0.02},
              {"tensors": ["embed"], "learning_rate": 0.005}]
    labels = {"hidden/b": "no_decay", "embed": "embed", "hidden/w": "rest"}
    reference = Reference(lambda lr, wd: optax.partition(
        {"no_decay": optax.adamw(0.02, weight_decay=0.0), "embed": optax.adamw(0.005, weight_decay=0.1),
         "rest": optax.adamw(lr, weight_decay=0.1)}, labels), params)
    with Client(server.address, timeout=120) as client:
        session = client.create_session(unique_name, params, optimizer={
            "name": "adamw", "args": {"learning_rate": 0.01, "weight_decay": 0.1, "param_groups": groups}})
        try:
            for step in range(10):
                grads = make_grads(params, step, seed=4)
                assert max_abs_diff(session.push_pull(grads), reference.step(grads, 0.01, 0.0)) <= 1e-6
            session.set_hyperparams(group="default", learning_rate=0.001)  # the other groups keep theirs
            for step in range(10, 14):
                grads = make_grads(params, step, seed=4)
                assert max_abs_diff(session.push_pull(grads), reference.step(grads, 0.001, 0.0)) <= 1e-6
        finally:
            session.close()


@pytest.mark.parametrize("group, values, named", [
    (None, {"lr": 0.1}, ["'lr'", "can be set", "'learning_rate'"]),
    (None, {"learning_rate": -1.0}, ["'learning_rate'", "-1.0", ">= 0"]),
    (None, {"learning_rate": float("nan")}, ["'learning_rate'", "finite"]),
    ("3", {"learning_rate": 0.1}, ["group '3'", "'default'"]),
    (None, {}, ["no hyperparameter given"]),
])
def test_a_bad_hyperparameter_request_is_refused_by_name_and_changes_nothing(server, unique_name, group, values,
                                                                             named):
    params = make_params(seed=3, shapes=SHAPES)
    with Client(server.address, timeout=120) as client:
        session = client.create_session(unique_name, params, optimizer={"name": "adam", "args": {"learning_rate": 0.01}})
        try:
            with pytest.raises(InvalidArgumentError) as caught:
                session.set_hyperparams(group, **values)
            for part in named:
                assert part in str(caught.value)
            assert session.history() == []
            session.push(make_grads(params, 0))
        finally:
            session.close()


def test_a_scheduled_option_cannot_be_set_and_says_it_follows_a_schedule(server, unique_name):
    params = make_params(seed=3, shapes=SHAPES)
    schedule = {"schedule": "linear_schedule", "init_value": 0.1, "end_value": 0.0, "transition_steps": 10}
    with Client(server.address, timeout=120) as client:
        session = client.create_session(unique_name, params, optimizer={"name": "adam", "args": {"learning_rate": schedule}})
        try:
            with pytest.raises(InvalidArgumentError, match="'learning_rate' follows a schedule"):
                session.set_hyperparams(learning_rate=0.1)
            assert session.set_hyperparams(eps=1e-6) == 1
        finally:
            session.close()


@pytest.mark.parametrize("groups, named", [
    ([{"tensors": ["nope"], "learning_rate": 0.1}], ["'param_groups'[0]", "'nope'"]),
    ([{"tensors": ["embed"]}, {"tensors": ["embed"]}], ["'embed'", "already in group 0"]),
    ([{"tensors": ["embed"], "b1": 1.5}], ["param_groups[0]", "'b1'"]),
])
def test_bad_parameter_groups_are_refused_at_creation_by_name(server, unique_name, groups, named):
    params = make_params(seed=3, shapes=SHAPES)
    with Client(server.address, timeout=120) as client:
        with pytest.raises(InvalidArgumentError) as caught:
            client.create_session(unique_name, params, optimizer={
                "name": "adamw", "args": {"learning_rate": 0.01, "param_groups": groups}})
        for part in named:
            assert part in str(caught.value)
        assert unique_name not in client.list_sessions()


def test_status_shows_the_values_of_the_next_step_schedules_evaluated(server, unique_name):
    params = make_params(seed=3, shapes=SHAPES)
    schedule = {"schedule": "linear_schedule", "init_value": 0.1, "end_value": 0.0, "transition_steps": 10}
    with Client(server.address, timeout=120) as client:
        session = client.create_session(unique_name, params, optimizer={
            "name": "adamw", "args": {"learning_rate": schedule, "weight_decay": 0.01}})
        try:
            for step in range(4):
                session.push(make_grads(params, step))
            session.set_hyperparams(weight_decay=0.5)
            session.push(make_grads(params, 4))
            values = session.status().hyperparams["default"]
            assert values["learning_rate"] == pytest.approx(0.1 * (1 - 5 / 10))  # the 6th step's rate
            assert values["weight_decay"] == pytest.approx(0.5)
        finally:
            session.close()


def test_groups_and_schedules_apply_to_an_optax_optimizer_by_name():
    from _service_helpers import InProcess

    params = make_params(seed=4, shapes=SHAPES)
    schedule = {"schedule": "cosine_decay_schedule", "init_value": 0.01, "decay_steps": 10}
    args = {"learning_rate": 0.003, "param_groups": [{"tensors": ["hidden/b"], "learning_rate": schedule,
                                                       "weight_decay": 0.0}]}
    labels = {"hidden/b": "b", "embed": "rest", "hidden/w": "rest"}
    reference = InProcess("ref", {}, params, transformation=optax.partition({
        "b": optax.lion(optax.schedules.cosine_decay_schedule(0.01, 10), weight_decay=0.0),
        "rest": optax.lion(0.003)}, labels))
    served = InProcess("optax.lion", args, params)
    for step in range(8):
        grads = make_grads(params, step)
        assert max_abs_diff(served.step(grads), reference.step(grads)) <= 1e-6
