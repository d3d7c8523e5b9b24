"""A crowd of clients that pause: the step time of many idle-pausing clients on one server.

    .venv/bin/python -m bench.crowd                       # 64 clients (threads), 20 steps each
    .venv/bin/python -m bench.crowd --processes           # the same clients as processes
    .venv/bin/python -m bench.crowd --clients 16 --steps 5

Each client has its own ``Client`` and session (adam, a small model spread over the server's 2
shards) and does ``steps`` ``push_pull`` steps with a random pause of 0 to ``max_pause_s``
between them, so the shards' open calls are more than their threads and idle ones are ended
while their clients pause. Prints the step time's p50, p99 and max over every client's steps.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import threading
import time
import uuid

import numpy as np

SHAPES = {"w": (64, 32), "b": (32,)}


def client_steps(address: str, steps: int, max_pause_s: float, seed: int) -> list[float]:
    """One client's step times (seconds): its own Client and session, pauses between steps."""
    from optserve.client import Client

    rng = random.Random(seed)
    params = {name: np.zeros(shape, np.float32) for name, shape in SHAPES.items()}
    grads = {name: np.ones(shape, np.float32) for name, shape in SHAPES.items()}
    times = []
    with Client(address, timeout=120) as client:
        session = client.create_session(f"crowd-{uuid.uuid4().hex[:8]}", params,
                                        optimizer={"name": "adam", "args": {"learning_rate": 0.01}})
        try:
            for _ in range(steps):
                time.sleep(rng.uniform(0.0, max_pause_s))
                start = time.perf_counter()
                session.push_pull(grads)
                times.append(time.perf_counter() - start)
        finally:
            session.close()
    return times


def _process_main(args: tuple, out) -> None:
    out.put(client_steps(*args))


def run(address: str, clients: int, steps: int, max_pause_s: float, processes: bool, seed: int = 0) -> list[float]:
    """Every client's step times, the clients as threads of this process or as processes."""
    times: list[float] = []
    if processes:
        queue = multiprocessing.get_context("spawn").Queue()
        workers = [multiprocessing.get_context("spawn").Process(
            target=_process_main, args=((address, steps, max_pause_s, seed + i), queue)) for i in range(clients)]
        for worker in workers:
            worker.start()
        for _ in workers:
            times.extend(queue.get())
        for worker in workers:
            worker.join()
        return times
    lock = threading.Lock()

    def one(i: int) -> None:
        result = client_steps(address, steps, max_pause_s, seed + i)
        with lock:
            times.extend(result)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return times


def summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"steps": len(ordered), "p50_s": statistics.median(ordered),
            "p99_s": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], "max_s": ordered[-1]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--max-pause-s", type=float, default=1.5)
    parser.add_argument("--processes", action="store_true", help="clients as processes (default: threads)")
    parser.add_argument("--address", default=None, help="a running server (default: start one, 2 shards)")
    parser.add_argument("--grpc-threads", type=int, default=None, help="the started server's threads per gRPC server")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    server = None
    address = args.address
    if address is None:
        from optserve.server.app import start_server
        from optserve.server.domain.config import ServerConfig

        threads = {} if args.grpc_threads is None else {"grpc_threads": args.grpc_threads}
        server = start_server(ServerConfig(host="127.0.0.1", port=0, shards=2, ray_address="local", min_shard_bytes=0,
                                           **threads))
        address = server.address
    try:
        started = time.perf_counter()
        result = summary(run(address, args.clients, args.steps, args.max_pause_s, args.processes))
    finally:
        if server is not None:
            server.stop()
    kind = "processes" if args.processes else "threads"
    print(f"crowd: {args.clients} clients ({kind}), {args.steps} steps each, pauses 0-{args.max_pause_s:g} s, "
          f"{time.perf_counter() - started:.0f} s: step p50 {result['p50_s'] * 1e3:.1f} ms, "
          f"p99 {result['p99_s'] * 1e3:.1f} ms, max {result['max_s'] * 1e3:.1f} ms ({result['steps']} steps)")
    return result


if __name__ == "__main__":
    main()
