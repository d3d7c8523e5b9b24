"""``optserve serve`` as a real process of its own (its own process group), for the tests that
kill a whole server or start one on files they prepared."""

from __future__ import annotations

import glob
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

from bench.process_session import ask_for_stacks, kill_session, session_pids, titled


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """Starts ``optserve serve --shards 2 --min-shard-bytes 0`` plus ``extra`` arguments on ``port``
    (0: one the server picks); ``wait_listening()`` returns once it serves, with ``address`` set
    (or fails with its output)."""

    def __init__(self, *extra: str, port: int = 0, command: Optional[list[str]] = None):
        """``command``: the whole command line to run instead (its ``--port`` is ``port``)."""
        self.port = port  # 0: the server picks a free one (a port probed here could be taken by Ray meanwhile)
        self.address = f"127.0.0.1:{port}"
        env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
        env.pop("RAY_ADDRESS", None)
        self.process = subprocess.Popen(
            command or [sys.executable, "-m", "optserve.server.cli", "serve", "--port", str(self.port), "--shards",
                        "2", "--min-shard-bytes", "0", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        self.lines: list[str] = []
        self._listening = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def wait_listening(self, timeout_s: float = 180.0) -> "ServerProcess":
        """Returns once the server printed its address; fails with its output (and, if it is
        still starting, the Python stacks of its threads) after ``timeout_s`` or once it exits."""
        deadline = time.monotonic() + timeout_s
        while not self._listening.wait(0.2):
            if self.process.poll() is not None:
                self._listening.wait(1.0)  # its last lines
                if self._listening.is_set():
                    break
                raise AssertionError("server did not start:\n" + "".join(self.lines[-40:]))
            if time.monotonic() >= deadline:
                stacks = self._stacks()
                self.kill_group()  # the caller never gets this object to clean up
                raise AssertionError(f"server not listening after {timeout_s:.0f} s; its output and stacks:\n"
                                     + stacks)
        return self

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

    def _drain(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)
            if line.startswith("optserve listening on ") and not self._listening.is_set():
                self.address = line.split()[3]
                self.port = int(self.address.rsplit(":", 1)[1])
                self._listening.set()

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

