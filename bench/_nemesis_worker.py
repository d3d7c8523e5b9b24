"""One nemesis worker, as its own process (bench/nemesis.py starts them):

    python -m bench._nemesis_worker ADDRESS SESSION WORKER_ID LOG STOP [--shm | --shm-auto] [--timeout T] [--pace P] [--seed S]

Attaches to SESSION as WORKER_ID (an elastic session: joins), then trains until the file STOP
exists: each step pushes the gradient :func:`bench.checker.push_gradient` gives for its push's
name ``(Session.client_id, sequence)`` with ``push_pull`` (from the version it last saw), sleeping
up to P seconds between steps. ``--shm``: ``Client(shared_memory=True)`` (same host, proven);
``--shm-auto``: ``"auto"`` (with the shards on this host only); else ``shared_memory=False``.

Every call is logged to LOG as JSON lines (the fields of :class:`bench.checker.CallRecord` plus
``id``): one line before the call (no outcome: a process killed mid-call leaves it so) and one
after it, with its outcome: "ok", "late" (an elastic push dropped as late), the gRPC status code
name, or "exception:<type>". The sequence is this process's count of the session object's pushes,
which is the SDK's numbering (``Session._header`` takes the next number once per push call).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import signal
import time
from typing import Callable, Optional

from bench.checker import gradient_seed, push_gradient


class CallLog:
    """Appends call records to a file, one JSON object per line, flushed line by line."""

    def __init__(self, path: str, session: str, worker: str):
        self._file = open(path, "a", buffering=1)
        self.session, self.worker = session, worker
        self._count = 0

    def call(self, kind: str, deadline_s: float, fn: Callable[[], Optional[int]], client_id: str = "",
             sequence: int = 0) -> tuple[str, Optional[int]]:
        """Runs ``fn`` (returns the acknowledged version, or None), logging it; returns (outcome, version)."""
        from optserve.client.errors import OptservError

        self._count += 1
        record = {"id": f"{self.worker}#{self._count}", "session": self.session, "worker": self.worker,
                  "client_id": client_id, "sequence": sequence,
                  "seed": gradient_seed(client_id, sequence) if sequence else 0, "kind": kind,
                  "started": time.time(), "ended": None, "outcome": "", "version": None, "deadline_s": deadline_s}
        self._write(record)
        detail = ""
        try:
            version = fn()
            outcome = "ok" if version is not None or kind != "push" else "late"
        except OptservError as error:
            outcome, version, detail = error.code, None, str(error)[:300]
        except Exception as error:  # an exception that is no documented status: the checker reports it
            outcome, version, detail = f"exception:{type(error).__name__}", None, str(error)[:300]
        record.update(ended=time.time(), outcome=outcome, version=version, detail=detail)
        self._write(record)
        return outcome, version

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench._nemesis_worker")
    for name in ("address", "session", "worker_id", "log", "stop"):
        parser.add_argument(name)
    parser.add_argument("--shm", action="store_true")
    parser.add_argument("--shm-auto", action="store_true", help="shared memory with the shards on this host only")
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--pace", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID`: every thread's stack in WORKER.out (a stuck call)

    from optserve.client import Client

    if os.environ.get("OPTSERVE_DEBUG_RETRIES"):  # each failed attempt of the SDK, timed, on stderr
        import logging

        logging.basicConfig(format="%(asctime)s %(message)s")
        logging.getLogger("optserve.client").setLevel(logging.DEBUG)

    rng = random.Random(args.seed)
    log = CallLog(args.log, args.session, args.worker_id)
    # the SDK's bounds: retries until `timeout`, the last attempt its own `timeout`, a refresh, a backoff
    push_deadline = 2 * args.timeout + 8.0
    attach_deadline = 5 * args.timeout + 10.0  # control calls: 5 attempts of `timeout` each
    client = Client(args.address, timeout=args.timeout,
                    shared_memory="auto" if args.shm_auto else True if args.shm else False)
    session = None

    def attach() -> int:
        nonlocal session
        attached = client.session(args.session, worker_id=args.worker_id)
        if attached.options.elastic:
            attached.join()
        attached.pull()
        session = attached
        return attached.version

    def going_on() -> bool:
        return not os.path.exists(args.stop)

    while going_on() and session is None:
        if log.call("attach", attach_deadline, attach)[0] != "ok":
            time.sleep(0.5)
    shapes = {n: shape for n, (_, shape) in session.specs.items()} if session is not None else {}
    sequence, failures = 0, 0
    while going_on() and session is not None:
        sequence += 1
        client_id, grads = session.client_id, push_gradient(shapes, session.client_id, sequence)

        def step(s=session, g=grads) -> Optional[int]:
            s.push_pull(g)
            return s.last_step.version  # None: dropped as late

        outcome, _ = log.call("push", push_deadline, step, client_id, sequence)
        if outcome in ("ok", "late"):
            failures = 0
        else:
            failures += 1
            time.sleep(0.2)
            pulled, _ = log.call("pull", push_deadline, lambda s=session: (s.pull(), s.version)[1])
            if failures >= 3 and pulled != "ok":  # a session object that cannot be served: attach afresh
                session.detach()
                session, sequence = None, 0
                while going_on() and session is None:
                    if log.call("attach", attach_deadline, attach)[0] != "ok":
                        time.sleep(0.5)
                failures = 0
        time.sleep(rng.uniform(0.0, args.pace))
    if session is not None:
        print("data paths", json.dumps(session.data_paths(), sort_keys=True), flush=True)  # for the bed's tests
        session.detach()
    client.close()


if __name__ == "__main__":
    main()
