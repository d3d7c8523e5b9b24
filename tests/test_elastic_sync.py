"""Elastic sync sessions on the shared 2-shard server: membership, round rules, late gradients,
history. (Worker processes killed and stopped: tests/test_elastic_processes.py.)"""

from __future__ import annotations

import concurrent.futures
import time

import numpy as np
import pytest

from optserve.client import Client
from optserve.client.errors import DeadlineExceededError, InvalidArgumentError, ResourceExhaustedError
from tests._service_helpers import InProcess, make_params

SGD = {"name": "sgd", "args": {"learning_rate": 0.1}}


def worker_grads(params: dict, worker: str, version: int) -> dict[str, np.ndarray]:
    """A gradient that depends only on who computed it and from which version (replayable)."""
    seed = (sum(map(ord, worker)) * 1_000 + version) % (2**32)
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(p.shape).astype(np.float32) for n, p in params.items()}


@pytest.fixture
def client(server):
    with Client(server.address, timeout=20.0) as c:
        yield c


def _create(client, name, params, **elastic):
    owner = client.create_session(name, params, SGD, mode="sync", **elastic)
    return owner


def _push_all(sessions, params):
    """Each session pushes its worker's gradient for the version it has seen, concurrently."""
    with concurrent.futures.ThreadPoolExecutor(len(sessions)) as pool:
        futures = [pool.submit(s.push_pull, worker_grads(params, s.worker_id, s.version)) for s in sessions]
        return [f.result() for f in futures]


def replay(params: dict, records, grads_of=worker_grads) -> dict[str, np.ndarray]:
    """The in-process replay of a history: each version's update is the scaled mean of its
    participants' gradients (each computed from the version before it)."""
    reference = InProcess(SGD["name"], SGD["args"], params)
    result = params
    for record in records:
        grads = [grads_of(params, w, record.version - 1) for w in record.participants]
        mean = {n: sum(np.float32(s) * g[n] for s, g in zip(record.scales, grads)) / np.float32(len(grads))
                for n in params}
        result = reference.step(mean)
    return result


def test_round_commits_once_every_member_pushed(client, unique_name):
    params = make_params(3)
    # straggler_s: no adaptive deadline cuts a round whose second push a loaded machine delays
    owner = _create(client, unique_name, params, num_workers=3, min_workers=2, straggler_s=30.0)
    a, b = (client.session(unique_name, worker_id=w) for w in ("a", "b"))
    try:
        a.join(), b.join()
        for _ in range(3):
            _push_all([a, b], params)
        history = a.history()
        assert [r.version for r in history] == [1, 2, 3]
        assert all(sorted(r.participants) == ["a", "b"] and r.closed_by == "members" for r in history)
        got = a.pull()
        want = replay(params, history)
        assert max(float(np.max(np.abs(got[n] - want[n]))) for n in params) < 1e-6
        assert client.session_series(unique_name).rounds == tuple(history)  # the series carries them too
        status = a.status()
        assert status.elastic is not None and status.elastic.members == ("a", "b")
        assert status.elastic.rounds_short == 3
    finally:
        for s in (a, b):
            s.detach()
        owner.close()


def test_creating_object_is_not_a_member(client, unique_name):
    params = make_params(4)
    owner = _create(client, unique_name, params, num_workers=2, min_workers=1)
    try:
        assert owner.status().elastic.members == ()
        owner.push_pull(worker_grads(params, owner.worker_id, 0))  # its first push makes it one
        assert owner.status().elastic.members == (owner.worker_id,)
        assert owner.last_step.version == 1 and owner.last_step.dropped is None
    finally:
        owner.close()


def test_a_leaving_member_lets_the_open_round_commit(client, unique_name):
    params = make_params(5)
    owner = _create(client, unique_name, params, num_workers=3, min_workers=2)
    a, b, c = (client.session(unique_name, worker_id=w) for w in ("a", "b", "c"))
    try:
        for s in (a, b, c):
            s.join()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            pending = [pool.submit(s.push_pull, worker_grads(params, s.worker_id, 0)) for s in (a, b)]
            time.sleep(1.0)
            assert not any(f.done() for f in pending)  # c is a member: the round waits for it
            started = time.monotonic()
            c.leave()
            for f in pending:
                f.result()
            assert time.monotonic() - started < 2.0
        (record,) = a.history()
        assert sorted(record.participants) == ["a", "b"] and record.closed_by == "left"
        assert a.status().elastic.members == ("a", "b")
    finally:
        for s in (a, b, c):
            s.detach()
        owner.close()


