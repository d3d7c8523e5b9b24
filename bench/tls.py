"""What security costs: the service step with TLS + tenant tokens against plaintext, same run.

    .venv/bin/python -m bench.tls            # ~100M float32 params (6 x 4096 x 4096), 2 shards
    .venv/bin/python -m bench.tls --small    # 4 x 512 x 512, a quick smoke run

Two servers side by side (:mod:`bench._ab`): one plaintext, one with TLS on every port and a token
on every call (a certificate made for the run).
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
        return compare("bench.tls", {
            "plaintext": ({}, {}),
            "TLS + token": ({"tls_cert": str(cert), "tls_key": str(key), "auth_tokens": str(tokens)},
                            {"token": TOKEN, "tls": str(cert)}),
        }, small=args.small, shards=args.shards, repeats=args.repeats)


if __name__ == "__main__":
    main()
