"""A durable server killed whole (SIGKILL of its process group) and started again with the same
``--checkpoint-dir`` on the same port: every session comes back, and clients resume as if nothing
happened.

One server is started, killed and started again for all of these checks (a server start is a Ray,
two shard processes and their compiles: the checks share it), each on a session of its own:

- survivor: the existing session object retries its step while the server is down and is served
  once the session is restored; a fresh client attaches and trains on exactly.
- scheduled: a session keeps its schedule position and the hyperparameters set with
  ``set_hyperparams``: the ones its steps ran with (checkpointed, and logged after the checkpoint)
  and one asked for but not yet run.
- elastic: an elastic session's history (participants, scales, timings, why each round committed)
  and its parameters continue exactly.
- sync / async: ``Session.history`` of plain sync and async sessions is the one the session had
  (versions before the checkpoint from the checkpointed clock, later ones from the ticket journal),
  and a replay of it reaches the served parameters.
- restored: a durable session created from a saved state (``Session.state()`` of a session on
  another server) survives the restart and continues as the uninterrupted session does.
- restarts: a client that kept its session steps again within seconds of the new server listening,
  however long the server was down. gRPC's default reconnect backoff grows 1.6x per failed dial
  (from 1 s, up to 120 s), and a channel waiting out its backoff fails every call at once without
  dialling: after half a minute down, the first step came 7-22 s after the new server listened
  (measured with gRPC's defaults). The SDK's channels dial at least once a second
  (``contract.RECONNECT_OPTIONS``), and a shard that serves at a new address gets fresh
  shared-memory regions before the step is resent (its predecessor's are unknown to it: one more
  refusal and backoff otherwise).
- locked: one server per ``--checkpoint-dir`` (:mod:`optserve.server.storage.dir_lock`): a second
  server on the folder is refused at once naming the first, the first untouched; the killed
  server's lock is taken over by the next one, which restores the session, and released at its
  clean shutdown.
- gone: while the server is down, a call of a client with a short timeout fails naming the
  address the user gave (not a shard's internal port), and the client said so once while retrying.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import numpy as np
import optax
import pytest

from optserve.client import Client
from optserve.client.status import HyperparamChange
from tests._restart_outages import SURVIVOR_OPTIMIZER, Gone, Locked, Reconnect
from tests._server_process import ServerProcess, free_port
from tests._service_helpers import InProcess, make_grads, make_params, max_abs_diff
from tests.test_elastic_sync import SGD, replay as elastic_replay, worker_grads
from tests.test_history_durable import _check, _create, _steps
from tests.test_history_modes import ADAM, replay as history_replay, rounds
from tests.test_session_state import OPTIMIZERS as STATE_OPTIMIZERS
from tests.test_session_state import SHAPES as STATE_SHAPES
from tests.test_session_state import _params as state_params
from tests.test_session_state import _train as state_train

STEP_WAIT_S = 150.0  # a step taken while the server is down is served within this of the restart


def _server(port: int, checkpoint_dir: str) -> ServerProcess:
    """``optserve serve`` in its own process group, on ``port``, waited for."""
    return ServerProcess("--checkpoint-dir", checkpoint_dir, "--checkpoint-every-steps", "3", port=port).wait_listening()


class _Stepping:
    """One ``push_pull`` of ``session`` in a thread of its own, started while the server is down."""

    def __init__(self, session, grads):
        self.result = {}
        self._thread = threading.Thread(target=lambda: self.result.update(params=session.push_pull(grads)))
        self._thread.start()

    def params(self, server: ServerProcess):
        self._thread.join(timeout=STEP_WAIT_S)
        assert not self._thread.is_alive() and "params" in self.result, "".join(server.lines[-30:])
        return self.result["params"]


# --- survivor: the session object retries its step across the restart; a fresh client trains on ---



class Survivor:
    def __init__(self):
        self.params = make_params(7)
        self.reference = InProcess(SURVIVOR_OPTIMIZER["name"], SURVIVOR_OPTIMIZER["args"], self.params)

    def before_kill(self, address: str) -> None:
        self.client = Client(address, timeout=150.0)
        self.session = self.client.create_session("survivor", self.params, optimizer=SURVIVOR_OPTIMIZER)
        for step in range(5):  # a checkpoint at 3, steps 4-5 in the logs
            grads = make_grads(self.params, step)
            got, expected = self.session.push_pull(grads), self.reference.step(grads)
        assert max_abs_diff(got, expected) <= 1e-6

    def while_down(self) -> None:
        # The same session object steps while the server is down: it waits and is served once the
        # restarted server restored the session (new shard addresses, read from the coordinator).
        self.grads = make_grads(self.params, 5)
        self.stepping = _Stepping(self.session, self.grads)

    def after_restart(self, address: str, server: ServerProcess, sessions: list[str]) -> None:
        assert max_abs_diff(self.stepping.params(server), self.reference.step(self.grads)) <= 1e-6
        with Client(address, timeout=60.0) as fresh_client:  # a fresh client attaches and trains on
            assert sorted(fresh_client.list_sessions()) == sorted(sessions)  # every session came back, no other
            fresh = fresh_client.session("survivor")
            assert fresh.version == 6
            for step in range(6, 9):
                grads = make_grads(self.params, step)
                got, expected = fresh.push_pull(grads), self.reference.step(grads)
            assert max_abs_diff(got, expected) <= 1e-6
            status = fresh.status()
            assert status.version == 9
            assert [s.durability.recoveries for s in status.shards] == [1, 1]
            fresh.detach()
        self.client.close()


# --- scheduled: the schedule position and the hyperparameters set survive the restart -------------

WARMUP_COSINE = {"schedule": "warmup_cosine_decay_schedule", "init_value": 0.0, "peak_value": 0.02,
                 "warmup_steps": 3, "decay_steps": 14, "end_value": 0.001}
SCHEDULED_OPTIMIZER = {"name": "adamw", "args": {"learning_rate": WARMUP_COSINE, "weight_decay": 0.1}}
DECAYS = {2: 0.05, 4: 0.02, 6: 0.3}  # step -> weight decay set before it (6: set before the kill)


class AdamwReference:
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


class Scheduled:
    def __init__(self):
        self.params = make_params(11)
        self.reference = AdamwReference(self.params)

    def before_kill(self, address: str) -> None:
        self.client = Client(address, timeout=150.0)
        self.session = self.client.create_session("scheduled", self.params, optimizer=SCHEDULED_OPTIMIZER)
        wd = 0.1
        for step in range(6):  # a checkpoint at 3 (one change in it), step 4-6 in the logs (another)
            if step in DECAYS:
                wd = DECAYS[step]
                self.session.set_hyperparams(weight_decay=wd)
            grads = make_grads(self.params, step)
            assert max_abs_diff(self.session.push_pull(grads), self.reference.step(grads, wd)) <= 1e-6
        self.wd = DECAYS[6]
        assert self.session.set_hyperparams(weight_decay=self.wd) == 7  # journaled, not yet run by any step

    def while_down(self) -> None:
        self.grads = make_grads(self.params, 6)
        self.stepping = _Stepping(self.session, self.grads)

    def after_restart(self, address: str, server: ServerProcess, sessions: list[str]) -> None:
        wd = self.wd
        assert max_abs_diff(self.stepping.params(server), self.reference.step(self.grads, wd)) <= 1e-6
        for step in range(7, 12):  # the schedule goes on from its position
            grads = make_grads(self.params, step)
            assert max_abs_diff(self.session.push_pull(grads), self.reference.step(grads, wd)) <= 1e-6
        changes = [(c.version, c.values["weight_decay"]) for c in self.session.history()
                   if isinstance(c, HyperparamChange)]
        assert changes == [(3, pytest.approx(0.05)), (5, pytest.approx(0.02)), (7, pytest.approx(0.3))]
        self.client.close()


# --- elastic: history and parameters continue exactly ----------------------------------------------


def _elastic_rounds(sessions, params, count):
    with concurrent.futures.ThreadPoolExecutor(len(sessions)) as pool:
        for _ in range(count):
            for f in [pool.submit(s.push_pull, worker_grads(params, s.worker_id, s.version)) for s in sessions]:
                f.result()


class Elastic:
    def __init__(self):
        self.params = make_params(31)

    def before_kill(self, address: str) -> None:
        with Client(address, timeout=120.0) as client:
            owner = client.create_session("elastic", self.params, SGD, num_workers=3, min_workers=2)
            a, b = (client.session("elastic", worker_id=w) for w in ("a", "b"))
            _elastic_rounds([a, b], self.params, 5)  # a checkpoint at 3, rounds 4-5 in the logs and the journal
            self.before = a.history()
            assert [r.version for r in self.before] == [1, 2, 3, 4, 5]
            for s in (owner, a, b):
                s.detach()

    def while_down(self) -> None:
        pass

    def after_restart(self, address: str, server: ServerProcess, sessions: list[str]) -> None:
        with Client(address, timeout=120.0) as client:
            a, b = (client.session("elastic", worker_id=w) for w in ("a", "b"))
            assert a.version == 5
            assert a.history() == self.before  # exact: timings and reasons came back from the journal
            _elastic_rounds([a, b], self.params, 3)
            history = a.history()
            assert [r.version for r in history] == list(range(1, 9))
            got, want = a.pull(), elastic_replay(self.params, history)
            assert max(float(np.max(np.abs(got[n] - want[n]))) for n in self.params) < 1e-6
            a.detach(), b.detach()


# --- sync / async: plain sessions' history is the one they had -------------------------------------


class Histories:
    MODES = ("sync", "async")

    def __init__(self):
        self.params = make_params(53)

    def before_kill(self, address: str) -> None:
        self.before = {}
        with Client(address, timeout=120.0) as client:
            for mode in self.MODES:
                owner = _create(client, mode, mode, self.params)
                a, b = (client.session(mode, worker_id=w) for w in ("a", "b"))
                _steps(mode, a, b, self.params, 0)
                # a checkpoint at 3, later versions in the logs and the journal
                _steps(mode, a, b, self.params, a.status().version)
                self.before[mode] = rounds(a.history())
                for s in (owner, a, b):
                    s.detach()

    def while_down(self) -> None:
        pass

    def after_restart(self, address: str, server: ServerProcess, sessions: list[str]) -> None:
        with Client(address, timeout=120.0) as client:
            for mode in self.MODES:
                a, b = (client.session(mode, worker_id=w) for w in ("a", "b"))
                assert rounds(a.history()) == self.before[mode], mode  # exact: sync rounds' timings from the journal
                start = a.status().version
                _steps(mode, a, b, self.params, start)
                history = rounds(a.history())
                assert history[:len(self.before[mode])] == self.before[mode]
                _check(mode, history[len(self.before[mode]):], a, b, start)
                assert max_abs_diff(a.pull(), history_replay(ADAM, self.params, history)) <= 1e-6, mode
                a.detach(), b.detach()


# --- restored: a session created from a saved state survives the restart ---------------------------


class Restored:
    def __init__(self, source_address: str, source_name: str):
        with Client(source_address) as client:  # the saved state: a session of another server
            source = client.create_session(source_name, state_params(), STATE_OPTIMIZERS[0])
            state_train(source, range(4))
            self.saved = source.state()
            self.uninterrupted = state_train(source, range(4, 8))
            source.close()

    def before_kill(self, address: str) -> None:
        self.client = Client(address, timeout=120.0)
        restored = self.client.create_session("restored", state=self.saved)
        state_train(restored, range(4, 6))  # versions 5 and 6, in the step log after the checkpoint at 4

    def while_down(self) -> None:
        pass

    def after_restart(self, address: str, server: ServerProcess, sessions: list[str]) -> None:
        back = self.client.session("restored")
        assert back.version == 6
        continued = state_train(back, range(6, 8))
        assert back.version == 8
        self.client.close()
        for name in STATE_SHAPES:
            np.testing.assert_allclose(continued[name], self.uninterrupted[name], rtol=1e-6, atol=1e-6, err_msg=name)


def _kill_tree(server: ServerProcess) -> None:
    """SIGKILL of the server and every process under it, its shard actors included (Ray puts
    each worker in a process group of its own, which a signal to the server's group misses)."""
    import psutil

    tree = psutil.Process(server.process.pid).children(recursive=True)
    for process in tree:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    server.kill_group()
    psutil.wait_procs(tree, timeout=30)


@pytest.mark.slow
def test_whole_server_sigkill_and_restart_restores_every_session_and_each_continues_exactly(
        server, unique_name, tmp_path, caplog):
    port, checkpoint_dir = free_port(), str(tmp_path / "ckpt")
    address = f"127.0.0.1:{port}"
    reconnect, locked = Reconnect(), Locked(checkpoint_dir)
    checks = [Survivor(), Scheduled(), Elastic(), Histories(), Restored(server.address, f"{unique_name}-a"), locked,
              reconnect, Gone(caplog)]
    sessions = ["survivor", "scheduled", "elastic", *Histories.MODES, "restored", "locked", "restarts", "gone"]
    first = _server(port, checkpoint_dir)
    locked.first_pid = first.process.pid
    second = None
    try:
        for check in checks:
            check.before_kill(address)
        _kill_tree(first)
        for check in checks:
            check.while_down()
        reconnect.wait_out_the_downtime()
        second = _server(port, checkpoint_dir)
        reconnect.listening_at = time.monotonic()
        for check in checks:
            check.after_restart(address, second, sessions)
        assert second.stop() == 0
        locked.after_stop()
    finally:
        for process in (first, second):
            if process is not None and process.process.poll() is None:
                _kill_tree(process)
