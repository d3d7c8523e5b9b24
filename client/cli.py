"""``optserve status``: what a running server holds, as a table or as JSON.

    optserve status [--address HOST:PORT] [--token T] [--tls CA.pem] [--json]

A client-side command (it needs only ``optserve[client]``), found by ``optserve`` through the
``optserve.commands`` entry point. Lists the caller's sessions (name, mode, optimizer, version,
steps, pushes rejected, staleness p50/max, shards, bytes, last activity, workers that pushed in the last
minute of all that pushed, durable versions: through the step log and checkpointed) and the server's shards
(address, Ray node, sessions, bytes, memory, healthy). Errors are one line, exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Optional, Sequence

from optserve.client import Client
from optserve.client._retry import RetryPolicy
from optserve.client.errors import OptservError, SessionLostError


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr, ``PROG: MESSAGE``, and exit
    status 2 (argparse's own prints the whole usage block first). ``--help`` is unchanged."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message}\n")


def add_connection_options(parser: argparse.ArgumentParser) -> None:
    """The options every client-side command connects with (address, token, TLS, timeout, --json)."""
    parser.add_argument("--address", default="127.0.0.1:50051", help="the server's control address")
    parser.add_argument("--token", default=None, help="tenant token (servers started with --auth-tokens)")
    parser.add_argument("--tls", default=None, help="CA bundle (PEM) to verify a TLS server with")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per call")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def connect(args: argparse.Namespace) -> Client:
    """A client for a command's connection options (two tries per call, no heap tuning)."""
    return Client(args.address, token=args.token, tls=args.tls or False, timeout=args.timeout,
                  retry=RetryPolicy(attempts=2), retain_freed_memory=False)


def error_line(command: str, address: str, exc: Exception) -> str:
    """A command's one-line error: ``optserve CMD: ADDRESS: KIND: first line``."""
    return f"optserve {command}: {address}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="optserve status", description="Sessions and shards of a running server.")
    add_connection_options(parser)
    return parser


def _ago(unix_s: float, now: float) -> str:
    if not unix_s:
        return "never"
    seconds = max(0.0, now - unix_s)
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """``rows`` under ``header`` as aligned columns, a rule under the header."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def collect(client) -> dict:
    """``{"sessions": [...], "shards": [...]}`` as plain data (what ``--json`` prints)."""
    sessions, lost = [], []
    for name in client.list_sessions():
        try:
            options = client.session_options(name)
            status = client.session_status(name)
        except SessionLostError as exc:  # listed until its owner closes it
            lost.append({"name": name, "why": str(exc)})
            continue
        sessions.append({
            "name": name, "mode": options.mode, "optimizer": options.optimizer,
            "version": status.version, "steps_applied": status.steps_applied,
            "pushes_accepted": status.pushes_accepted, "rejected": dict(status.rejected),
            "staleness_p50": status.staleness_p50, "staleness_max": status.staleness_max,
            "shards": len(status.shards), "param_bytes": sum(s.param_bytes for s in status.shards),
            "optimizer_state_bytes": sum(s.optimizer_state_bytes for s in status.shards),
            "last_activity_unix_s": status.last_activity_unix_s,
            "workers": dict(status.workers),  # worker id -> its last push (unix s), most recent first
            # durable servers: the newest version every shard has a checkpoint of, and restores so far
            "durable_version": (min(s.durability.durable_version for s in status.shards)
                                if all(s.durability is not None for s in status.shards) else None),
            "logged_version": _logged_version(status.shards),
            "recoveries": sum(s.durability.recoveries for s in status.shards if s.durability is not None),
            # elastic sync sessions: membership and rounds (None for the others)
            "elastic": dataclasses.asdict(status.elastic) if status.elastic is not None else None,
        })
    shards = [dataclasses.asdict(s) for s in client.server_status()]
    return {"sessions": sessions, "lost_sessions": lost, "shards": shards}


def _logged_version(shards) -> Optional[int]:
    """Durable servers: the newest version every shard holds in its step log or a checkpoint (a
    shard acknowledges a step once it is logged, so while its log takes writes that is its
    version; while it does not, its checkpoint's); None when not durable."""
    if any(s.durability is None for s in shards):
        return None
    return min(s.version if not s.durability.degraded else s.durability.durable_version for s in shards)


def _standby(shard: dict) -> str:
    """The standby cell: its Ray node and the sessions it holds in sync, of those kept with a
    standby (``-``: no standby)."""
    standby = shard.get("standby")
    if not standby:
        return "-"
    if not standby["healthy"]:
        return "NOT ANSWERING"
    return f"{(standby['node_id'] or '?')[:12]} {standby['in_sync']}/{standby.get('replicated', shard['sessions'])}"


def _durable(session: dict) -> str:
    """The durable cell: ``logged/checkpointed`` versions (``-``: not durable)."""
    if session.get("durable_version") is None:
        return "-"
    return f"{session.get('logged_version', '?')}/{session['durable_version']}"


def _mode(session: dict) -> str:
    """The mode cell: an elastic session adds its members and stragglers."""
    elastic = session.get("elastic")
    if not elastic:
        return session["mode"]
    stragglers = f", {len(elastic['stragglers'])} straggling" if elastic["stragglers"] else ""
    return f"{session['mode']} elastic ({len(elastic['members'])} members{stragglers})"


ACTIVE_WORKER_S = 60.0  # `optserve status` counts a worker as attached if it pushed this recently


def _workers(session: dict, now: float) -> str:
    """The workers cell: those that pushed within ACTIVE_WORKER_S, of all that ever pushed."""
    pushes = session.get("workers") or {}
    active = sum(1 for unix_s in pushes.values() if now - unix_s <= ACTIVE_WORKER_S)
    return f"{active}/{len(pushes)}"


def render(report: dict, now: Optional[float] = None) -> str:
    now = time.time() if now is None else now
    sessions = [[s["name"], _mode(s), s["optimizer"], s["version"], s["steps_applied"],
                 sum(s["rejected"].values()), f"{s['staleness_p50']}/{s['staleness_max']}", s["shards"],
                 _mib(s["param_bytes"] + s["optimizer_state_bytes"]), _ago(s["last_activity_unix_s"], now),
                 _workers(s, now), _durable(s)]
                for s in report["sessions"]]
    shards = [[s["index"], s["address"], (s["node_id"] or "?")[:12], s["sessions"], _mib(s["param_bytes"]),
               _mib(s["resident_bytes"]), "yes" if s["healthy"] else "NO", _standby(s)] for s in report["shards"]]
    return "\n\n".join([
        table(["session", "mode", "optimizer", "version", "steps", "rejected", "staleness p50/max", "shards",
                "bytes", "last activity", f"workers ({ACTIVE_WORKER_S:.0f}s/all)", "durable (logged/checkpointed)"], sessions)
        if sessions else "no sessions",
        *([table(["lost session", "why"], [[s["name"], s["why"]] for s in report["lost_sessions"]])]
          if report.get("lost_sessions") else []),
        table(["shard", "address", "ray node", "sessions", "param bytes", "memory", "healthy",
               "standby (node, in sync)"], shards),
    ])


def status_main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``optserve status``; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        with connect(args) as client:
            report = collect(client)
    except (OptservError, ValueError) as exc:
        print(error_line("status", args.address, exc), file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2, sort_keys=True) if args.json else render(report))
    return 0
