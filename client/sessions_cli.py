"""``optserve sessions``: list the caller's sessions, or close some, from the command line.

    optserve sessions [--address HOST:PORT] [--token T] [--tls CA.pem] [--json]
    optserve sessions close NAME [NAME ...] [--address ...]
    optserve sessions save NAME DIR [--address ...]       # its whole state, as an orbax checkpoint
    optserve sessions restore NAME DIR [--address ...]    # a new session NAME from a saved state

A client-side command (``optserve[client]`` only), found by ``optserve`` through the
``optserve.commands`` entry point. The tenant rules are the SDK's: a token sees and closes its own
sessions only. Closing is what ``client.close_session(name)`` does: the session's state is dropped
on every shard (and its checkpoints on a durable server), so a script that crashed can be rerun
with other options under the same name. ``save`` writes the session's state at one version
(``Session.state()``: parameters, optimizer state, hyperparameters) into a new directory
(:mod:`optserve.client.state_files`); ``restore`` creates a session that starts there, on this
server or another (it needs orbax-checkpoint, part of ``optserve[server]``). Errors are one
line, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Optional, Sequence

from optserve.client.cli import OneLineArgumentParser, add_connection_options, collect, connect, error_line, table
from optserve.client.errors import OptservError
from optserve.client.state_files import load_state, save_state


def _parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="optserve sessions", description="List or close the caller's sessions.")
    add_connection_options(parser)
    parser.add_argument("action", nargs="?", choices=["list", "close", "save", "restore"], default="list",
                        help="list (the default), close the sessions named, save NAME DIR, restore NAME DIR")
    parser.add_argument("names", nargs="*", help="close: the sessions to close; save / restore: NAME DIR")
    return parser


def _save_or_restore(client, action: str, name: str, directory: str) -> str:
    """Saves session ``name`` into ``directory``, or creates it from the state saved there; the line to print."""
    if action == "save":
        state = client.session(name).state()
        save_state(state, directory)
        return f"saved {name} at version {state['version']} into {directory}"
    session = client.create_session(name, state=load_state(directory))
    version = session.version
    session.detach()
    return f"restored {name} at version {version} from {directory}"


def _rows(report: dict, now: float) -> list[list[object]]:
    rows = [[s["name"], s["mode"], s["optimizer"], s["version"], _idle(s["last_activity_unix_s"], now)]
            for s in report["sessions"]]
    return rows + [[s["name"], "lost", "", "", s["why"].splitlines()[0]] for s in report["lost_sessions"]]


def _idle(unix_s: float, now: float) -> str:
    return "never" if not unix_s else f"{max(0.0, now - unix_s):.0f}s"


def sessions_main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``optserve sessions``; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.action == "close" and not args.names:
        parser.error("close: name the sessions to close")
    if args.action in ("save", "restore") and len(args.names) != 2:
        parser.error(f"{args.action}: give NAME DIR, got {args.names}")
    if args.action == "list" and args.names:
        parser.error(f"unexpected names {args.names}: to close them, `optserve sessions close NAME ...`")
    try:
        with connect(args) as client:
            if args.action == "close":
                for name in args.names:
                    client.close_session(name)
                    print(json.dumps({"closed": name}) if args.json else f"closed {name}")
                return 0
            if args.action in ("save", "restore"):
                line = _save_or_restore(client, args.action, *args.names)
                print(json.dumps({args.action: args.names[0], "directory": args.names[1]}) if args.json else line)
                return 0
            report = collect(client)
    except (OptservError, ValueError, OSError, RuntimeError) as exc:
        print(error_line("sessions", args.address, exc), file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"sessions": report["sessions"], "lost_sessions": report["lost_sessions"]}, indent=2,
                         sort_keys=True))
        return 0
    print(table(["session", "mode", "optimizer", "version", "idle"], _rows(report, time.time()))
          if report["sessions"] or report["lost_sessions"] else "no sessions")
    return 0
