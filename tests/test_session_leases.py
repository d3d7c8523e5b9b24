"""Idle sessions: a lease per session (``--session-idle-s``); pulls and pushes keep it alive, and
status shows each session's last activity and the workers that push to it."""

from __future__ import annotations

import logging
import time

import pytest

from optserve.client import Client
from optserve.client.errors import NotFoundError

from _service_helpers import make_grads, make_params

OPTIMIZER = {"name": "adam", "args": {"learning_rate": 1e-2}}
LEASE_S = 2.0


@pytest.fixture(scope="module")
def leased_server(ray_local):
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig

    running = start_server(ServerConfig(host="127.0.0.1", port=0, shards=2, min_shard_bytes=0,
                                        session_idle_s=LEASE_S))
    yield running
    running.stop()


def _wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_status_shows_last_activity_of_pulls_and_pushes(server, unique_name):
    client = Client(server.address)
    params = make_params()
    session = client.create_session(unique_name, params, optimizer=OPTIMIZER)
    try:
        time.sleep(0.05)
        before_pull = time.time()
        session.pull()
        after_pull = session.status().last_activity_unix_s
        assert after_pull >= before_pull, "a pull is activity"
        time.sleep(0.05)
        before_push = time.time()
        session.push_pull(make_grads(params, 0))
        assert session.status().last_activity_unix_s >= before_push, "a push is activity"
        time.sleep(0.05)
        last = session.status().last_activity_unix_s
        session.status()
        assert session.status().last_activity_unix_s == last, "reading status is not activity"
    finally:
        session.close()
        client.close()


def test_status_and_the_cli_show_which_workers_push_most_recent_first(server, unique_name):
    from optserve.client.cli import collect, render

    client = Client(server.address)
    params = make_params()
    alice = client.create_session(unique_name, params, optimizer=OPTIMIZER, mode="async", worker_id="alice")
    bob = client.session(unique_name, worker_id="bob")
    try:
        assert alice.status().workers == {}
        before = time.time()
        alice.push(make_grads(params, 0))
        bob.push(make_grads(params, 1))
        workers = alice.status().workers
        assert list(workers) == ["bob", "alice"], workers  # the most recent first
        assert all(t >= before for t in workers.values())
        report = collect(client)
        row = next(line for line in render(report).splitlines() if line.startswith(unique_name))
        assert " 2/2 " in row, row
        later = render(report, now=time.time() + 3600)  # an hour on, neither pushed in the last minute
        assert " 0/2 " in next(line for line in later.splitlines() if line.startswith(unique_name))
    finally:
        alice.close()
        client.close()


def test_idle_session_expires_after_its_lease_and_is_logged(leased_server, unique_name, caplog):
    caplog.set_level(logging.INFO, logger="optserve.server.domain.sessions.coordinator")
    client = Client(leased_server.address)
    params = make_params()
    client.create_session(unique_name, params, optimizer=OPTIMIZER)
    try:
        assert unique_name in client.list_sessions()
        assert _wait_until(lambda: unique_name not in client.list_sessions(), LEASE_S + 3.0)
        with pytest.raises(NotFoundError):
            client.session_status(unique_name)
        lines = [r.getMessage() for r in caplog.records if "event=session_expired" in r.getMessage()]
        assert len(lines) == 1 and f"session={unique_name}" in lines[0] and "session_idle_s=2" in lines[0], lines
        client.create_session(unique_name, params, optimizer=OPTIMIZER).close()  # the name is free again
    finally:
        client.close()


def test_session_kept_alive_by_pulls_alone_outlives_its_lease(leased_server, unique_name):
    client = Client(leased_server.address)
    params = make_params()
    session = client.create_session(unique_name, params, optimizer=OPTIMIZER)
    try:
        session.push_pull(make_grads(params, 0))
        ends = time.monotonic() + 2.5 * LEASE_S
        while time.monotonic() < ends:
            time.sleep(LEASE_S / 4)
            session.pull()  # only the shards see pulls: activity is the latest any shard saw
        assert unique_name in client.list_sessions()
        session.push_pull(make_grads(params, 1))
        assert session.status().steps_applied == 2
    finally:
        session.close()
        client.close()
