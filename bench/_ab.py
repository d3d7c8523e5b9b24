"""Two server configurations side by side in one run: the service step and a tiny model's latency.

Both servers run on loopback in the same Ray; their large-model steps take turns within every
round (the machine's speed drifts), and the ratio is the median of per-round ratios. A variant
may be split by what its server was doing during each step (:class:`Split`): its steps are
reported in two rows, each against the baseline's steps of the same rounds.
"""

from __future__ import annotations

import os
import statistics
from typing import Any, Callable, Mapping, NamedTuple, Optional

import numpy as np

from bench._timing import print_table
from bench.service import OPTIMIZER, _model, interleaved_seconds, latency_ms


def parse_arguments(description: str, argv=None, extra=None):
    """The A/B benchmarks' flags: ``--small``, ``--shards``, ``--repeats`` (and ``extra(parser)``'s)."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--small", action="store_true", help="4 x 512 x 512 instead of 6 x 4096 x 4096")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    if extra is not None:
        extra(parser)
    return parser.parse_args(argv)


class Split(NamedTuple):
    """Splits a variant's steps in two by its server's state around each step.

    ``probe(session)`` returns a hashable state and whether the server is busy; a step is
    ``busy_label`` if the server was busy before or after it or its state changed across it
    (read outside the timed step), else ``idle_label``.
    """

    probe: Callable[[Any], tuple[Any, bool]]
    idle_label: str
    busy_label: str


def compare(title: str, variants: Mapping[str, tuple[Mapping[str, Any], Mapping[str, Any]]], *, small: bool,
            shards: int, repeats: int, splits: Optional[Mapping[str, Split]] = None, warmup: int = 1) -> str:
    """``variants``: name -> (ServerConfig keyword arguments, Client keyword arguments); the first
    is the baseline; ``splits``: variant name -> its :class:`Split`. Prints and returns the table."""
    splits = dict(splits or {})
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from optserve.client import Client
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig

    matrices, dim = (4, 512) if small else (6, 4096)
    params = _model(matrices, dim)
    grads = {k: np.random.default_rng(1).standard_normal(v.shape, dtype=np.float32) * 1e-3 for k, v in params.items()}
    nbytes = sum(v.nbytes for v in params.values())
    servers = {}
    try:
        for name, (server_kwargs, _) in variants.items():
            servers[name] = start_server(ServerConfig(host="127.0.0.1", port=0, shards=shards, **server_kwargs))
        clients = {name: Client(servers[name].address, timeout=600, **client_kwargs)
                   for name, (_, client_kwargs) in variants.items()}
        sessions = {name: c.create_session("bench", params, optimizer=OPTIMIZER) for name, c in clients.items()}
        outs = {name: s.pull() for name, s in sessions.items()}
        steps = {name: (lambda s=s, o=outs[name]: s.push_pull(grads, out=o)) for name, s in sessions.items()}
        probes = {name: [] for name in splits}  # (state, busy) before and after each measured step
        samples, _ = interleaved_seconds(steps, rounds=repeats, warmup=warmup, around={
            name: (lambda s=sessions[name], p=split.probe, seen=probes[name]: seen.append(p(s)))
            for name, split in splits.items()})
        busy = {name: [b[1] or a[1] or b[0] != a[0] for b, a in zip(seen[::2], seen[1::2])]
                for name, seen in probes.items()}
        for s in sessions.values():
            s.close()
        tiny_params = {"w": np.ones((8, 8), np.float32), "b": np.zeros((8,), np.float32)}
        tiny_grads = {k: np.full_like(v, 1e-3) for k, v in tiny_params.items()}
        latency = {}
        for name, client in clients.items():
            tiny = client.create_session("tiny", tiny_params, optimizer=OPTIMIZER)
            latency[name] = latency_ms(tiny, tiny_grads, 300)
            tiny.close()
            client.close()
    finally:  # the first server started Ray and shuts it down: stop it last
        for server in reversed(list(servers.values())):
            server.stop()

    names = list(variants)
    base = names[0]
    rows = []
    for name in names:
        parts = [(name, [True] * len(samples[name]))]
        if name in busy:
            parts = [(f"{name}, {label}", [b == want for b in busy[name]])
                     for label, want in ((splits[name].idle_label, False), (splits[name].busy_label, True))]
        for label, chosen in parts:
            mine = [x for x, keep in zip(samples[name], chosen) if keep]
            if not mine:
                rows.append([f"step, {label}", "-", "", "no such step in this run"])
                continue
            step = statistics.median(mine)
            note = ""
            if name != base:
                ratios = [a / b for a, b, keep in zip(samples[name], samples[base], chosen) if keep]
                note = (f"{statistics.median(ratios):.3f} x {base} (median per round, {len(ratios)} rounds) "
                        f"[{min(ratios):.2f}, {max(ratios):.2f}]")
            rows.append([f"step, {label}", step * 1e3, 2 * nbytes / step / 1e9, note])
    for name in names:
        p50, p99 = latency[name]
        note = "" if name == base else f"p50 {p50 - latency[base][0]:+.3f} ms vs {base}"
        rows.append([f"tiny push_pull, {name}", f"p50 {p50:.3f} / p99 {p99:.3f}", "", note])
    header = (f"{title}: {sum(v.size for v in params.values()) / 1e6:.1f}M f32 params ({nbytes / 1e6:.0f} MB), "
              f"{shards} shards, adafactor, sync, 1 client; median of {repeats} interleaved rounds "
              f"after {warmup} warm-up")
    return print_table(header, ["what", "ms", "GB/s (push+pull)", "note"], rows)
