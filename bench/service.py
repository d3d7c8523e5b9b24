"""Service benchmark: one client, sync mode, Adafactor, a model of a few 4096 x 4096 matrices.

    .venv/bin/python -m bench.service            # ~100M float32 params (6 x 4096 x 4096), 2 shards
    .venv/bin/python -m bench.service --small    # 4 x 512 x 512, a quick smoke run

Rows: the service step (push_pull) over gRPC bytes and over the same-host shared-memory path
(``Client(shared_memory=...)``: NumPy arrays in and out, and with ``Session.gradient_buffers()``
plus returned views), int8 gradients over gRPC (bytes per step, loopback step time, and the step
on a simulated 10 Gb/s link: loopback step + the bytes' time on the link), the same kernel's jitted
step in process, raw TCP loopback
for the same bytes (plain sockets in another process: push bytes one way, pull bytes back,
reused buffers), a bare push and pull, the derived bytes per second, and the latency of push_pull on a
tiny model (p50 / p99): placed by default (one shard: it is far below ``min_shard_bytes``) and
forced across every shard.

The ``CPU:`` rows sum the CPU time each call used, machine-wide (``/proc/stat``) and in this
process (the client), over the interleaved rounds: on a machine whose cores are all busy during
a step, only less work per byte shortens it, not more overlap.

The large-model rows are measured in interleaved rounds (raw TCP, kernel, step, push, pull, then
again), and the step's ratio is the median of the per-round ratios: on a shared machine whose
speed drifts by +-20% between minutes, separate medians taken a minute apart compare noise.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import socket
import statistics
import time
from typing import Callable, Optional

import numpy as np

from bench._timing import CpuSample, CpuUse, print_table

OPTIMIZER = {"name": "adafactor", "args": {"learning_rate": 1e-2}}


def _model(matrices: int, dim: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {f"layer{i}/w": rng.standard_normal((dim, dim), dtype=np.float32) * 0.02 for i in range(matrices)}


# ----------------------------------------------------------------------------- raw TCP
def _echo_server(port_queue, push_bytes: int, pull_bytes: int) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port_queue.put(listener.getsockname()[1])
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    inbox = bytearray(push_bytes)
    outbox = bytes(pull_bytes)
    view = memoryview(inbox)
    while True:
        received = 0
        while received < push_bytes:
            got = conn.recv_into(view[received:], min(push_bytes - received, 4 << 20))
            if not got:  # the benchmark closed the connection
                conn.close()
                return
            received += got
        conn.sendall(outbox)


class RawTcpPeer:
    """Plain sockets to another process: each :meth:`round_trip` sends ``push_bytes`` and
    receives ``pull_bytes`` back, with buffers reused on both sides."""

    def __init__(self, push_bytes: int, pull_bytes: int):
        context = multiprocessing.get_context("spawn")
        ports = context.Queue()
        self._process = context.Process(target=_echo_server, args=(ports, push_bytes, pull_bytes), daemon=True)
        self._process.start()
        self._sock = socket.create_connection(("127.0.0.1", ports.get(timeout=60)))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._outbox = np.ones(push_bytes, np.uint8)
        self._inbox = memoryview(bytearray(pull_bytes))

    def round_trip(self) -> None:
        self._sock.sendall(self._outbox)
        received, size = 0, len(self._inbox)
        while received < size:
            received += self._sock.recv_into(self._inbox[received:], min(size - received, 4 << 20))

    def close(self) -> None:
        self._sock.close()
        self._process.join(30)


# ----------------------------------------------------------------------------- in process
def in_process_step(params: dict[str, np.ndarray], grads: dict[str, np.ndarray]):
    """A callable running one jitted, donated step of the same kernel in this process."""
    import jax
    import optax

    from optserve.optim_kernels import build_optimizer

    tx = build_optimizer(OPTIMIZER["name"], OPTIMIZER["args"]).transformation
    device_params = {k: jax.device_put(v) for k, v in params.items()}
    device_grads = {k: jax.device_put(v) for k, v in grads.items()}
    state = tx.init(device_params)

    # Donated, as on the shards (without donation every step also page-faults fresh outputs).
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    holder = [device_params, state]

    def run():
        holder[0], holder[1] = step(holder[0], holder[1], device_grads)
        jax.block_until_ready(holder[0])

    return run


def interleaved_seconds(fns: dict[str, Callable[[], object]], rounds: int, warmup: int = 1,
                        around: Optional[dict[str, Callable[[], object]]] = None
                        ) -> tuple[dict[str, list[float]], dict[str, CpuUse]]:
    """Wall seconds of each of ``fns`` per round, the functions taking turns within every round,
    so that a slow spell of a shared machine falls on ours and the baselines alike; and the CPU
    each used (this process vs the rest of the machine: here the shard actors, or the raw TCP peer).
    ``around[name]()`` runs before and after each measured call of ``name``, outside its timing."""
    around = around or {}
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    cpu = {name: CpuUse() for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if name in around:
                around[name]()
            before = CpuSample.now()
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
            cpu[name].add(before, CpuSample.now())
            if name in around:
                around[name]()
    return samples, cpu


# ----------------------------------------------------------------------------- service
def latency_ms(session, grads, count: int) -> tuple[float, float]:
    for _ in range(10):
        session.push_pull(grads)
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        session.push_pull(grads)
        samples.append(time.perf_counter() - start)
    samples.sort()
    return samples[len(samples) // 2] * 1e3, samples[min(len(samples) - 1, int(len(samples) * 0.99))] * 1e3


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="4 x 512 x 512 instead of 6 x 4096 x 4096")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    matrices, dim = (4, 512) if args.small else (6, 4096)
    repeats = args.repeats or 9
    params = _model(matrices, dim)
    grads = {k: np.random.default_rng(1).standard_normal(v.shape, dtype=np.float32) * 1e-3 for k, v in params.items()}
    nbytes = sum(v.nbytes for v in params.values())
    n_params = sum(v.size for v in params.values())

    kernel_step = in_process_step(params, grads)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from optserve.client import Client
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig

    server = start_server(ServerConfig(host="127.0.0.1", port=0, shards=args.shards))
    try:
        client = Client(server.address, timeout=600, shared_memory=False)
        session = client.create_session("bench", params, optimizer=OPTIMIZER)
        out = session.pull()  # reused result buffers (fresh ones page-fault on every call)
        fast_client = Client(server.address, timeout=600, shared_memory=True)  # fails unless proven
        fast = fast_client.create_session("bench-shm", params, optimizer=OPTIMIZER)
        fast_out = fast.pull()
        in_region = fast.gradient_buffers()  # a program writing its gradients here pushes without a copy
        for name, buffer in in_region.items():
            buffer[...] = grads[name]
        tcp_peer = RawTcpPeer(nbytes, nbytes)
        try:
            samples, cpu = interleaved_seconds({
                "tcp": tcp_peer.round_trip, "kernel": kernel_step, "step": lambda: session.push_pull(grads, out=out),
                "push": lambda: session.push(grads), "pull": lambda: session.pull(out=out),
                "shm_step": lambda: fast.push_pull(grads, out=fast_out),
                "shm_step_views": lambda: fast.push_pull(in_region, views=True),
                "shm_push": lambda: fast.push(grads), "shm_pull": lambda: fast.pull(out=fast_out)}, rounds=repeats)
        finally:
            tcp_peer.close()
        # int8 gradients over gRPC (the cross-host encoding): a few steps, bytes per step counted
        int8_step = []
        for _ in range(3):
            start = time.perf_counter()
            session.push_pull(grads, out=out, wire_dtype="int8")
            int8_step.append(time.perf_counter() - start)
        session.close()
        fast.close()
        fast_client.close()
        tiny_params = {"w": np.ones((8, 8), np.float32), "b": np.zeros((8,), np.float32)}
        tiny_grads = {k: np.full_like(v, 1e-3) for k, v in tiny_params.items()}
        tiny = client.create_session("bench-tiny", tiny_params, optimizer=OPTIMIZER)
        tiny_shards = len(tiny.status().shards)  # default placement: a model this small stays on one shard
        p50_1, p99_1 = latency_ms(tiny, tiny_grads, 300)
        tiny.close()
        client.close()
        tiny_fast_client = Client(server.address, timeout=600, shared_memory=True)
        tiny_fast = tiny_fast_client.create_session("bench-tiny-shm", tiny_params, optimizer=OPTIMIZER)
        p50_s, p99_s = latency_ms(tiny_fast, tiny_grads, 300)
        tiny_fast.close()
        tiny_fast_client.close()
        # The same tiny session forced across every shard (min_shard_bytes=0): a vote and a round
        # trip per extra shard per step.
        spread_server = start_server(ServerConfig(host="127.0.0.1", port=0, shards=args.shards, min_shard_bytes=0))
        try:
            spread_client = Client(spread_server.address, timeout=600)
            spread = spread_client.create_session("bench-tiny-spread", tiny_params, optimizer=OPTIMIZER)
            spread_shards = len(spread.status().shards)
            p50_2, p99_2 = latency_ms(spread, tiny_grads, 300)
            spread.close()
            spread_client.close()
        finally:
            spread_server.stop()
    finally:
        server.stop()

    tcp, kernel, step, push, pull = (statistics.median(samples[k]) for k in ("tcp", "kernel", "step", "push", "pull"))
    ratios = [s / (t + k) for s, t, k in zip(samples["step"], samples["tcp"], samples["kernel"])]
    # The data plane's rate with the update taken out, against raw TCP's for the same bytes.
    wire_shares = [t / (s - k) for s, t, k in zip(samples["step"], samples["tcp"], samples["kernel"])]
    gb = 1e9
    shm_step, shm_views, shm_push, shm_pull = (statistics.median(samples[k]) for k in
                                               ("shm_step", "shm_step_views", "shm_push", "shm_pull"))

    def per_round(name: str) -> str:  # median of this row's per-round ratios to the kernel step
        ratios_k = [s / k for s, k in zip(samples[name], samples["kernel"])]
        return f"{statistics.median(ratios_k):.2f} x kernel [{min(ratios_k):.2f}, {max(ratios_k):.2f}]"

    rows = [
        ["shared memory step (push_pull, NumPy)", shm_step * 1e3, 2 * nbytes / shm_step / gb, per_round("shm_step")],
        ["  with gradient_buffers + views", shm_views * 1e3, 2 * nbytes / shm_views / gb, per_round("shm_step_views")],
        ["  shared memory push", shm_push * 1e3, nbytes / shm_push / gb, per_round("shm_push")],
        ["  shared memory pull", shm_pull * 1e3, nbytes / shm_pull / gb, per_round("shm_pull")],
        ["gRPC step vs kernel", step * 1e3, 2 * nbytes / step / gb, per_round("step")],
        ["service step (push_pull)", step * 1e3, 2 * nbytes / step / gb,
         f"{statistics.median(ratios):.2f} x (raw TCP + kernel), median of per-round ratios "
         f"[{min(ratios):.2f}, {max(ratios):.2f}]"],
        ["  wire (step - kernel)", (step - kernel) * 1e3, 2 * nbytes / (step - kernel) / gb,
         f"{statistics.median(wire_shares):.0%} of raw TCP bytes/s (median per round)"],
        ["  push (stage+vote+update)", push * 1e3, nbytes / push / gb, ""],
        ["  pull", pull * 1e3, nbytes / pull / gb, f"{(nbytes / pull) / (2 * nbytes / tcp):.0%} of raw TCP bytes/s"],
        ["in-process kernel step", kernel * 1e3, "", "adafactor, jitted, donated, one device"],
        ["raw TCP loopback push+pull", tcp * 1e3, 2 * nbytes / tcp / gb, "plain sockets, other process"],
        ["tiny push_pull, default placement", f"p50 {p50_1:.2f} / p99 {p99_1:.2f}", "",
         f"8x8 + 8 on {tiny_shards} shard(s)"],
        ["tiny push_pull, spread", f"p50 {p50_2:.2f} / p99 {p99_2:.2f}", "",
         f"8x8 + 8 on {spread_shards} shards (min_shard_bytes=0)"],
        ["tiny push_pull, shared memory", f"p50 {p50_s:.2f} / p99 {p99_s:.2f}", "",
         f"8x8 + 8 on {tiny_shards} shard(s), default placement"],
    ]
    from optserve.protos import int8_codec

    int8_bytes = sum(int8_codec.int8_payload_bytes(v.size) for v in params.values())
    link = 10e9 / 8  # a 10 Gb/s link, bytes per second: the step's bytes cross it both ways
    int8_median = statistics.median(int8_step)
    rows += [
        ["int8 gradients, gRPC loopback", int8_median * 1e3, "",
         f"push {int8_bytes / 1e6:.1f} MB/step vs {nbytes / 1e6:.1f} MB f32 ({int8_bytes / nbytes:.3f}); median of 3"],
        ["  simulated 10 Gb/s link", (int8_median + (int8_bytes + nbytes) / link) * 1e3, "",
         f"f32: {(step + 2 * nbytes / link) * 1e3:.0f} ms (loopback step + wire time at 10 Gb/s)"],
    ]
    load = os.getloadavg()
    # Whether the machine, not the data plane's design, bounds the step: with every core busy,
    # overlapping work cannot shorten it, only doing less work can.
    for name, label, own, others in (("shm_step", "shared memory step", "client", "shards"),
                                     ("shm_step_views", "shared memory step, buffers + views", "client", "shards"),
                                     ("step", "service step", "client", "shards"), ("push", "push", "client", "shards"),
                                     ("pull", "pull", "client", "shards"), ("tcp", "raw TCP", "client", "peer"),
                                     ("kernel", "in-process kernel", "this process", "others")):
        summary = cpu[name].summary(own=own, others=others)
        if summary:
            rows.append([f"CPU: {label}", "", "", summary])
    title = (f"bench.service: {n_params / 1e6:.1f}M f32 params ({nbytes / 1e6:.0f} MB), {len(params)} tensors, "
             f"{args.shards} shards, adafactor, sync, 1 client; median of {repeats} interleaved rounds; "
             f"load avg {load[0]:.1f} on {os.cpu_count()} cores")
    return print_table(title, ["what", "ms", "GB/s (push+pull)", "note"], rows)


if __name__ == "__main__":
    main()
