"""The ``optserve`` command: ``optserve serve ...`` runs the coordinator; ``optserve demo`` runs the demo."""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="optserve", description="Optimizer-as-a-service.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the coordinator and its shard actors")
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    serve.add_argument("--port", type=int, default=50051, help="Control port (0: pick a free one)")
    serve.add_argument("--shards", type=int, default=2, help="number of shard actors")
    serve.add_argument("--ray-address", default="local",
                       help="'local' (start an embedded Ray), 'auto' (join a running cluster) or an address")
    serve.add_argument("--gpus-per-shard", type=float, default=0.0, help="GPUs each shard actor requests")
    serve.add_argument("--shard-host", default=None, help="interface the shards bind (default: --host)")
    serve.add_argument("--precond-workers", type=int, default=0, help="Shampoo preconditioner workers")
    serve.add_argument("--gpus-per-precond-worker", type=float, default=0.0, help="GPUs per preconditioner worker")
    serve.add_argument("--precond-f64", action="store_true", help="compute preconditioner roots in float64")
    serve.add_argument("--min-shard-bytes", type=int, default=4 << 20,
                       help="a session spreads over only as many shards as give each this many parameter "
                            "bytes (default 4 MiB; 0: every session uses every shard)")
    sub.add_parser("demo", help="run the end-to-end demo", add_help=False)
    return parser


def serve(args: argparse.Namespace) -> int:
    from optserve.server.app import start_server
    from optserve.server.config import ServerConfig
    from optserve.server.errors import InvalidArgument

    try:
        config = ServerConfig(
            host=args.host, port=args.port, shards=args.shards, ray_address=args.ray_address,
            gpus_per_shard=args.gpus_per_shard, shard_host=args.shard_host, precond_workers=args.precond_workers,
            gpus_per_precond_worker=args.gpus_per_precond_worker, precond_f64=args.precond_f64,
            min_shard_bytes=args.min_shard_bytes,
        )
    except InvalidArgument as exc:
        print(f"optserve serve: {exc}", file=sys.stderr)
        return 2
    running = start_server(config)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"optserve listening on {running.address}", flush=True)
    while not stop.wait(0.5):
        pass
    print("optserve shutting down", flush=True)
    running.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:
        from optserve.server import demo

        return demo.main(argv[1:]) or 0
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
