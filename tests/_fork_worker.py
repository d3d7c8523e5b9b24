"""A client process that forks between its steps, as a DataLoader starting workers each epoch
does (run by tests/test_client_fork.py in a fresh interpreter: no Ray loaded, gRPC's fork
handlers as a user's process has them).

Usage: python _fork_worker.py ADDRESS SESSION CYCLES. Each cycle: one push_pull, then a forked
child that does a little work and exits 0. Prints one line: the children's wait statuses."""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from optserve.client import Client


def main(address: str, session_name: str, cycles: int) -> None:
    with Client(address, timeout=60) as client:
        session = client.session(session_name, worker_id="forking")
        grads = {name: np.full(value.shape, 0.01, np.float32) for name, value in session.pull().items()}
        statuses = []
        for _ in range(cycles):
            session.push_pull(grads)  # leaves the shards' PushPull calls open
            pid = os.fork()
            if pid == 0:
                os._exit(0 if sum(range(10_000)) else 1)
            statuses.append(os.waitpid(pid, 0)[1])
        session.push_pull(grads)
        print(json.dumps(statuses), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
