"""What security costs: the service step with TLS + tenant tokens against plaintext, same run.

    .venv/bin/python -m bench.tls            # ~100M float32 params (6 x 4096 x 4096), 2 shards
    .venv/bin/python -m bench.tls --small    # 4 x 512 x 512, a quick smoke run

Two servers run side by side on loopback (same Ray): one plaintext, one with TLS on every port
and a token on every call (a certificate made for the run). Their large-model steps take turns
within every round (the machine's speed drifts); the ratio is the median of per-round ratios.
Then a tiny model's push_pull latency (p50 / p99) on each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import numpy as np

from bench._timing import print_table
from bench.service import OPTIMIZER, _model, interleaved_seconds, latency_ms

TOKEN = "bench-token"


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="4 x 512 x 512 instead of 6 x 4096 x 4096")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    matrices, dim = (4, 512) if args.small else (6, 4096)
    params = _model(matrices, dim)
    grads = {k: np.random.default_rng(1).standard_normal(v.shape, dtype=np.float32) * 1e-3 for k, v in params.items()}
    nbytes = sum(v.nbytes for v in params.values())
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from optserve.client import Client
    from optserve.server.app import start_server
    from optserve.server.domain.config import ServerConfig
    from optserve.server.wire.security import self_signed

    with tempfile.TemporaryDirectory() as tmp:
        material = self_signed("localhost")
        cert, key, tokens = Path(tmp, "cert.pem"), Path(tmp, "key.pem"), Path(tmp, "tokens")
        cert.write_bytes(material.cert)
        key.write_bytes(material.key)
        tokens.write_text(f"{TOKEN} bench\n")
        plain_server = start_server(ServerConfig(host="127.0.0.1", port=0, shards=args.shards))
        secure_server = start_server(ServerConfig(host="127.0.0.1", port=0, shards=args.shards, tls_cert=str(cert),
                                                  tls_key=str(key), auth_tokens=str(tokens)))
        try:
            plain = Client(plain_server.address, timeout=600)
            secure = Client(secure_server.address, timeout=600, token=TOKEN, tls=str(cert))
            sessions = {"plain": plain.create_session("bench", params, optimizer=OPTIMIZER),
                        "tls": secure.create_session("bench", params, optimizer=OPTIMIZER)}
            outs = {name: s.pull() for name, s in sessions.items()}
            samples, _ = interleaved_seconds(
                {name: (lambda s=s, o=outs[name]: s.push_pull(grads, out=o)) for name, s in sessions.items()},
                rounds=args.repeats)
            for s in sessions.values():
                s.close()
            tiny_params = {"w": np.ones((8, 8), np.float32), "b": np.zeros((8,), np.float32)}
            tiny_grads = {k: np.full_like(v, 1e-3) for k, v in tiny_params.items()}
            tiny = {"plain": plain.create_session("tiny", tiny_params, optimizer=OPTIMIZER),
                    "tls": secure.create_session("tiny", tiny_params, optimizer=OPTIMIZER)}
            latency = {name: latency_ms(s, tiny_grads, 300) for name, s in tiny.items()}
            for s in tiny.values():
                s.close()
            plain.close()
            secure.close()
        finally:  # the first server started Ray and shuts it down: stop it last
            secure_server.stop()
            plain_server.stop()

    step = {name: statistics.median(v) for name, v in samples.items()}
    ratios = [t / p for t, p in zip(samples["tls"], samples["plain"])]
    rows = [
        ["step, plaintext", step["plain"] * 1e3, 2 * nbytes / step["plain"] / 1e9, ""],
        ["step, TLS + token", step["tls"] * 1e3, 2 * nbytes / step["tls"] / 1e9,
         f"{statistics.median(ratios):.2f} x plaintext (median per round) [{min(ratios):.2f}, {max(ratios):.2f}]"],
        ["tiny push_pull, plaintext", f"p50 {latency['plain'][0]:.2f} / p99 {latency['plain'][1]:.2f}", "", ""],
        ["tiny push_pull, TLS + token", f"p50 {latency['tls'][0]:.2f} / p99 {latency['tls'][1]:.2f}", "",
         f"p50 +{latency['tls'][0] - latency['plain'][0]:.2f} ms"],
    ]
    title = (f"bench.tls: {sum(v.size for v in params.values()) / 1e6:.1f}M f32 params ({nbytes / 1e6:.0f} MB), "
             f"{args.shards} shards, adafactor, sync, 1 client; median of {args.repeats} interleaved rounds")
    return print_table(title, ["what", "ms", "GB/s (push+pull)", "note"], rows)


if __name__ == "__main__":
    main()
