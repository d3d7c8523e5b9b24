"""`optserve serve` as a user runs it: a subprocess that prints its address and stops on SIGTERM,
sent to it alone or to its whole process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from bench.process_session import session_pids
from bench.serve_output import ServeOutput, serve_env, start_serve
from optserve.client import Client


@pytest.mark.slow
def test_serve_prints_its_address_serves_and_a_sigterm_to_its_whole_process_group_stops_it_cleanly():
    # What a shell's kill of the job or systemd's default stop sends: every process of the group,
    # the embedded Ray's included, gets SIGTERM. Its GCS used to die with the group, and the
    # server's stop then waited 60 s for it before Ray ended the process with status 1.
    process = start_serve([sys.executable, "-m", "optserve.server.cli", "serve", "--port", "0", "--shards", "1",
                           "--drain-s", "0"], serve_env())
    output = ServeOutput(process)
    try:
        assert output.wait_listening(180) is None, output.tail()
        with Client(output.address, timeout=60) as client:
            session = client.create_session("cli", {"w": np.ones(3, np.float32)},
                                            optimizer={"name": "sgd", "args": {"learning_rate": 0.5}})
            np.testing.assert_allclose(session.push_pull({"w": np.ones(3, np.float32)})["w"], 0.5)
        assert len(session_pids(process.pid)) > 3  # the server, Ray's GCS and raylet, the shard actor
        os.killpg(process.pid, signal.SIGTERM)
        assert output.wait_exit(30) == 0, output.tail()
        assert "optserve shutting down" in output.tail() and "GCS" not in output.tail(), output.tail()
        deadline = time.monotonic() + 10  # reaped by the server before it exits; orphans would linger
        while session_pids(process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert session_pids(process.pid) == [], _command_lines(session_pids(process.pid))
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _command_lines(pids: list[int]) -> dict[int, str]:
    lines = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                lines[pid] = fh.read().replace(b"\0", b" ").decode(errors="replace")[:120]
        except OSError:
            continue
    return lines


@pytest.mark.parametrize("flags, named", [(["--shards", "0"], "--shards"), (["--min-shard-bytes", "-1"], "--min-shard-bytes")])
def test_serve_refuses_a_bad_flag_value_in_one_line_naming_the_flag(flags, named):
    result = subprocess.run([sys.executable, "-m", "optserve.server.cli", "serve", "--port", "0", *flags],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("optserve serve: ") and named in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_on_a_port_in_use_is_one_line_exit_2_and_leaves_nothing_running():
    import socket

    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    try:
        proc = subprocess.run([sys.executable, "-c", "import sys; from optserve.server.cli import main; sys.exit(main())",
                               "serve", "--port", str(port), "--shards", "1"], capture_output=True, text=True,
                              timeout=180, env=env)
    finally:
        holder.close()
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("optserve serve")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and "could not start" in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
