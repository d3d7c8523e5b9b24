"""What a hot standby costs: the service step with one replica, with ``--replicas 2``, with the
disk log and with both, same run; and the bytes each primary streams to its standby per step, each way.

    .venv/bin/python -m bench.replicas            # ~100M float32 params (6 x 4096 x 4096), 2 shards
    .venv/bin/python -m bench.replicas --small    # 4 x 512 x 512, a quick smoke run

Step times: four servers side by side (:mod:`bench._ab`, interleaved rounds after warm-up): one
replica (the baseline), ``--replicas 2`` (each step acknowledged once the shard's standby holds it
in memory too), the step log alone (each step acknowledged once its record is on disk; no
checkpoint) and both (once both hold it). On one machine the standbys are other processes of the same machine
(``replica_same_node``), so the figure is the cost of the stream and the standby's update sharing
the machine's cores, not of a network between hosts.

Bytes: a ``--replicas 2`` server with its metrics on; after the warm-up, the growth of
``optserve_replica_sent_bytes_total`` (starts, steps, clock entries, to the standby) and
``optserve_replica_received_bytes_total`` (the standby's answers) over a number of steps, per step,
beside the gradient bytes a client pushes per step. The primary forwards each applied step's
gradient: the standby's stream carries what the client sent once more, and the client sends it once.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import urllib.request

import numpy as np

from bench._ab import compare, parse_arguments
from bench._timing import print_table
from bench.service import OPTIMIZER, _model

NEVER = 10**12
SENT, RECEIVED = "optserve_replica_sent_bytes_total", "optserve_replica_received_bytes_total"


# Standbys on this machine, judged silent only after 5 s: with four servers of 100M parameters on a
# few cores, a process busy catching up a standby (or starved of CPU) can miss probes for over the
# default 0.5 s, and a standby forgotten and started again would be timed instead of the step.
SAME_NODE = {"replica_same_node": True, "replica_silence_s": 5.0}


def replica_bytes(metrics_address: str) -> tuple[float, float]:
    """(bytes sent to standbys, bytes of their answers received), summed over the shards."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=60).read().decode()
    totals = {SENT: 0.0, RECEIVED: 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals[SENT], totals[RECEIVED]


def bytes_per_step(small: bool, shards: int, steps: int) -> str:
    """The stream's bytes per step each way, measured on a ``--replicas 2`` server: a printed table."""
    from optserve.client import Client
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig

    matrices, dim = (4, 512) if small else (6, 4096)
    params = _model(matrices, dim)
    grads = {k: np.random.default_rng(1).standard_normal(v.shape, dtype=np.float32) * 1e-3 for k, v in params.items()}
    nbytes = sum(v.nbytes for v in params.values())
    server = start_server(ServerConfig(host="127.0.0.1", port=0, shards=shards, replicas=2, **SAME_NODE,
                                       metrics_port=0))
    try:
        client = Client(server.address, timeout=600)
        session = client.create_session("bytes", params, optimizer=OPTIMIZER)
        out = session.pull()
        for _ in range(3):  # the standbys' starts (the whole state) go out during these
            session.push_pull(grads, out=out)
        sent_before, received_before = replica_bytes(server.metrics_address)
        for _ in range(steps):
            session.push_pull(grads, out=out)
        sent, received = replica_bytes(server.metrics_address)
        session.close()
        client.close()
    finally:
        server.stop()
    up, down = (sent - sent_before) / steps, (received - received_before) / steps
    return print_table(f"bench.replicas: bytes per step ({nbytes / 1e6:.0f} MB of float32 gradient, {shards} shards, "
                       f"mean of {steps} steps after 3)", ["what", "MB per step", "x gradient", "note"], [
        ["client -> shards (the push's gradient)", nbytes / 1e6, 1.0, "the tensors' bytes; the chunks' framing aside"],
        ["primaries -> standbys", up / 1e6, up / nbytes, "each applied step: its gradient and record"],
        ["standbys -> primaries", down / 1e6, down / nbytes, "answers: the version held"],
    ])


def main(argv=None) -> str:
    def extra(parser):
        parser.add_argument("--dir", default=None, help="folder for the disk log (default: a temporary folder)")
        parser.add_argument("--steps", type=int, default=8, help="steps the bytes are counted over")

    args = parse_arguments(__doc__.splitlines()[0], argv, extra=extra)
    from optserve.server.domain.durability import DurabilityConfig

    root = tempfile.mkdtemp(prefix="optserve-bench-replicas-", dir=args.dir)
    try:
        log_alone = DurabilityConfig(os.path.join(root, "log"), every_steps=NEVER, every_s=1e9, max_log_bytes=NEVER)
        table = compare(f"bench.replicas, a hot standby against the disk log (log in {root})", {
            "one replica": ({}, {}),
            "--replicas 2 (standby: another process, same machine)": ({"replicas": 2, **SAME_NODE}, {}),
            "step log on disk, no checkpoint": ({"durability": log_alone}, {}),
            "both: --replicas 2 and the step log": ({"replicas": 2, **SAME_NODE,
                                                     "durability": dataclasses.replace(
                                                         log_alone, checkpoint_dir=os.path.join(root, "both"))}, {}),
        }, small=args.small, shards=args.shards, repeats=args.repeats, warmup=3)
        return table + bytes_per_step(args.small, args.shards, args.steps)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
