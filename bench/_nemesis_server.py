"""The nemesis's server: ``optserve serve`` as a real process tree of its own, which the nemesis
kills whole (SIGKILL of every process of its session: the server, its Ray, its shard actors) and
starts again on the same port and checkpoint directory, and whose shard actors it finds by their
process title (``ray::ShardActor``, in the server's session only: other servers on the machine
are never touched)."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from typing import Optional, TextIO

from bench.process_session import ask_for_stacks, kill_session, session_pids, titled
from bench.serve_output import ServeOutput, serve_argv, serve_env, start_serve


class NemesisServer:
    """``python -m optserve.server.cli serve --port PORT --shards 2 --min-shard-bytes 0 ARGS``, its
    output appended to ``log``; :meth:`start` waits until it listens and sets ``address``."""

    def __init__(self, args: list[str], log: TextIO, port: int = 0):
        self.args = list(args)
        self.port = port
        self.address = ""
        self.process: Optional[subprocess.Popen] = None
        self._output: Optional[ServeOutput] = None
        self._log = log
        self._log_lock = threading.Lock()
        self.starts = 0

    def start(self, timeout_s: float = 180.0) -> float:
        """Starts the server (on the port of its first start) and waits until it listens; returns
        the unix time it said so."""
        self.process = start_serve(serve_argv(self.port, *self.args), serve_env(RAY_DEDUP_LOGS="0"))
        self.starts += 1
        self._write(f"--- start {self.starts} at {time.time():.3f}\n")
        output = self._output = ServeOutput(self.process, echo=self._write, keep_all=False)
        why = output.wait_listening(timeout_s)
        if why is not None:
            if why == "timeout":  # hung while starting: where, in the log
                self.dump_stacks()
            self.kill_tree()
            raise RuntimeError(f"the server did not start (within {timeout_s:.0f} s):\n" + output.tail(30))
        self.address, self.port = output.address, output.port
        return time.time()

    @property
    def metrics_url(self) -> str:
        """The metrics endpoint the server said it serves (``--metrics-port``; "" before it said so)."""
        return self._output.metrics_url if self._output is not None else ""

    def dump_stacks(self) -> None:
        """Every thread's stack of the server (into its output, so the log) and of its shard
        actors (into their Ray logs): both dump them on SIGUSR1."""
        if self.process is not None:
            ask_for_stacks([self.process.pid, *self.shard_pids()])

    def _write(self, text: str) -> None:
        with self._log_lock:
            self._log.write(text)
            self._log.flush()

    def session_pids(self) -> list[int]:
        """Every live process of the server's session (it was started as a session leader)."""
        return [] if self.process is None else session_pids(self.process.pid)

    def shard_pids(self) -> list[int]:
        """The shard actors' pids, ascending (a replaced shard's new process sorts where it falls)."""
        return titled(self.session_pids(), b"ray::ShardActor")

    def kill_tree(self) -> None:
        """SIGKILL of every process of the server's session, then waits for the server to exit."""
        if self.process is None:
            return
        kill_session(self.process.pid)
        self.process.wait(timeout=60)
        self._write(f"--- killed at {time.time():.3f}\n")

    def stop(self) -> None:
        """SIGTERM, then the tree's SIGKILL if it has not exited within a minute."""
        if self.process is None or self.process.poll() is not None:
            self.kill_tree()
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        self.kill_tree()
