"""End to end through a real server (loopback gRPC, 2 shard actors on a local Ray)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from _service_helpers import InProcess, make_grads, make_params, max_abs_diff
from optserve.client import Client, StaleError

SGD = {"name": "sgd", "args": {"learning_rate": 0.1}}
ADAM = {"name": "adam", "args": {"learning_rate": 0.01}}


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address, timeout=60) as c:
        yield c


def test_created_session_serves_its_initial_values_from_both_shards(client, unique_name):
    params = make_params()
    session = client.create_session(unique_name, params, optimizer=SGD)
    try:
        assert {s.index for s in session.status().shards} == {0, 1}
        pulled = session.pull()
        assert session.version == 0
        for name in params:
            np.testing.assert_array_equal(pulled[name], params[name])
        assert unique_name in client.list_sessions()
    finally:
        session.close()
    assert unique_name not in client.list_sessions()


def test_push_then_pull_equals_push_pull_and_the_in_process_step(client, unique_name):
    params = make_params()
    a = client.create_session(unique_name + "a", params, optimizer=ADAM)
    b = client.create_session(unique_name + "b", params, optimizer=ADAM)
    reference = InProcess("adam", ADAM["args"], params)
    try:
        for step in range(3):
            grads = make_grads(params, step)
            assert a.push(grads) == step + 1
            via_pull = a.pull()
            via_push_pull = b.push_pull(grads)
            expected = reference.step(grads)
            assert max_abs_diff(via_pull, via_push_pull) == 0.0
            assert max_abs_diff(via_pull, expected) <= 1e-6
        status = a.status()
        assert (status.version, status.steps_applied, status.pushes_accepted) == (3, 3, 3)
    finally:
        a.close()
        b.close()


def test_sync_step_applies_the_mean_of_num_workers_pushes(client, server, unique_name):
    params = make_params()
    owner = client.create_session(unique_name, params, optimizer=SGD, num_workers=2)
    workers = [Client(server.address, timeout=60).session(unique_name) for _ in range(2)]
    grads = [make_grads(params, 0, seed=s) for s in (1, 2)]
    results = [None, None]

    def work(i):
        results[i] = workers[i].push_pull(grads[i])

    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        [t.start() for t in threads]
        [t.join(60) for t in threads]
        expected = {k: params[k] - np.float32(0.1) * ((grads[0][k] + grads[1][k]) / np.float32(2)) for k in params}
        assert max_abs_diff(results[0], expected) <= 1e-6
        assert max_abs_diff(results[1], results[0]) == 0.0
        assert owner.status().version == 1
    finally:
        owner.close()


def test_push_pull_async_returns_a_future_of_the_step_parameters(client, unique_name):
    params = make_params()
    session = client.create_session(unique_name, params, optimizer=SGD)
    try:
        first = session.push_pull_async(make_grads(params, 0))
        second = session.push_pull_async(make_grads(params, 1))
        second.result(60)
        assert session.version == 2
        expected = {k: params[k] - 0.1 * make_grads(params, 0)[k] - 0.1 * make_grads(params, 1)[k] for k in params}
        assert max_abs_diff(second.result(), expected) <= 1e-6
        assert max_abs_diff(first.result(), second.result()) > 0
    finally:
        session.close()


def test_bf16_wire_dtype_rounds_gradients_and_pulls_to_bf16(client, unique_name):
    params = make_params()
    session = client.create_session(unique_name, params, optimizer=SGD, wire_dtype="bf16")
    try:
        import ml_dtypes

        grads = make_grads(params, 0)
        bf = lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32)  # noqa: E731
        session.push(grads)  # session default: bf16 gradients on the wire
        exact = session.pull(wire_dtype="float32")  # per-call override
        expected = {k: params[k] - np.float32(0.1) * bf(grads[k]) for k in params}
        assert max_abs_diff(exact, expected) <= 1e-6
        compressed = session.pull()  # session default: bf16 on the wire
        assert max_abs_diff(compressed, {k: bf(v) for k, v in exact.items()}) == 0.0
    finally:
        session.close()


def test_async_clients_train_least_squares_and_reject_pushes_staler_than_max(client, server, unique_name):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 5)).astype(np.float32)
    true_w = rng.standard_normal((5, 1)).astype(np.float32)
    y = x @ true_w
    params = {"w": np.zeros((5, 1), np.float32), "b": np.zeros((1,), np.float32)}
    max_staleness = 1
    session = client.create_session(unique_name, params, optimizer={"name": "sgd", "args": {"learning_rate": 0.05}},
                                    mode="async", max_staleness=max_staleness)
    stale_refusals, accepted_staleness = [], []
    lock = threading.Lock()

    def loss(p):
        return float(np.mean((x @ p["w"] + p["b"] - y) ** 2))

    def worker(seed):
        worker_session = Client(server.address, timeout=60).session(unique_name)
        local = worker_session.pull()
        batch_rng = np.random.default_rng(seed)
        for _ in range(40):
            idx = batch_rng.integers(0, 64, 16)
            err = x[idx] @ local["w"] + local["b"] - y[idx]
            grads = {"w": (2 * x[idx].T @ err / 16).astype(np.float32), "b": (2 * err.mean(0)).astype(np.float32)}
            base = worker_session.version
            try:
                local = worker_session.push_pull(grads)
                with lock:
                    accepted_staleness.append(worker_session.last_staleness)
            except StaleError as exc:
                with lock:
                    stale_refusals.append((base, exc.current_version))
                local = worker_session.pull()

    try:
        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        [t.start() for t in threads]
        [t.join(120) for t in threads]
        final = session.pull()
        assert loss(final) < 0.05 * loss(params)
        status = session.status()
        assert status.rejected["stale"] == len(stale_refusals)
        assert status.pushes_accepted + len(stale_refusals) == 160
        assert stale_refusals, "4 concurrent clients with max_staleness=1 never produced a stale push"
        assert all(current - base > max_staleness for base, current in stale_refusals)
        assert max(accepted_staleness) <= max_staleness
    finally:
        session.close()


def test_64mb_tensor_round_trips_bit_exact(client, unique_name):
    rng = np.random.default_rng(3)
    big = rng.standard_normal(16 << 20).astype(np.float32).reshape(4096, 4096)
    big[0, :4] = [np.float32(1e-45), -0.0, np.float32(3.4e38), np.float32(-1.17549435e-38)]
    session = client.create_session(unique_name, {"big": big}, optimizer=SGD)
    try:
        np.testing.assert_array_equal(session.pull()["big"].view(np.uint32), big.view(np.uint32))
    finally:
        session.close()


def test_restarted_client_attaches_by_name_and_resumes(client, server, unique_name):
    params = make_params()
    reference = InProcess("adam", ADAM["args"], params)
    first = Client(server.address, timeout=60)
    session = first.create_session(unique_name, params, optimizer=ADAM)
    for step in range(3):
        expected = reference.step(make_grads(params, step))
        session.push_pull(make_grads(params, step))
    session.detach()
    first.close()  # the "crash": channels gone, session object gone

    resumed = Client(server.address, timeout=60).session(unique_name)
    try:
        assert resumed.version == 3
        assert max_abs_diff(resumed.pull(), expected) <= 1e-6
        for step in range(3, 5):
            expected = reference.step(make_grads(params, step))
            got = resumed.push_pull(make_grads(params, step))
        assert max_abs_diff(got, expected) <= 1e-6 and resumed.version == 5
    finally:
        resumed.close()


def test_retried_push_with_the_same_sequence_applies_once(client, unique_name):
    params = make_params()
    session = client.create_session(unique_name, params, optimizer=SGD)
    try:
        grads = make_grads(params, 0)
        header = session._header()  # what a retry after UNAVAILABLE resends: same client_id + sequence
        assert session._push_once(header, grads, None) == 1
        assert session._push_once(header, grads, None) == 1
        expected = {k: params[k] - np.float32(0.1) * grads[k] for k in params}
        assert max_abs_diff(session.pull(), expected) <= 1e-6
        status = session.status()
        assert (status.version, status.pushes_accepted) == (1, 1)
    finally:
        session.close()


def test_async_scale_policy_scales_a_stale_step_by_one_over_one_plus_staleness(client, server, unique_name):
    params = make_params()
    session = client.create_session(unique_name, params, optimizer=SGD, mode="async", staleness_policy="scale")
    late = Client(server.address, timeout=60).session(unique_name)  # base version 0
    try:
        first, second = make_grads(params, 0), make_grads(params, 1)
        session.push(first)
        late.push(second)  # computed from version 0, arrives at version 1: staleness 1
        assert late.last_staleness == 1
        expected = {k: params[k] - np.float32(0.1) * first[k] - np.float32(0.1 * 0.5) * second[k] for k in params}
        assert max_abs_diff(session.pull(), expected) <= 1e-6
    finally:
        session.close()


def test_a_client_attaching_before_the_creator_sent_initial_values_waits_for_them(server, unique_name, monkeypatch):
    # Another process may attach between CreateSession and the creator's InitTensors; its pull
    # waits for the values instead of failing. Here the creator is held before sending them.
    from optserve.client._session import Session

    release = threading.Event()
    send_initial_values = Session._initialize

    def held_initialize(self, arrays, *rest):
        assert release.wait(60)
        send_initial_values(self, arrays, *rest)

    monkeypatch.setattr(Session, "_initialize", held_initialize)
    params = make_params()
    creator, attacher = Client(server.address), Client(server.address)
    created = []
    creating = threading.Thread(target=lambda: created.append(
        creator.create_session(unique_name, params, optimizer={"name": "sgd", "args": {"learning_rate": 0.1}})))
    creating.start()
    try:
        while unique_name not in attacher.list_sessions():
            time.sleep(0.01)
        pulled = []
        pulling = threading.Thread(target=lambda: pulled.append(attacher.session(unique_name).pull()))
        pulling.start()
        pulling.join(0.5)
        assert pulling.is_alive() and not pulled  # waiting for the initial values
        release.set()
        pulling.join(30)
        creating.join(30)
        assert len(pulled) == 1 and len(created) == 1
        for name, value in params.items():
            np.testing.assert_array_equal(pulled[0][name], value, err_msg=name)
    finally:
        release.set()
        creating.join(30)
        if unique_name in attacher.list_sessions():
            attacher.close_session(unique_name)
        creator.close()
        attacher.close()


def test_a_retried_push_pull_applied_before_is_answered_with_the_version_it_went_into(client, unique_name):
    """Its first answer lost (a fault), a push_pull is resent after other pushes moved the session
    on: it applies nothing again, returns the parameters of now, and says the version its
    gradient went into (``last_step.version``), not the current one."""
    params = make_params(2)
    session = client.create_session(unique_name, params, optimizer=SGD)
    try:
        header, grads = session._header(), make_grads(params, 0)
        session._push_pull_once(header, grads, None)
        assert session.last_applied_version == 1
        other = client.session(unique_name)  # another session object (its own client id) steps: version 2
        other.push_pull(make_grads(params, 1))
        other.detach()
        again = session._push_pull_once(header, grads, None)  # the retry of the first push
        assert session.last_applied_version == 1 and session.version == 2
        assert max_abs_diff(again, session.pull()) == 0.0 and session.status().pushes_accepted == 2
    finally:
        session.close()
