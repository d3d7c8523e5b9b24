"""Logs: one ``key=value`` line per session event, refusal and server error, at ``--log-level``;
never a tensor's values, never a token."""

from __future__ import annotations

import io
import logging
import os
import shlex
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from bench.serve_output import ServeOutput
from optserve.client import Client
from optserve.client.errors import AlreadyExistsError, InvalidArgumentError

OPTIMIZER = {"name": "sgd", "args": {"learning_rate": 0.5}}
MARKER = 1234.5678  # a parameter value that must never reach a log line


def _params():
    return {"w": np.full((3, 2), MARKER, np.float32), "b": np.zeros(2, np.float32)}


@pytest.fixture
def captured():
    """The ``optserve`` logger configured as ``--log-level`` does, into a buffer (restored after)."""
    from optserve.server.ops import logs

    logger = logging.getLogger("optserve")
    level, handlers = logger.level, list(logger.handlers)
    buffer = io.StringIO()

    def configure(name: str) -> io.StringIO:
        buffer.seek(0)
        buffer.truncate()
        logs.configure_logging(name, stream=buffer)
        return buffer

    yield configure
    for handler in list(logger.handlers):
        if handler not in handlers:
            logger.removeHandler(handler)
    logger.setLevel(level)
    logger.propagate = True


def _events(text: str) -> list[dict]:
    """Each log line's ``key=value`` fields."""
    out = []
    for line in text.splitlines():
        fields = dict(part.split("=", 1) for part in shlex.split(line[line.find("ts="):]) if "=" in part)
        if "event" in fields:
            out.append(fields)
    return out


def test_session_events_and_refusals_are_one_key_value_line_each_at_info(server, unique_name, captured):
    buffer = captured("info")
    client = Client(server.address)
    session = client.create_session(unique_name, _params(), optimizer=OPTIMIZER)
    with pytest.raises(AlreadyExistsError):
        client.create_session(unique_name, _params(), optimizer=OPTIMIZER)
    with pytest.raises(InvalidArgumentError):
        client.create_session(f"{unique_name}-bad", _params(), optimizer={"name": "sgd", "args": {"lr_typo": 1}})
    session.push_pull({"w": np.ones((3, 2), np.float32), "b": np.ones(2, np.float32)})
    session.close()
    client.close()
    text = buffer.getvalue()
    events = _events(text)
    kinds = [e["event"] for e in events]
    assert kinds == ["session_created", "rpc_refused", "rpc_refused", "session_closed"], text
    created, exists, invalid, _ = events
    assert created["session"] == unique_name and created["optimizer"] == "sgd" and created["tensors"] == "2"
    assert created["level"] == "INFO" and created["logger"] == "optserve.server.domain.sessions.coordinator"
    assert exists["code"] == "ALREADY_EXISTS" and exists["rpc"] == "Control/CreateSession"
    assert invalid["code"] == "INVALID_ARGUMENT" and "lr_typo" in invalid["message"]
    assert str(MARKER) not in text and "1234.56" not in text


def test_log_level_warning_leaves_out_session_events(server, unique_name, captured):
    buffer = captured("warning")
    client = Client(server.address)
    client.create_session(unique_name, _params(), optimizer=OPTIMIZER).close()
    client.close()
    assert "event=session_created" not in buffer.getvalue() and "event=session_closed" not in buffer.getvalue()


