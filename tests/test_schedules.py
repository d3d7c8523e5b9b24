"""Schedules given by spec ({"schedule": NAME, ...}): each equals the optax schedule it names, a bad
spec is refused naming the optimizer, the argument, the schedule and the keyword, and a session
whose learning rate and weight decay follow schedules trains exactly as optax does in process."""

from __future__ import annotations

import numpy as np
import optax
import pytest

from _service_helpers import InProcess, make_grads, make_params, max_abs_diff
from optserve.client import Client, InvalidArgumentError
from optserve.optim_kernels import SCHEDULES, build_optimizer
from optserve.optim_kernels.schedules import build_schedule

WARMUP_COSINE = {"schedule": "warmup_cosine_decay_schedule", "init_value": 0.0, "peak_value": 0.02,
                 "warmup_steps": 5, "decay_steps": 30, "end_value": 0.001}
LINEAR_DECAY = {"schedule": "linear_schedule", "init_value": 0.1, "end_value": 0.0, "transition_steps": 25}

CASES = {
    "warmup_cosine": (WARMUP_COSINE, optax.schedules.warmup_cosine_decay_schedule(0.0, 0.02, 5, 30, 0.001)),
    "linear": (LINEAR_DECAY, optax.schedules.linear_schedule(0.1, 0.0, 25)),
    "exponential": ({"schedule": "exponential_decay", "init_value": 0.5, "transition_steps": 4, "decay_rate": 0.9,
                     "staircase": True}, optax.schedules.exponential_decay(0.5, 4, 0.9, staircase=True)),
    "piecewise, steps as JSON keys": (
        {"schedule": "piecewise_constant_schedule", "init_value": 0.1, "boundaries_and_scales": {"10": 0.5, "20": 0.1}},
        optax.schedules.piecewise_constant_schedule(0.1, {10: 0.5, 20: 0.1})),
    "join of nested specs": (
        {"schedule": "join_schedules", "boundaries": [8],
         "schedules": [{"schedule": "linear_schedule", "init_value": 0.0, "end_value": 0.01, "transition_steps": 8},
                       {"schedule": "cosine_decay_schedule", "init_value": 0.01, "decay_steps": 20}]},
        optax.schedules.join_schedules([optax.schedules.linear_schedule(0.0, 0.01, 8),
                                        optax.schedules.cosine_decay_schedule(0.01, 20)], [8])),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_schedule_spec_equals_the_optax_schedule_it_names(case):
    spec, expected = CASES[case]
    schedule = build_schedule(spec, "test")
    steps = np.arange(40)
    np.testing.assert_array_equal([float(schedule(s)) for s in steps], [float(expected(s)) for s in steps])


def test_every_schedule_constructor_of_optax_is_served_and_nothing_else():
    assert "warmup_cosine_decay_schedule" in SCHEDULES and "exponential_decay" in SCHEDULES
    assert "join_schedules" in SCHEDULES and "inject_hyperparams" not in SCHEDULES
    assert all(name.endswith(("_schedule", "_decay", "_schedules")) for name in SCHEDULES)


@pytest.mark.parametrize("args, named", [
    ({"learning_rate": {"schedule": "cosine_warmup"}}, ["'learning_rate'", "unknown schedule 'cosine_warmup'"]),
    ({"learning_rate": dict(LINEAR_DECAY, decay=0.5)}, ["'learning_rate'", "'linear_schedule'", "no keyword 'decay'"]),
    ({"learning_rate": {"schedule": "linear_schedule", "init_value": 0.1}}, ["'linear_schedule'", "'end_value'"]),
    ({"learning_rate": 0.1, "b1": {"schedule": "constant_schedule", "value": 0.9}}, ["'b1' takes no schedule"]),
    ({"learning_rate": {"schedule": "constant_schedule", "value": float("nan")}}, ["'constant_schedule'", "finite"]),
    ({"learning_rate": {"schedule": "piecewise_constant_schedule", "init_value": 0.1,
                        "boundaries_and_scales": {"ten": 0.5}}}, ["'boundaries_and_scales'", "integer steps"]),
])
def test_a_bad_schedule_spec_is_refused_naming_the_optimizer_argument_schedule_and_keyword(args, named):
    with pytest.raises(ValueError) as caught:
        build_optimizer("adam", args)
    for part in ["optimizer 'adam'", *named]:
        assert part in str(caught.value)


def _optax_adamw() -> optax.GradientTransformation:
    return optax.adamw(learning_rate=CASES["warmup_cosine"][1], weight_decay=CASES["linear"][1])


SCHEDULED_ADAMW = {"name": "adamw", "args": {"learning_rate": WARMUP_COSINE, "weight_decay": LINEAR_DECAY}}


def test_a_session_with_scheduled_learning_rate_and_weight_decay_equals_optax_in_process(server, unique_name):
    params = make_params(seed=5, shapes={"embed": (16, 12), "hidden/w": (12, 10), "hidden/b": (10,)})
    reference = InProcess("optax.adamw", {}, params, transformation=_optax_adamw())
    with Client(server.address, timeout=120) as client:
        session = client.create_session(unique_name, params, optimizer=SCHEDULED_ADAMW)
        try:
            assert len(session.info.shards) == 2
            worst = 0.0
            for step in range(30):  # through the warmup, the decay and the weight decay's end
                grads = make_grads(params, step, seed=3)
                worst = max(worst, max_abs_diff(session.push_pull(grads), reference.step(grads)))
            assert worst <= 1e-6, worst
        finally:
            session.close()


def test_a_bad_schedule_spec_is_refused_at_creation_with_invalid_argument(server, unique_name):
    with Client(server.address, timeout=60) as client:
        with pytest.raises(InvalidArgumentError, match="unknown schedule 'cosine_warmup'"):
            client.create_session(unique_name, {"w": np.zeros(4, np.float32)},
                                  optimizer={"name": "adam", "args": {"learning_rate": {"schedule": "cosine_warmup"}}})
        assert unique_name not in client.list_sessions()
