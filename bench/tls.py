"""What security costs: the service step with TLS + tenant tokens against plaintext, same run.

    .venv/bin/python -m bench.tls            # ~100M float32 params (6 x 4096 x 4096), 2 shards
    .venv/bin/python -m bench.tls --small    # 4 x 512 x 512, a quick smoke run

Servers side by side (:mod:`bench._ab`): plaintext, and TLS on every port with a token on every
call (a certificate made for the run); each with the default same-host path (tensor bytes through
shared memory, the step message over gRPC) and with every byte over gRPC (as from another host).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench._ab import compare, parse_arguments

TOKEN = "bench-token"


def main(argv=None) -> str:
    args = parse_arguments(__doc__.splitlines()[0], argv)
    from optserve.server.wire.security import self_signed

    with tempfile.TemporaryDirectory() as tmp:
        material = self_signed("localhost")
        cert, key, tokens = Path(tmp, "cert.pem"), Path(tmp, "key.pem"), Path(tmp, "tokens")
        cert.write_bytes(material.cert)
        key.write_bytes(material.key)
        tokens.write_text(f"{TOKEN} bench\n")
        secure = {"tls_cert": str(cert), "tls_key": str(key), "auth_tokens": str(tokens)}
        client = {"token": TOKEN, "tls": str(cert)}
        return compare("bench.tls", {
            "plaintext": ({}, {}),
            "TLS + token": (secure, client),
            # the bytes over gRPC (as from another host): TLS encrypts every tensor byte
            "plaintext, gRPC bytes": ({}, {"shared_memory": False}),
            "TLS + token, gRPC bytes": (secure, {**client, "shared_memory": False}),
        }, small=args.small, shards=args.shards, repeats=args.repeats)


if __name__ == "__main__":
    main()