def test_straggler_deadline_commits_without_the_straggler_and_it_is_not_waited_for_again(client, unique_name):
    params = make_params(6)
    owner = _create(client, unique_name, params, num_workers=3, min_workers=2, straggler_s=0.5)
    a, b, c = (client.session(unique_name, worker_id=w) for w in ("a", "b", "c"))
    try:
        for s in (a, b, c):
            s.join()
        started = time.monotonic()
        _push_all([a, b], params)
        assert 0.4 < time.monotonic() - started < 3.0
        assert a.status().elastic.stragglers == ("c",)
        _push_all([a, b], params)  # c is a straggler now: not waited for (the record says "members" below)
        # c pushes late (computed from version 0): dropped, told, and handed the current parameters
        late = c.push_pull(worker_grads(params, "c", 0), base_version=0)
        assert c.last_step.dropped == "late" and c.last_step.version is None and c.last_step.current_version == 2
        assert all(np.array_equal(late[n], v) for n, v in a.pull().items())
        history = a.history()
        assert [r.closed_by for r in history] == ["deadline", "members"]
        assert [sorted(r.participants) for r in history] == [["a", "b"], ["a", "b"]]
        assert a.status().elastic.late_dropped == 1
        # c, on time again (it opens the round), takes part and stops being a straggler
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(c.push_pull, worker_grads(params, "c", 2))
            time.sleep(0.2)
            _push_all([a, b], params)
            first.result()
        assert sorted(a.history(since=2)[0].participants) == ["a", "b", "c"]
        assert a.status().elastic.stragglers == ()
        got = a.pull()
        want = replay(params, a.history())
        assert max(float(np.max(np.abs(got[n] - want[n]))) for n in params) < 1e-6
    finally:
        for s in (a, b, c):
            s.detach()
        owner.close()


def test_late_gradient_folds_into_the_next_round_when_asked(client, unique_name):
    params = make_params(7)
    owner = _create(client, unique_name, params, num_workers=2, min_workers=1, late="next",
                    staleness_policy="scale")
    a, b = (client.session(unique_name, worker_id=w) for w in ("a", "b"))
    try:
        a.push_pull(worker_grads(params, "a", 0))  # only member: commits alone (version 1)
        b.join()
        # b's gradient from version 0 is late: folded into round 2 with scale 1 / (1 + 1)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            fb = pool.submit(b.push_pull, worker_grads(params, "b", 0), base_version=0)
            fa = pool.submit(a.push_pull, worker_grads(params, "a", 1))
            fa.result(), fb.result()
        assert b.last_step.version == 2
        record = a.history(since=1)[0]
        assert dict(zip(record.participants, record.scales)) == {"a": 1.0, "b": 0.5}

        def grads_of(p, worker, version):
            return worker_grads(p, worker, 0 if worker == "b" else version)

        got = a.pull()
        want = replay(params, a.history(), grads_of)
        assert max(float(np.max(np.abs(got[n] - want[n]))) for n in params) < 1e-6
    finally:
        for s in (a, b):
            s.detach()
        owner.close()


def test_too_few_members_ends_in_deadline_exceeded_naming_who_is_missing(server, unique_name):
    params = make_params(8)
    with Client(server.address, timeout=20.0) as setup:
        _create(setup, unique_name, params, num_workers=3, min_workers=2)
    with Client(server.address, timeout=3.0) as short:
        a = short.session(unique_name, worker_id="a")
        b = short.session(unique_name, worker_id="b")
        try:
            b.join()
            with pytest.raises(DeadlineExceededError) as raised:
                a.push_pull(worker_grads(params, "a", 0))
            assert "min_workers=2" in str(raised.value) and "not pushed: b" in str(raised.value)
        finally:
            a.detach(), b.detach()
    with Client(server.address, timeout=20.0) as setup:
        setup.session(unique_name).close()


def test_more_than_max_workers_is_refused_naming_the_limit(client, unique_name):
    params = make_params(9)
    owner = _create(client, unique_name, params, num_workers=2, max_workers=2, min_workers=1)
    workers = [client.session(unique_name, worker_id=w) for w in ("a", "b", "c")]
    try:
        workers[0].join(), workers[1].join()
        with pytest.raises(ResourceExhaustedError, match="max_workers=2"):
            workers[2].join()
        workers[1].leave()
        workers[2].join()  # a place is free again
    finally:
        for s in workers:
            s.detach()
        owner.close()


def test_elastic_options_are_checked_at_the_edge(client, unique_name):
    params = make_params(10)
    with pytest.raises(InvalidArgumentError, match="min_workers <= num_workers <= max_workers"):
        client.create_session(unique_name, params, SGD, num_workers=2, min_workers=3)
    with pytest.raises(InvalidArgumentError, match="late must be"):
        client.create_session(unique_name, params, SGD, num_workers=2, min_workers=1, late="later")
    with pytest.raises(InvalidArgumentError, match="worker_id"):
        client.session("any", worker_id="a/b")


def test_cli_status_shows_an_elastic_sessions_members(server, client, unique_name):
    from optserve.client.cli import collect, render

    params = make_params(11)
    owner = _create(client, unique_name, params, num_workers=3, min_workers=2)
    a = client.session(unique_name, worker_id="a")
    try:
        a.join()
        report = collect(client)
        (mine,) = [s for s in report["sessions"] if s["name"] == unique_name]
        assert mine["elastic"]["members"] == ("a",) or mine["elastic"]["members"] == ["a"]
        assert "sync elastic (1 members)" in render(report)
    finally:
        a.detach()
        owner.close()


def test_torch_remote_optimizer_takes_elastic_options_and_a_worker_id(server, unique_name):
    torch = pytest.importorskip("torch")
    from optserve.client.torch import RemoteOptimizer

    model = torch.nn.Linear(3, 2)
    optimizer = RemoteOptimizer(model.named_parameters(), server.address, SGD, session=unique_name, num_workers=2,
                                min_workers=1, lease_s=2.0, worker_id="torch-0")
    try:
        assert optimizer.session.worker_id == "torch-0" and optimizer.session.options.elastic
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        assert optimizer.session.status().elastic.members == ("torch-0",)
        assert optimizer.session.history()[0].participants == ("torch-0",)
    finally:
        optimizer.session.close()
