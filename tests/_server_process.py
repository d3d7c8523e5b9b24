"""``optserve serve`` as a real process of its own (its own process group), for the tests that
kill a whole server or start one on files they prepared."""

from __future__ import annotations

import glob
import signal
import subprocess
from typing import Optional

from bench.ray_cluster import free_port  # noqa: F401 - the tests' port
from bench.process_session import ask_for_stacks, kill_session, session_pids, titled
from bench.serve_output import ServeOutput, serve_argv, serve_env, start_serve


class ServerProcess:
    """Starts ``optserve serve --shards 2 --min-shard-bytes 0`` plus ``extra`` arguments on ``port``
    (0: one the server picks); ``wait_listening()`` returns once it serves, with ``address`` set
    (or fails with its output)."""

    def __init__(self, *extra: str, port: int = 0, command: Optional[list[str]] = None,
                 env: Optional[dict] = None):
        """``command``: the whole command line to run instead (its ``--port`` is ``port``);
        ``env``: variables to set for it."""
        self._asked_port = port  # 0: the server picks a free one (a port probed here could be taken by Ray meanwhile)
        self.process = start_serve(command or serve_argv(port, *extra), serve_env(**(env or {})))
        self._output = ServeOutput(self.process)
        self.lines = self._output.lines

    def wait_listening(self, timeout_s: float = 180.0) -> "ServerProcess":
        """Returns once the server printed its address; fails with its output (and, if it is
        still starting, the Python stacks of its threads) after ``timeout_s`` or once it exits."""
        why = self._output.wait_listening(timeout_s)
        if why == "exited":
            self.kill_group()  # what it started (its Ray) may still run
            raise AssertionError("server did not start:\n" + self._output.tail())
        if why == "timeout":
            stacks = self._stacks()
            self.kill_group()  # the caller never gets this object to clean up
            raise AssertionError(f"server not listening after {timeout_s:.0f} s; its output and stacks:\n" + stacks)
        return self

    @property
    def address(self) -> str:
        """``HOST:PORT`` it listens on (before it says so: the port asked for)."""
        return self._output.address or f"127.0.0.1:{self._asked_port}"

    @property
    def port(self) -> int:
        return self._output.port or self._asked_port

    def _stacks(self) -> str:
        """The server's output after asking it and its shard actors for their threads' stacks
        (both dump them on SIGUSR1; an actor's go to its Ray log file, whose tail is added)."""
        seen = len(self.lines)
        shards = titled(session_pids(self.process.pid), b"ray::ShardActor")
        ask_for_stacks([self.process.pid, *shards])
        text = "".join(self.lines[max(0, seen - 40):])
        for pid in shards:
            for path in glob.glob(f"/tmp/ray/session_latest/logs/*-{pid}.err"):
                with open(path, errors="replace") as fh:
                    text += f"\n--- shard actor {pid} ({path}):\n" + fh.read()[-6000:]
        return text

    def output(self) -> str:
        return "".join(self.lines)

    def kill_group(self) -> None:
        """SIGKILL of the server and everything it started (its Ray, its shard actors: every
        process of its session, :func:`bench.process_session.kill_session`)."""
        kill_session(self.process.pid)
        self.process.wait(timeout=60)

    def stop(self) -> int:
        """SIGTERM, waiting for a clean exit (SIGKILL after two minutes)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.kill_group()
        return self.process.wait()

