"""Starting ``optserve serve`` as a process of its own and reading its output: what the tests'
and the nemesis's servers share. The server prints ``optserve listening on HOST:PORT`` once it
serves; its output is read on a thread from the start, so waiting for that line honours its
timeout even when the server hangs before printing anything."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Callable, Optional, Sequence

METRICS_AT = "optserve metrics at "
LISTENING = "optserve listening on "


def serve_argv(port: int, *args: str, shards: int = 2) -> list[str]:
    """``python -m optserve.server.cli serve --port PORT --shards N --min-shard-bytes 0 ARGS``."""
    return [sys.executable, "-m", "optserve.server.cli", "serve", "--port", str(port), "--shards", str(shards),
            "--min-shard-bytes", "0", *args]


def serve_env(**extra: str) -> dict:
    """This process's environment for a server of its own: its own Ray (not one ``RAY_ADDRESS``
    names), no Ray token or usage report, unbuffered output; plus ``extra``."""
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1", **extra)
    env.pop("RAY_ADDRESS", None)
    return env


def start_serve(argv: Sequence[str], env: dict) -> subprocess.Popen:
    """Starts ``argv`` as a session leader (so the whole tree can be killed), stderr into stdout."""
    return subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)


class ServeOutput:
    """Reads a started server's output on a thread: keeps its lines (``lines``; with ``keep_all``
    False only those up to the listening line, for a long-running server whose ``echo`` writes
    them elsewhere), passes each to ``echo`` if given, and notes the address it listens on
    (``address``, ``port``)."""

    def __init__(self, process: subprocess.Popen, echo: Optional[Callable[[str], None]] = None,
                 keep_all: bool = True):
        self.process = process
        self._keep_all = keep_all
        self.lines: list[str] = []
        self.address = ""
        self.port = 0
        self.metrics_url = ""  # with --metrics-port: the endpoint the server says it serves (after listening)
        self._echo = echo
        self._listening = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def wait_listening(self, timeout_s: float) -> Optional[str]:
        """Waits until the server says it listens: None then, else why not ("exited" or "timeout")."""
        deadline = time.monotonic() + timeout_s
        while not self._listening.wait(0.2):
            if self.process.poll() is not None:
                self._reader.join(5.0)  # its last lines
                return None if self._listening.is_set() else "exited"
            if time.monotonic() >= deadline:
                return "timeout"
        return None

    def wait_exit(self, timeout_s: float) -> int:
        """The server's exit status once it exited (``subprocess.TimeoutExpired`` after
        ``timeout_s``), with every line it wrote read."""
        code = self.process.wait(timeout=timeout_s)
        self._reader.join(5.0)
        return code

    def tail(self, lines: int = 40) -> str:
        return "".join(self.lines[-lines:])

    def _read(self) -> None:
        for line in self.process.stdout:
            if self._echo is not None:
                self._echo(line)
            if self._keep_all or not self._listening.is_set():
                self.lines.append(line)
            if line.startswith(METRICS_AT):
                self.metrics_url = line.split()[-1]
            if line.startswith(LISTENING) and not self._listening.is_set():
                self.address = line.split()[3]
                self.port = int(self.address.rsplit(":", 1)[1])
                self._listening.set()
