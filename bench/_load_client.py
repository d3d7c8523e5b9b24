"""One client process of ``bench.load --processes``: the entry point the spawned processes run.

Kept light on purpose: it imports NumPy and ``optserve.client`` (gRPC) only, never JAX, PyTorch or
Ray, so that 64 of them fit next to a server on a small machine. See :func:`bench.load.run_processes`.
"""

from __future__ import annotations

import contextlib
import os
import time


def _peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def client_process(address: str, index: int, prefix: str, steps: int, timeout: float, ready, start, done,
                   results) -> None:
    """Creates session ``{prefix}-{index}`` from its own ``Client``, says so on ``ready`` (its index),
    waits at ``start`` (a barrier shared with every other client process and the parent), then
    steps it ``steps`` times (``push_pull``), timing each step; puts its measurements on ``results``, waits at ``done``
    (so that no session closes while others still step) and closes the session.

    What it puts (a dict): index, pid, create / first (s, or None), latencies (s, steps 2..N),
    cpu_s (this process's CPU seconds, all threads, over its steps), threads (the same by thread name),
    peak_rss (bytes), error (str or None).
    """
    from optserve.client import Client

    from bench.load import OPTIMIZER, gradients, model, thread_cpu_seconds  # NumPy only

    out = {"index": index, "pid": os.getpid(), "create": None, "first": None, "latencies": [], "cpu_s": 0.0,
           "peak_rss": 0, "error": None}
    client = session = None
    try:
        grads = [gradients(step, index) for step in range(steps)]  # made before the clock starts
        client = Client(address, timeout=timeout)
        t0 = time.perf_counter()
        session = client.create_session(f"{prefix}-{index}", model(), optimizer=OPTIMIZER)
        out["create"] = time.perf_counter() - t0
    except BaseException as exc:  # noqa: BLE001 - reported; the barrier must still be reached
        out["error"] = f"create: {type(exc).__name__}: {exc}"
    ready.put({"index": index})
    try:
        start.wait(timeout=timeout)
        if session is not None:
            threads0 = thread_cpu_seconds()
            cpu0 = time.process_time()
            t0 = time.perf_counter()
            session.push_pull(grads[0])
            out["first"] = time.perf_counter() - t0
            latencies = out["latencies"]
            for step in range(1, steps):
                t0 = time.perf_counter()
                session.push_pull(grads[step])
                latencies.append(time.perf_counter() - t0)
            out["cpu_s"] = time.process_time() - cpu0
            threads1 = thread_cpu_seconds()
            out["threads"] = {name: cpu - threads0.get(name, 0.0) for name, cpu in threads1.items()}
            # threads that ended during the steps (their CPU stays in the process's)
            out["threads"]["(ended threads)"] = max(0.0, out["cpu_s"] - sum(out["threads"].values()))
    except BaseException as exc:  # noqa: BLE001
        out["error"] = out["error"] or f"step: {type(exc).__name__}: {exc}"
    out["peak_rss"] = _peak_rss_bytes()
    results.put(out)
    with contextlib.suppress(BaseException):  # the parent gave up: close anyway
        done.wait(timeout=timeout)
    try:
        if session is not None:
            session.close()
    finally:
        if client is not None:
            client.close()
