"""Durable sessions (``--checkpoint-dir``): real SIGKILLs of shard processes, no acknowledged update lost.

A durable server logs every step before acknowledging it and checkpoints each session at one
version across its shards; a shard whose process dies is replaced and restores its part from
its latest checkpoint plus its step log. The same client object keeps calling ``push_pull``
across the kill, and the result equals an uninterrupted in-process run.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from optserve.client import Client, SessionLostError
from tests._service_helpers import InProcess, exact_offloaded_shampoo, make_grads, make_params, max_abs_diff

OPTIMIZER = {"name": "adafactor_hf", "args": {"lr": 0.01, "relative_step": False, "beta1": 0.9}}


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="module")
def durable_server(ray_local, checkpoint_dir):
    """A durable server of its own (these tests kill its shards): a checkpoint every 4 steps, one
    preconditioner worker for Shampoo, the step log written with direct I/O (always; the default,
    auto, does so where the filesystem takes it)."""
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig
    from optserve.server.domain.durability import DurabilityConfig, LogIO

    running = start_server(ServerConfig(host="127.0.0.1", port=0, shards=2, vote_timeout_s=20.0, min_shard_bytes=0,
                                        precond_workers=1, durability=DurabilityConfig(checkpoint_dir, every_steps=4,
                                                                                       log_io=LogIO.DIRECT)))
    yield running
    running.stop()


def _kill_shard(running, index: int) -> int:
    pid = running.fleet.pids()[index]
    os.kill(pid, signal.SIGKILL)
    return pid


CLIPPED = {"name": "adafactor", "args": {"learning_rate": 0.01, "global_norm_clip_threshold": 0.5}}
# a schedule picks up where it was: it is evaluated at the optimizer state's own step count
SCHEDULED = {"name": "adamw", "args": {
    "learning_rate": {"schedule": "warmup_cosine_decay_schedule", "init_value": 0.0, "peak_value": 0.02,
                      "warmup_steps": 3, "decay_steps": 12},
    "weight_decay": {"schedule": "linear_schedule", "init_value": 0.1, "end_value": 0.0, "transition_steps": 10}}}


@pytest.mark.parametrize("killed, optimizers", [(0, {"adafactor_hf": OPTIMIZER, "cross-shard-sum": CLIPPED}),
                                               (1, {"adafactor_hf": OPTIMIZER, "schedules": SCHEDULED})],
                         ids=["home-shard", "other-shard"])
def test_sync_sessions_survive_a_shard_sigkill_with_no_acknowledged_step_lost(durable_server, unique_name, killed,
                                                                              optimizers):
    """adafactor_hf with momentum; T5X adafactor clipping by the global norm, whose update needs a
    sum over both shards each step (the restarted clock answers sums from its journal); and
    schedules, which pick up where they were. One kill serves a session of each optimizer: the
    first step of each after it spans the recovery."""
    client = Client(durable_server.address, timeout=90.0)
    # dense/w's gradient (83 KB) lies page aligned in the push region: the log writes its whole
    # blocks with direct I/O, straight from there
    params = make_params(3, {"dense/w": (130, 160), "dense/b": (160,), "out/w": (160, 4), "out/b": (4,)})
    sessions, references, got, expected = {}, {}, {}, {}
    for label, optimizer in optimizers.items():
        sessions[label] = client.create_session(f"{unique_name}-{label}", params, optimizer=optimizer)
        assert len(sessions[label].info.shards) == 2
        references[label] = InProcess(optimizer["name"], optimizer["args"], params)
    for step in range(6):  # a checkpoint at 4, steps 5-6 only in the log
        grads = make_grads(params, step)
        for label, session in sessions.items():
            got[label], expected[label] = session.push_pull(grads), references[label].step(grads)
    for session in sessions.values():
        assert session.data_paths() == {0: "shared_memory", 1: "shared_memory"}  # same host: the fast path
    _kill_shard(durable_server, killed)
    # the same client objects: the first step of each session after the kill spans the recovery
    first = {label: session.push_pull_async(make_grads(params, 6)) for label, session in sessions.items()}
    for label, pending in first.items():
        got[label], expected[label] = pending.result(timeout=120), references[label].step(make_grads(params, 6))
    for step in range(7, 12):
        grads = make_grads(params, step)
        for label, session in sessions.items():
            got[label], expected[label] = session.push_pull(grads), references[label].step(grads)
    from optserve.client.cli import collect, render

    for label, session in sessions.items():
        assert max_abs_diff(got[label], expected[label]) <= 1e-6, label
        assert session.data_paths() == {0: "shared_memory", 1: "shared_memory"}  # regions made anew on the new shard
        status = session.status()
        assert status.version == 12
        durability = [s.durability for s in status.shards]
        assert all(d is not None for d in durability)
        assert [d.recoveries for d in durability] == [int(i == killed) for i in range(2)], label
        assert all(d.log_direct for d in durability)
        deadline = time.monotonic() + 30  # checkpoints are written in the background
        while min(d.durable_version for d in durability) < 8 and time.monotonic() < deadline:
            time.sleep(0.2)
            durability = [s.durability for s in session.status().shards]
        assert min(d.durable_version for d in durability) >= 8, durability  # checkpoints go on after the recovery
        name = f"{unique_name}-{label}"
        (entry,) = [e for e in collect(client)["sessions"] if e["name"] == name]  # what `optserve status` shows
        assert entry["recoveries"] == 1 and entry["durable_version"] >= 8
        assert entry["logged_version"] == 12  # every acknowledged step is in the log, checkpointed or not
        table = render({"sessions": [entry], "lost_sessions": [], "shards": []})
        assert "durable (logged/checkpointed)" in table and f"12/{entry['durable_version']}" in table
        session.close()
    client.close()


def test_async_two_clients_every_acknowledged_push_applies_exactly_once_across_a_shard_kill(
        durable_server, unique_name):
    """Two clients push concurrently (async, no staleness limit) while the home shard is killed:
    the session's version counts every acknowledged push exactly once, and the parameters equal
    the in-process optimizer fed the same gradients in the clock's order."""
    owner = Client(durable_server.address, timeout=90.0)
    params = make_params(4)
    session = owner.create_session(unique_name, params, optimizer={"name": "sgd", "args": {"learning_rate": 0.1}},
                                   mode="async")
    steps_each = 10
    acknowledged: list[int] = []
    lock = threading.Lock()
    killed = threading.Event()

    def worker(seed: int, handle):
        for step in range(steps_each):
            grads = {k: np.full_like(v, float(seed)) for k, v in params.items()}  # each push moves params by -0.1*seed
            handle.push_pull(grads)
            with lock:
                acknowledged.append(seed)
            if seed == 1 and step == 3:
                _kill_shard(durable_server, 0)
                killed.set()

    other = Client(durable_server.address, timeout=90.0)
    threads = [threading.Thread(target=worker, args=(1, session)),
               threading.Thread(target=worker, args=(2, other.session(unique_name)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert killed.is_set() and not any(t.is_alive() for t in threads)
    assert len(acknowledged) == 2 * steps_each
    final = session.pull()
    assert session.status().version == 2 * steps_each  # each acknowledged push applied once, none twice
    expected_shift = 0.1 * (1 * steps_each + 2 * steps_each)
    for name, value in final.items():
        np.testing.assert_allclose(value, params[name] - expected_shift, rtol=0, atol=1e-5)
    session.close()
    owner.close()
    other.close()


def test_a_session_whose_every_shard_dies_at_once_is_restored_at_one_version_and_trains_on(durable_server,
                                                                                            unique_name):
    """Both shards SIGKILLed together, as a lost machine holding them both takes them: they are
    restarted side by side and the session, with no live part left, is restored at the version
    both logged (a step its clock decided that no shard logged is forgotten, not left decided and
    applied nowhere). The same client object trains on; the result equals an uninterrupted run."""
    optimizer = {"name": "adam", "args": {"learning_rate": 0.01}}
    params = make_params(6)
    reference = InProcess(optimizer["name"], optimizer["args"], params)
    with Client(durable_server.address, timeout=90.0) as client:
        session = client.create_session(unique_name, params, optimizer=optimizer)
        for step in range(5):
            session.push_pull(make_grads(params, step))
            reference.step(make_grads(params, step))
        pids = durable_server.fleet.pids()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        for step in range(5, 10):
            got = session.push_pull(make_grads(params, step))
            expected = reference.step(make_grads(params, step))
        assert not set(durable_server.fleet.pids()) & set(pids)
        assert session.status().version == 10
        for name in params:
            np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=1e-6)
        session.close()


def _shard_folder(checkpoint_dir: str, session: str, shard: int) -> str:
    import urllib.parse

    return os.path.join(checkpoint_dir, "sessions", urllib.parse.quote(session, safe=""), f"shard-{shard}")


def _wait_durable(session, version: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if min(s.durability.durable_version for s in session.status().shards) >= version:
            return
        time.sleep(0.1)
    raise AssertionError(f"no checkpoint of version {version} on every shard within {timeout_s:.0f} s")


def test_a_user_loads_a_sessions_checkpoint_into_their_own_jax_program(durable_server, checkpoint_dir, unique_name):
    """The README's recipe: load_checkpoint gives the newest version every shard has, its
    parameters equal what the session served at that version, and each shard's folder is a plain
    orbax checkpoint that StandardCheckpointer restores into the optimizer's own state structure."""
    import jax
    import orbax.checkpoint as ocp

    from optserve.optim_kernels import build_optimizer
    from optserve.server.storage import load_checkpoint

    client = Client(durable_server.address, timeout=90.0)
    params = make_params(4)
    session = client.create_session(unique_name, params, optimizer=OPTIMIZER)
    for step in range(4):  # a checkpoint at 4
        served = session.push_pull(make_grads(params, step))
    _wait_durable(session, 4)
    loaded = load_checkpoint(checkpoint_dir, unique_name)
    assert loaded["version"] == 4 and len(loaded["opt_state"]) == 2
    assert sorted(loaded["params"]) == sorted(params)
    assert all(np.array_equal(loaded["params"][n], served[n]) for n in params)
    shard = session.info.shards[0]
    mine = {n: params[n] for n in shard.tensor_names}
    tx = build_optimizer(OPTIMIZER["name"], OPTIMIZER["args"]).transformation
    target = {"params": mine, "opt_state": tx.init(mine)}
    restored = ocp.StandardCheckpointer().restore(os.path.join(_shard_folder(checkpoint_dir, unique_name, 0),
                                                               "checkpoint-4"), target)
    assert jax.tree.structure(restored["opt_state"]) == jax.tree.structure(target["opt_state"])
    assert all(np.array_equal(np.asarray(restored["params"][n]), served[n]) for n in mine)
    session.close()
    client.close()


def test_a_damaged_checkpoint_is_reported_naming_it_and_never_loaded(durable_server, checkpoint_dir, unique_name):
    """Two sessions, the latest checkpoint of each on shard 1 damaged (flipped bytes; truncated),
    one SIGKILL of shard 1: each session is lost, its error naming it, the shard and the file."""
    client = Client(durable_server.address, timeout=90.0)
    params = make_params(5)
    sessions, latest = {}, {}
    for damage in ("flipped-bytes", "truncated"):
        name = f"{unique_name}-{damage}"
        session = sessions[damage] = client.create_session(name, params, optimizer=OPTIMIZER)
        for step in range(4):
            session.push_pull(make_grads(params, step))
        _wait_durable(session, 4)
        folder = _shard_folder(checkpoint_dir, name, 1)
        latest[damage] = max(int(n[len("checkpoint-"):-len(".json")]) for n in os.listdir(folder)
                             if n.startswith("checkpoint-") and n.endswith(".json"))
        files = [os.path.join(root, f) for root, _, names in
                 os.walk(os.path.join(folder, f"checkpoint-{latest[damage]}")) for f in names]
        target = max(files, key=os.path.getsize)  # the arrays' data file
        size = os.path.getsize(target)
        with open(target, "r+b") as fh:
            if damage == "truncated":
                fh.truncate(size // 2)
            else:
                fh.seek(size // 4)
                chunk = bytearray(fh.read(size // 2))
                fh.seek(size // 4)
                fh.write(bytes(b ^ 0x5A for b in chunk))
    _kill_shard(durable_server, 1)
    for damage, session in sessions.items():
        with pytest.raises(SessionLostError) as lost:
            session.push_pull(make_grads(params, 4))
        message = str(lost.value)
        name = f"{unique_name}-{damage}"
        assert name in message and "shard 1" in message and f"checkpoint-{latest[damage]}" in message, message
        session.close()
    client.close()


def test_a_shard_killed_while_writing_a_checkpoint_restores_the_previous_one_plus_its_log(
        durable_server, checkpoint_dir, unique_name):
    """A checkpoint half-written by a killed process is never used: the previous checkpoint and the
    step log give back every acknowledged step (a larger tensor, so the write takes a while)."""
    client = Client(durable_server.address, timeout=90.0)
    params = make_params(6, shapes={"big/w": (2048, 2048), "small/b": (16,)})
    reference = InProcess("sgd", {"learning_rate": 0.05}, params)
    session = client.create_session(unique_name, params, optimizer={"name": "sgd", "args": {"learning_rate": 0.05}})
    folder = _shard_folder(checkpoint_dir, unique_name, 0)
    caught_mid_write = False
    step = 0
    while step < 40 and not caught_mid_write:
        grads = make_grads(params, step)
        got, expected = session.push_pull(grads), reference.step(grads)
        step += 1
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            names = os.listdir(folder)
            writing = [n for n in names if n.startswith("checkpoint-") and ".json" not in n
                       and f"{n.split('.')[0]}.json" not in names]
            if writing:
                _kill_shard(durable_server, 0)
                caught_mid_write = True
                break
            time.sleep(0.002)
    assert caught_mid_write, "no checkpoint was ever seen being written"
    for _ in range(3):
        grads = make_grads(params, step)
        got, expected = session.push_pull(grads), reference.step(grads)
        step += 1
    assert max_abs_diff(got, expected) <= 1e-6
    assert session.status().version == step
    session.close()
    client.close()


def test_shampoo_with_preconditioner_workers_survives_a_shard_kill_exactly(durable_server, unique_name):
    """Age bound 0: every root comes from the worker before it is needed, so the run is
    deterministic and a restored, replayed shard matches in-process Shampoo."""
    client = Client(durable_server.address, timeout=120.0)
    session, reference, params = exact_offloaded_shampoo(client, unique_name)
    worst = 0.0
    for step in range(12):
        if step == 7:
            _kill_shard(durable_server, 1)
        grads = make_grads(params, step, seed=7)
        worst = max(worst, max_abs_diff(session.push_pull(grads), reference.step(grads)))
    assert worst <= 1e-5, worst
    status = session.status()
    assert status.version == 12 and status.shards[1].durability.recoveries == 1
    assert all(s.root_offload.offloaded for s in status.shards)
    session.close()
    client.close()


@pytest.mark.parametrize("killed", [0, 1], ids=["home-shard", "other-shard"])
def test_a_push_in_flight_during_a_shard_kill_applies_exactly_once(durable_server, unique_name, killed):
    """Sync with two workers: the first worker's push is staged and waits for the second when a
    shard is killed; it is retried (same sequence) through the recovery and the step averages the
    two pushes exactly once."""
    sgd = {"name": "sgd", "args": {"learning_rate": 0.1}}
    first_client, second_client = Client(durable_server.address, timeout=90.0), Client(durable_server.address,
                                                                                       timeout=90.0)
    params = make_params(8)
    first = first_client.create_session(unique_name, params, optimizer=sgd, num_workers=2)
    second = second_client.session(unique_name)
    g1, g2 = make_grads(params, 0), make_grads(params, 1)
    pending = first.push_pull_async(g1)
    time.sleep(1.0)  # staged on both shards, waiting for the second worker
    assert not pending.done()
    _kill_shard(durable_server, killed)
    got_second = second.push_pull(g2)
    got_first = pending.result(timeout=120)
    expected = {k: params[k] - 0.1 * (g1[k] + g2[k]) / 2 for k in params}
    assert max_abs_diff(got_first, expected) <= 1e-6 and max_abs_diff(got_second, expected) <= 1e-6
    status = first.status()
    assert status.version == 1 and status.pushes_accepted == 2
    first.close()
    second.detach()
    first_client.close()
    second_client.close()


def test_a_durable_session_idle_past_its_lease_is_unloaded_and_comes_back_on_its_next_step(ray_local, tmp_path,
                                                                                            unique_name):
    """``--session-idle-s`` on a durable server: an idle session is checkpointed and freed on its
    shards but stays listed; the same client's next step loads it back and trains on exactly."""
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig
    from optserve.server.domain.durability import DurabilityConfig

    server = start_server(ServerConfig(host="127.0.0.1", port=0, shards=2, min_shard_bytes=0, session_idle_s=1.5,
                                       durability=DurabilityConfig(str(tmp_path))))
    try:
        client = Client(server.address, timeout=90.0)
        params = make_params(9)
        reference = InProcess(OPTIMIZER["name"], OPTIMIZER["args"], params)
        session = client.create_session(unique_name, params, optimizer=OPTIMIZER)
        for step in range(3):
            grads = make_grads(params, step)
            got, expected = session.push_pull(grads), reference.step(grads)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and sum(s.sessions for s in client.server_status()) > 0:
            time.sleep(0.25)
        assert sum(s.sessions for s in client.server_status()) == 0  # freed on every shard
        assert client.list_sessions() == [unique_name]  # but still the caller's session
        for step in range(3, 6):
            grads = make_grads(params, step)
            got, expected = session.push_pull(grads), reference.step(grads)
        assert max_abs_diff(got, expected) <= 1e-6
        assert session.status().version == 6
        session.close()
        client.close()
    finally:
        server.stop()


def test_a_session_of_many_tensors_whose_state_is_chunked_survives_a_shard_sigkill_exactly(durable_server,
                                                                                          checkpoint_dir, unique_name):
    """150 small tensors (75 per shard: each shard's optimizer state is kept in chunks, see
    chunked_update) with a cross-shard sum: the checkpoint records the layout and the restored
    shard reads it back."""
    client = Client(durable_server.address, timeout=90.0)
    params = make_params(8, {f"blocks/{i:03d}/{kind}": shape for i in range(75)
                             for kind, shape in (("w", (5, 4)), ("b", (4,)))})
    session = client.create_session(unique_name, params, optimizer=CLIPPED)
    reference = InProcess(CLIPPED["name"], CLIPPED["args"], params)
    for step in range(6):  # a checkpoint at 4, steps 5-6 only in the log
        got, expected = session.push_pull(make_grads(params, step)), reference.step(make_grads(params, step))
    _wait_durable(session, 4)
    from optserve.server.storage.manifests import latest_manifest

    assert latest_manifest(_shard_folder(checkpoint_dir, unique_name, 1))["progress"]["state_chunks"] == 64
    _kill_shard(durable_server, 1)
    for step in range(6, 9):
        got, expected = session.push_pull(make_grads(params, step)), reference.step(make_grads(params, step))
    assert max_abs_diff(got, expected) <= 1e-6
    assert [s.durability.recoveries for s in session.status().shards] == [0, 1]
    session.close()
    client.close()
