"""Every failure to start ``optserve serve`` is one line on stderr, exit status 2, within seconds,
and nothing else printed: no Ray or gRPC messages, no traceback, no usage block. The ports and the
Ray cluster are checked before Ray starts. Real subprocesses, nothing mocked."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from bench.ray_cluster import free_port

PORT_BOUND_S = 10.0  # a port in use, a bad flag value: found before Ray starts (about a second)
RAY_PROBE_BOUND_S = 15.0  # an unreachable Ray cluster: the probe waits up to 5 s for an answer


def _serve(*argv: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    """``optserve serve ARGV`` as a user runs it, with the defaults of its environment (no
    RAY_ADDRESS, no GRPC_VERBOSITY); returns the result and its wall time."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "GRPC_VERBOSITY")}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "optserve.server.cli", "serve", "--shards", "1", *argv],
                            capture_output=True, text=True, timeout=timeout, env=env)
    return result, time.monotonic() - started


def _one_line_exit_2(result: subprocess.CompletedProcess, elapsed: float, bound_s: float, *named: str) -> str:
    """The single stderr line of a failed start, after checking everything else about it."""
    shown = f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    assert result.returncode == 2, shown
    assert result.stdout == "", shown
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip() and result.stderr == lines[0] + "\n", shown
    assert lines[0].startswith("optserve serve: "), shown
    assert elapsed < bound_s, f"{elapsed:.1f} s: {shown}"
    for word in named:
        assert word in lines[0], lines[0]
    return lines[0]


@contextlib.contextmanager
def _listening(host: str = "127.0.0.1"):
    """A port something listens on (and never answers) while the block runs."""
    holder = socket.socket()
    holder.bind((host, 0))
    holder.listen()
    try:
        yield holder.getsockname()[1]
    finally:
        holder.close()


def _closed_port() -> int:
    return free_port()  # nothing listens on it, and no port-0 bind elsewhere takes it meanwhile


@pytest.mark.parametrize("flag", ["--port", "--health-port", "--metrics-port"])
def test_a_port_in_use_is_one_line_naming_the_flag_and_address_within_seconds(flag):
    with _listening() as port:
        argv = ["--port", str(port)] if flag == "--port" else ["--port", "0", flag, str(port)]
        result, elapsed = _serve(*argv)
    line = _one_line_exit_2(result, elapsed, PORT_BOUND_S, "could not start", flag, f"127.0.0.1:{port}",
                            "in use")
    assert "Ray" not in line


def test_two_flags_naming_one_port_is_one_line():
    port = _closed_port()
    result, elapsed = _serve("--port", str(port), "--health-port", str(port))
    _one_line_exit_2(result, elapsed, PORT_BOUND_S, "--health-port", f"127.0.0.1:{port}", "in use")


def test_an_unresolvable_ray_address_is_one_line_within_seconds():
    result, elapsed = _serve("--port", "0", "--ray-address", "bogus-address:1")
    _one_line_exit_2(result, elapsed, RAY_PROBE_BOUND_S, "could not start", "--ray-address bogus-address:1",
                     "unreachable", "cannot resolve")


def test_a_ray_address_where_nothing_listens_is_one_line_within_seconds():
    port = _closed_port()
    result, elapsed = _serve("--port", "0", "--ray-address", f"127.0.0.1:{port}")
    _one_line_exit_2(result, elapsed, RAY_PROBE_BOUND_S, f"--ray-address 127.0.0.1:{port}", "unreachable",
                     "connection refused")


def test_a_ray_address_where_something_else_listens_is_one_line_within_seconds():
    """A port that accepts connections but never answers (a wrong port of the right host): the
    probe's bounded wait, not ray.init's minutes of retries."""
    with _listening() as port:
        result, elapsed = _serve("--port", "0", "--ray-address", f"127.0.0.1:{port}")
    _one_line_exit_2(result, elapsed, RAY_PROBE_BOUND_S, f"--ray-address 127.0.0.1:{port}", "not a Ray GCS")


def test_a_ray_address_that_speaks_http_not_grpc_is_one_line():
    """E.g. the dashboard's port given for the GCS's."""
    import http.server

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    server.RequestHandlerClass.log_message = lambda *args: None
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        result, elapsed = _serve("--port", "0", "--ray-address", f"127.0.0.1:{port}")
    finally:
        server.shutdown()
        server.server_close()
    _one_line_exit_2(result, elapsed, RAY_PROBE_BOUND_S, f"--ray-address 127.0.0.1:{port}", "not a Ray GCS")


@pytest.mark.parametrize("argv, named", [
    (["--port", "abc"], "--port"),
    (["--port", "0", "--log-level", "loud"], "--log-level"),
    (["--port", "0", "--drain-s", "soon"], "--drain-s"),
    (["--port", "0", "--shards", "0"], "--shards"),
    (["--port", "70000"], "--port"),
    (["--port", "0", "--ray-address", "bogus-address"], "--ray-address"),
    (["--port", "0", "--replicas", "3"], "--replicas"),
    (["--port", "0", "--on-one-replica", "refuse"], "--on-one-replica refuse is what a session does"),
])
def test_a_bad_flag_value_is_one_line_naming_the_flag(argv, named):
    result, elapsed = _serve(*argv)
    line = _one_line_exit_2(result, elapsed, PORT_BOUND_S, named)
    assert "usage:" not in line


def test_replicas_2_on_a_one_node_ray_is_one_line_naming_the_flag():
    result, elapsed = _serve("--port", "0", "--replicas", "2")
    _one_line_exit_2(result, elapsed, 120.0, "--replicas 2 puts each shard's standby on another Ray node",
                     "the cluster has 1 node")


def test_verbose_still_fails_with_status_2_and_the_line():
    with _listening() as port:
        result, elapsed = _serve("--port", str(port), "--verbose")
    assert result.returncode == 2 and elapsed < PORT_BOUND_S, result.stderr[-3000:]
    assert f"optserve serve: could not start: --port: cannot listen on 127.0.0.1:{port}" in result.stderr


# In process: the checks themselves (what ray.init would join, what it would not).


def test_local_probes_ray_address_from_the_environment_which_ray_init_would_join(monkeypatch):
    from optserve.server.preflight import StartError, probe_ray_address

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    probe_ray_address("local")  # an embedded Ray: nothing to probe
    port = _closed_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    with pytest.raises(StartError, match=f"RAY_ADDRESS 127.0.0.1:{port}: .*connection refused"):
        probe_ray_address("local")


def test_a_ray_client_address_is_only_connected_to(monkeypatch):
    from optserve.server.preflight import StartError, probe_ray_address

    with _listening() as port:  # Ray Client's server is not a GCS: a TCP connect is the check
        probe_ray_address(f"ray://127.0.0.1:{port}")
    with pytest.raises(StartError, match="connection refused"):
        probe_ray_address(f"ray://127.0.0.1:{_closed_port()}")
    probe_ray_address("ray://head-without-port")  # Ray's default port: left to Ray


def test_check_ports_accepts_free_ports_and_a_port_left_in_time_wait():
    from optserve.server.domain.config import ServerConfig
    from optserve.server.preflight import check_ports

    with socket.socket() as listener:  # a connection the server side closed first: TIME_WAIT on its port
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's listeners do
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = listener.accept()
            accepted.close()
            client.recv(1)  # the server's FIN
    with socket.socket() as plain, pytest.raises(OSError):  # what a check without SO_REUSEADDR would say
        plain.bind(("127.0.0.1", port))
    check_ports(ServerConfig(port=port, health_port=0, metrics_port=_closed_port()))
