"""The newcomer's way out of a session left by a crashed script: the refusal says how to go on, and
`optserve sessions` lists and closes sessions from the command line."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from optserve.client import Client, FailedPreconditionError, SessionOptions

PARAMS = {"w": np.zeros(4, np.float32)}


def _optserve(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", "import sys; from optserve.server.cli import main; sys.exit(main())", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


@pytest.fixture
def client(server):
    with Client(server.address, timeout=60) as c:
        yield c


def test_a_rerun_with_other_options_is_told_how_to_go_on(client, unique_name):
    client.create_session(unique_name, PARAMS, optimizer={"name": "adam", "args": {"learning_rate": 0.01}})
    try:
        with pytest.raises(FailedPreconditionError) as refused:
            client.session(unique_name, expect=SessionOptions("adam", {"learning_rate": 0.03}))
        message = str(refused.value)
        assert "'learning_rate' = 0.01, not 0.03" in message
        assert f"optserve sessions close {unique_name}" in message and "new name" in message
    finally:
        client.close_session(unique_name)


def test_sessions_lists_and_closes_the_callers_sessions(server, client, unique_name):
    client.create_session(unique_name, PARAMS, optimizer={"name": "adam", "args": {"learning_rate": 0.01}})
    listed = _optserve("sessions", "--address", server.address)
    assert listed.returncode == 0, listed.stderr
    (row,) = [line for line in listed.stdout.splitlines() if line.startswith(unique_name + " ")]
    assert row.split()[1:4] == ["sync", "adam", "0"]
    as_json = json.loads(_optserve("sessions", "--address", server.address, "--json").stdout)
    assert unique_name in [s["name"] for s in as_json["sessions"]]

    closed = _optserve("sessions", "close", unique_name, "--address", server.address)
    assert closed.returncode == 0 and closed.stdout.strip() == f"closed {unique_name}", closed.stderr
    assert unique_name not in client.list_sessions()
    client.create_session(unique_name, PARAMS, optimizer={"name": "adam", "args": {"learning_rate": 0.03}})
    client.close_session(unique_name)  # the name is free for a rerun with other options


@pytest.mark.parametrize("argv, says", [
    (["close", "no-such-session"], "NotFoundError"),
    (["close"], "name the sessions to close"),
    (["some-name"], "invalid choice"),
])
def test_a_sessions_command_error_is_one_line_with_exit_status_2(server, argv, says):
    result = _optserve("sessions", *argv, "--address", server.address)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and says in result.stderr, result.stderr
