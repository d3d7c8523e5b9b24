"""A client that saw a version a restore rolled back goes on: a durable server SIGKILLed, one shard's
step log cut by a few bytes (its last record torn), the server started again on the same port and
directory. The session comes back at the version every shard reached, one below what the client
object saw (here a version acknowledged, then lost to the damaged file; in a crash, one applied and
pulled but not yet logged everywhere). The same session object's next step is not refused forever
for a base version from the future: it is tried again, as the same push, from the session's version
and trains on exactly; a pull lowers its view; a push with an explicit future base is refused naming
the session's version."""

from __future__ import annotations

import glob
import os
import urllib.parse

import pytest

from optserve.client import Client, FutureBaseError
from tests._server_process import ServerProcess, free_port
from tests._service_helpers import InProcess, make_grads, make_params, max_abs_diff

OPTIMIZER = {"name": "adam", "args": {"learning_rate": 0.01}}
STEPS = 4


def _server(port: int, checkpoint_dir: str) -> ServerProcess:
    return ServerProcess("--checkpoint-dir", checkpoint_dir, "--checkpoint-every-steps", "100",
                         port=port).wait_listening()


def _tear_last_record(root: str, session: str, shard: int) -> None:
    folder = os.path.join(root, "sessions", urllib.parse.quote(session, safe=""), f"shard-{shard}")
    (segment,) = glob.glob(os.path.join(folder, "steps-*.log"))
    os.truncate(segment, os.path.getsize(segment) - 7)


@pytest.fixture(scope="module")
def rolled_back(tmp_path_factory):
    """Sessions stepped STEPS times by objects that stay alive across a kill, a torn log and a
    restart; yields (client, {name: session}, params)."""
    root = str(tmp_path_factory.mktemp("rollback") / "ckpt")
    port = free_port()
    params = make_params(5)
    first = _server(port, root)
    client = Client(f"127.0.0.1:{port}", timeout=60.0)
    second = None
    try:
        sessions = {}
        for name in ("implicit", "explicit", "pulled"):
            sessions[name] = client.create_session(name, params, optimizer=OPTIMIZER)
            for step in range(STEPS):
                sessions[name].push_pull(make_grads(params, step))
            assert sessions[name].version == STEPS
        first.kill_group()
        for name in sessions:
            _tear_last_record(root, name, 1)
        second = _server(port, root)
        yield client, sessions, params
    finally:
        client.close()
        first.kill_group()
        if second is not None:
            second.stop()


def test_a_step_stamped_with_a_rolled_back_version_is_pushed_again_from_the_session_version(rolled_back):
    _, sessions, params = rolled_back
    session = sessions["implicit"]
    assert session.status().version == STEPS - 1  # the torn record rolled every shard back to it
    reference = InProcess(OPTIMIZER["name"], OPTIMIZER["args"], params)
    for step in range(STEPS - 1):
        reference.step(make_grads(params, step))
    for step in range(STEPS - 1, STEPS + 1):
        got, expected = session.push_pull(make_grads(params, step)), reference.step(make_grads(params, step))
        assert max_abs_diff(got, expected) <= 1e-6
    assert session.version == STEPS + 1
    # the refused push was tried again as the same push: its sequence number, then the next one's
    assert [r.sequences for r in session.history(since=STEPS - 1)] == [(STEPS + 1,), (STEPS + 2,)]


def test_a_push_with_an_explicit_future_base_is_refused_naming_the_session_version(rolled_back):
    _, sessions, params = rolled_back
    session = sessions["explicit"]
    with pytest.raises(FutureBaseError, match=f"base_version {STEPS} > current version {STEPS - 1}") as refused:
        session.push(make_grads(params, 0), base_version=STEPS)
    assert refused.value.current_version == STEPS - 1 and refused.value.code == "INVALID_ARGUMENT"
    assert session.version == STEPS - 1  # the view corrected from the refusal
    assert session.status().version == STEPS - 1  # nothing applied


def test_a_pull_lowers_the_version_a_session_object_has_seen_to_the_server_one(rolled_back):
    _, sessions, _ = rolled_back
    session = sessions["pulled"]
    session.pull()
    assert session.version == STEPS - 1
