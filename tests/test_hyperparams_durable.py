"""A durable server killed whole (SIGKILL of its process group) and started again keeps each
session's schedule position and the hyperparameters set with ``set_hyperparams``: the ones its
steps ran with (checkpointed, and logged after the checkpoint) and one asked for but not yet run."""

from __future__ import annotations

import threading

import numpy as np
import optax
import pytest

from optserve.client import Client
from optserve.client.status import HyperparamChange
from tests._server_process import ServerProcess, free_port
from tests._service_helpers import make_grads, make_params, max_abs_diff

WARMUP_COSINE = {"schedule": "warmup_cosine_decay_schedule", "init_value": 0.0, "peak_value": 0.02,
                 "warmup_steps": 3, "decay_steps": 14, "end_value": 0.001}
OPTIMIZER = {"name": "adamw", "args": {"learning_rate": WARMUP_COSINE, "weight_decay": 0.1}}
DECAYS = {2: 0.05, 4: 0.02, 6: 0.3}  # step -> weight decay set before it (6: set before the kill)


class Reference:
    """optax.adamw in process: the same schedule, the weight decay a value of each step."""

    def __init__(self, params):
        import jax

        schedule = optax.schedules.warmup_cosine_decay_schedule(0.0, 0.02, 3, 14, 0.001)
        make = lambda wd: optax.adamw(schedule, weight_decay=wd)  # noqa: E731
        self.params = {k: jax.numpy.asarray(v) for k, v in params.items()}
        self.state = make(0.1).init(self.params)

        def step(params, state, grads, wd):
            updates, state = make(wd).update(grads, state, params)
            return optax.apply_updates(params, updates), state

        self._step = jax.jit(step)

    def step(self, grads, wd):
        self.params, self.state = self._step(self.params, self.state, grads, np.float32(wd))
        return {k: np.asarray(v) for k, v in self.params.items()}


@pytest.mark.slow
def test_a_restarted_server_keeps_the_schedule_position_and_the_changed_values(tmp_path):
    port, checkpoint_dir = free_port(), str(tmp_path / "ckpt")
    address = f"127.0.0.1:{port}"
    params = make_params(11)
    reference = Reference(params)
    server = ServerProcess("--checkpoint-dir", checkpoint_dir, "--checkpoint-every-steps", "3",
                           port=port).wait_listening()
    restarted = None
    try:
        client = Client(address, timeout=150.0)
        session = client.create_session("scheduled", params, optimizer=OPTIMIZER)
        wd = 0.1
        for step in range(6):  # a checkpoint at 3 (one change in it), step 4-6 in the logs (another)
            if step in DECAYS:
                wd = DECAYS[step]
                session.set_hyperparams(weight_decay=wd)
            grads = make_grads(params, step)
            assert max_abs_diff(session.push_pull(grads), reference.step(grads, wd)) <= 1e-6
        wd = DECAYS[6]
        assert session.set_hyperparams(weight_decay=wd) == 7  # journaled, not yet run by any step

        server.kill_group()
        result = {}
        grads = make_grads(params, 6)
        stepping = threading.Thread(target=lambda: result.update(params=session.push_pull(grads)))
        stepping.start()
        restarted = ServerProcess("--checkpoint-dir", checkpoint_dir, "--checkpoint-every-steps", "3",
                                  port=port).wait_listening()
        stepping.join(timeout=150)
        assert not stepping.is_alive() and "params" in result, "".join(restarted.lines[-30:])
        assert max_abs_diff(result["params"], reference.step(grads, wd)) <= 1e-6
        for step in range(7, 12):  # the schedule goes on from its position
            grads = make_grads(params, step)
            assert max_abs_diff(session.push_pull(grads), reference.step(grads, wd)) <= 1e-6
        changes = [(c.version, c.values["weight_decay"]) for c in session.history() if isinstance(c, HyperparamChange)]
        assert changes == [(3, pytest.approx(0.05)), (5, pytest.approx(0.02)), (7, pytest.approx(0.3))]
        client.close()
    finally:
        for process in (server, restarted):
            if process is not None:
                process.kill_group()