def test_serve_logs_session_events_and_refused_pushes_on_stderr_without_tokens_or_values(tmp_path, unique_name):
    token = "s3cr3t-token-never-logged"
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(f"{token} team-a\n")
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    stderr = open(tmp_path / "stderr.txt", "w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "optserve.server.cli", "serve", "--port", "0", "--shards", "1",
         "--auth-tokens", str(tokens), "--log-level", "info"],
        stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, start_new_session=True)
    output = ServeOutput(process)
    try:
        assert output.wait_listening(180) is None, open(tmp_path / "stderr.txt").read()[-3000:]
        address = output.address
        with Client(address, token=token, timeout=60) as client:
            session = client.create_session(unique_name, _params(), optimizer=OPTIMIZER)
            with pytest.raises(InvalidArgumentError):
                session.push_pull({"w": np.full((3, 2), np.nan, np.float32), "b": np.ones(2, np.float32)})
            session.push_pull({"w": np.ones((3, 2), np.float32), "b": np.ones(2, np.float32)})
            session.close()
        with Client(address, token="wrong-token", timeout=10) as intruder:
            with pytest.raises(Exception):
                intruder.list_sessions()
        deadline = time.monotonic() + 20  # the shard's lines reach the server's stderr through Ray
        while "event=push_refused" not in open(tmp_path / "stderr.txt").read() and time.monotonic() < deadline:
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        process.stdout.close()
    text = open(tmp_path / "stderr.txt").read()
    events = {e["event"]: e for e in _events(text)}
    assert {"server_started", "session_created", "push_refused", "session_closed"} <= set(events), text[-3000:]
    assert events["push_refused"]["reason"] == "NONFINITE" and events["push_refused"]["session"] == unique_name
    assert token not in text and "wrong-token" not in text
    assert str(MARKER) not in text and "1234.56" not in text
    assert "Traceback" not in text


def test_a_shard_process_prints_each_record_once_whatever_root_handler_a_library_installed():
    """A shard actor's process has a root handler of its own (Ray's worker, or a library's
    basicConfig): the records configured exclusive reach only the optserve handler."""
    from optserve.server.ops import logs

    logger, root = logging.getLogger("optserve"), logging.getLogger()
    level, handlers, propagate = logger.level, list(logger.handlers), logger.propagate
    ours, theirs = io.StringIO(), io.StringIO()
    foreign = logging.StreamHandler(theirs)
    root.addHandler(foreign)
    try:
        logs.configure_logging("info", stream=ours, exclusive=True)
        logging.getLogger("optserve.server.storage.shard_store").info("event=checkpoint_written session=s")
        assert ours.getvalue().count("event=checkpoint_written") == 1
        assert theirs.getvalue() == ""
    finally:
        root.removeHandler(foreign)
        for handler in list(logger.handlers):
            if handler not in handlers:
                logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def test_grpc_aio_failing_to_send_a_calls_end_to_a_client_gone_is_one_info_line(caplog):
    # a client killed mid Pull stream: grpc.aio logs ExecuteBatchError with a traceback (seen in a soak)
    from grpc._cython import cygrpc

    from optserve.server.wire.loop_server import quiet_client_gone

    quiet_client_gone()
    grpc_log = logging.getLogger("grpc._cython.cygrpc")
    with caplog.at_level(logging.INFO):
        try:
            raise cygrpc.ExecuteBatchError('Failed "execute_batch": (SendStatusFromServerOperation,)')
        except cygrpc.ExecuteBatchError:
            grpc_log.exception("ExecuteBatchError raised in core by servicer method [%s]", "/optserve.v1.ShardData/Pull")
        try:
            raise cygrpc.ExecuteBatchError("Failed grpc_call_start_batch: 8")  # the server misused the call
        except cygrpc.ExecuteBatchError:
            grpc_log.exception("ExecuteBatchError raised in core by servicer method [%s]", "/x")
        try:
            raise ValueError("a defect")
        except ValueError:
            grpc_log.exception("Unexpected [ValueError] raised by servicer method [/x]")
    lines = [(r.levelname, r.getMessage(), r.exc_info is not None) for r in caplog.records]
    assert lines == [
        ("INFO", 'event=call_end_not_sent method=/optserve.v1.ShardData/Pull reason="the call was over (its client '
                 'left or its deadline passed) before its end was sent"', False),
        ("ERROR", "ExecuteBatchError raised in core by servicer method [/x]", True),  # a defect: as it was
        ("ERROR", "Unexpected [ValueError] raised by servicer method [/x]", True)]
