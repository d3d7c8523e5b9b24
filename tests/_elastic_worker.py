"""One worker of an elastic sync session, as its own process (tests/test_elastic_processes.py).

    python -m tests._elastic_worker ADDRESS SESSION WORKER_ID UNTIL [PACE_S]

Joins as WORKER_ID, then pushes the gradient :func:`worker_grads` gives for the version it last
saw (sleeping PACE_S before each push) until it saw version UNTIL (a number) or until the file
UNTIL exists (a path), and prints one line per answer:
``acked <version>`` or ``late <version>``; ``done`` at the end. Gradients depend only on (worker, version), so a run replays from its history.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from optserve.client import Client


def worker_grads(shapes: dict, worker: str, version: int) -> dict[str, np.ndarray]:
    seed = (sum(map(ord, worker)) * 1_000 + version) % (2**32)
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(shape).astype(np.float32) for n, shape in sorted(shapes.items())}


def main(address: str, session: str, worker_id: str, until: str, pace_s: float) -> None:
    def going_on(version: int) -> bool:
        return version < int(until) if until.isdigit() else not os.path.exists(until)

    with Client(address, timeout=60.0) as client:
        s = client.session(session, worker_id=worker_id)
        s.join()
        s.pull()
        shapes = {n: shape for n, (_, shape) in s.specs.items()}
        while going_on(s.version):
            time.sleep(pace_s)
            s.push_pull(worker_grads(shapes, worker_id, s.version))
            step = s.last_step
            print(f"acked {step.version}" if step.dropped is None else f"late {step.current_version}", flush=True)
        s.detach()
        print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]) if len(sys.argv) > 5 else 0.0)
