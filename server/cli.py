"""The ``optserve`` command: ``optserve serve ...`` runs the coordinator and its shards.

Other subcommands (``optserve demo``) are applications on top of optserve, found through the
``optserve.commands`` entry-point group; this module never imports them.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import io
import logging
import os
import signal
import sys
import threading
import time
from importlib.metadata import entry_points

# Light modules only, none of which imports grpc (serve() sets GRPC_VERBOSITY before gRPC is first
# imported) nor a server extra (``optserve status`` and ``demo`` run on a client-only install).
from optserve.server.compute.devices import DeviceUnusable
from optserve.server.domain.config import ONE_REPLICA_POLICIES, Limits, ServerConfig
from optserve.server.domain.durability import DurabilityConfig, FsyncPolicy, LogIO
from optserve.server.domain.errors import InvalidArgument
from optserve.server.ops.logs import LEVELS, configure_logging
from optserve.server.preflight import StartError
from optserve.server.storage.dir_lock import DirectoryLocked
from optserve.server.storage.verify import verify_directory


class _OneLineParser(argparse.ArgumentParser):
    """Usage errors are one line on stderr (``optserve serve: argument --port: invalid int value:
    'x'``) and exit status 2, not argparse's usage block first. Subcommands' parsers are of this
    class too (argparse makes them of their parent's)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message}\n")


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="optserve", description="Optimizer-as-a-service.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the coordinator and its shard actors")
    _add_placement_options(serve)
    _add_security_options(serve)
    _add_operator_options(serve)
    _add_limit_options(serve)
    _add_durability_options(serve)
    checkpoint = sub.add_parser("checkpoint", help="offline tools for a --checkpoint-dir")
    tools = checkpoint.add_subparsers(dest="tool", required=True)
    verify = tools.add_parser("verify", help="check every checkpoint and step-log record of a --checkpoint-dir "
                                             "(no server needed); exit status 0: intact, 1: torn tails only "
                                             "(a restore cuts them), 3: corrupt")
    verify.add_argument("directory", help="the server's --checkpoint-dir")
    # applications on top (optserve.commands entry points): listed here, run by main() before parsing
    sub.add_parser("demo", help="run the end-to-end demo", add_help=False)
    sub.add_parser("status", help="sessions and shards of a running server", add_help=False)
    sub.add_parser("sessions", help="list the caller's sessions, or close them (sessions close NAME ...)",
                   add_help=False)
    sub.add_parser("report", help="plots and CSV of a session's loss and staleness", add_help=False)
    return parser


def _add_placement_options(serve: argparse.ArgumentParser) -> None:
    """Where the server listens, the Ray cluster, and the shards and workers it starts there."""
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    serve.add_argument("--port", type=int, default=50051, help="Control port (0: pick a free one)")
    serve.add_argument("--shards", type=int, default=2, help="number of shard actors")
    serve.add_argument("--ray-address", default="local",
                       help="'local' (start an embedded Ray), 'auto' (join a running cluster) or an address")
    serve.add_argument("--gpus-per-shard", type=float, default=0.0, help="GPUs each shard actor requests")
    serve.add_argument("--shard-host", default=None, help="interface the shards bind (default: --host)")
    serve.add_argument("--precond-workers", type=int, default=0, help="preconditioner workers (Shampoo roots, SOAP eigenbases)")
    serve.add_argument("--gpus-per-precond-worker", type=float, default=0.0, help="GPUs per preconditioner worker")
    serve.add_argument("--rehearse-gpus", action="store_true",
                       help="reserve the GPUs in Ray as asked, but run each actor's JAX on the CPU (checks a GPU "
                            "deployment's placement where there is no GPU)")
    serve.add_argument("--precond-f64", action="store_true", help="compute preconditioner roots in float64")
    serve.add_argument("--replicas", type=int, default=1, choices=(1, 2),
                       help="2: every shard has a hot standby on another Ray node, which holds each step before "
                            "it is acknowledged and serves in its place when it dies")
    serve.add_argument("--replica-silence-s", type=float, default=0.5,
                       help="with --replicas 2: a shard or standby process that does not answer the "
                            "coordinator's probes for this long counts as lost (default 0.5)")
    serve.add_argument("--on-one-replica", choices=ONE_REPLICA_POLICIES, default="continue",
                       help="with --replicas 2, while a session has one copy in sync (its standby or primary "
                            "lost, until a fresh standby caught up): continue acknowledging steps with that one "
                            "copy (default), or refuse them (UNAVAILABLE; clients retry)")
    serve.add_argument("--min-shard-bytes", type=int, default=4 << 20,
                       help="a session spreads over only as many shards as give each this many parameter "
                            "bytes (default 4 MiB; 0: every session uses every shard)")


def _add_security_options(serve: argparse.ArgumentParser) -> None:
    """TLS, tenant tokens, and the explicit opt-out of both on a non-loopback interface."""
    serve.add_argument("--tls-cert", default=None, help="PEM certificate chain: TLS on every port")
    serve.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    serve.add_argument("--tls-client-ca", default=None, help="PEM CA that client certificates must chain to (mTLS)")
    serve.add_argument("--auth-tokens", default=None,
                       help="file of tenant tokens, one per line ('token [name]'); every call must carry one")
    serve.add_argument("--insecure", action="store_true",
                       help="allow a non-loopback --host/--shard-host without TLS and tokens")


def _add_operator_options(serve: argparse.ArgumentParser) -> None:
    """What operators see and tune: metrics, health, draining, expiry of idle work, logs."""
    serve.add_argument("--metrics-port", type=int, default=None,
                       help="serve Prometheus metrics at http://METRICS_HOST:PORT/metrics (0: a free port)")
    serve.add_argument("--metrics-host", default="127.0.0.1", help="interface of the metrics endpoint")
    serve.add_argument("--drain-s", type=float, default=1.0,
                       help="on SIGINT/SIGTERM, seconds health checks report NOT_SERVING before stopping")
    serve.add_argument("--health-port", type=int, default=None,
                       help="also answer gRPC health checks (only them) in plaintext on this port, for probes "
                            "that cannot speak TLS")
    serve.add_argument("--staged-push-ttl-s", type=float, default=60.0,
                       help="a push staged without auto-commit (the two-phase path) and not committed within this "
                            "many seconds is dropped and its buffers freed")
    serve.add_argument("--session-idle-s", type=float, default=None,
                       help="close a session no client pushed to or pulled from for this many seconds "
                            "(default: never)")
    serve.add_argument("--log-level", choices=LEVELS, default="info",
                       help="log one key=value line per session event, refusal and server error at this "
                            "level and above, on stderr (default: info)")
    serve.add_argument("--verbose", action="store_true",
                       help="let Ray and gRPC print their own messages while the server starts (and gRPC's "
                            "afterwards); by default a failed start is one line on stderr, exit status 2")


def _add_limit_options(serve: argparse.ArgumentParser) -> None:
    """The bounds of :class:`~optserve.server.domain.config.Limits` (``Limits.FLAGS``)."""
    limits = serve.add_argument_group("limits", "exceeding one is RESOURCE_EXHAUSTED naming it (sizes in bytes)")
    limits.add_argument("--max-session-bytes", type=int, default=None,
                        help="parameter bytes of one session (default: half of this machine's memory)")
    limits.add_argument("--shard-memory-bytes", type=int, default=None,
                        help="memory budget of each shard: its sessions' parameters, the optimizer state their "
                             "shapes need (traced from the optimizer itself) and gradient buffers (default: half "
                             "of this machine's memory split over the shards)")
    limits.add_argument("--max-tensors", type=int, default=100_000, help="tensors in one session")
    limits.add_argument("--max-tensor-name-bytes", type=int, default=1024, help="bytes of a tensor's name")
    limits.add_argument("--max-tensor-rank", type=int, default=32, help="dimensions of a tensor")
    limits.add_argument("--max-metadata-bytes", type=int, default=16 << 10, help="request metadata per call")
    limits.add_argument("--max-json-depth", type=int, default=32,
                        help="nesting of a session's optimizer arguments (deeper: INVALID_ARGUMENT)")
    limits.add_argument("--max-json-bytes", type=int, default=1 << 20, help="size of a session's optimizer arguments")
    limits.add_argument("--max-sessions-per-tenant", type=int, default=1024, help="open sessions of one tenant")
    limits.add_argument("--max-staged-bytes", type=int, default=None,
                        help="gradient bytes one session may hold received but not yet applied on a shard "
                             "(default: 1/8 of this machine's memory)")
    limits.add_argument("--max-open-streams", type=int, default=4096,
                        help="PushPull calls a shard holds open (past it, calls end after their step: the "
                             "client reopens)")
    limits.add_argument("--max-streams-per-tenant", type=int, default=4096,
                        help="PushPull calls one tenant may hold open on a shard")


def _add_durability_options(serve: argparse.ArgumentParser) -> None:
    """Checkpoints and step logs (:class:`~optserve.server.domain.durability.DurabilityConfig`)."""
    durable = serve.add_argument_group("durability (sessions survive process crashes and restarts)")
    durable.add_argument("--checkpoint-dir", default=None,
                         help="folder for checkpoints and step logs: turns durability on (a restart with the same "
                              "folder restores every session)")
    durable.add_argument("--checkpoint-every-steps", type=int, default=1000, help="a checkpoint every N steps")
    durable.add_argument("--checkpoint-every-s", type=float, default=300.0,
                         help="... or every S seconds (whichever comes first)")
    durable.add_argument("--max-log-bytes", type=int, default=None,
                         help="... or when a session's step log would exceed this many bytes (default: about the "
                              "session's parameter + optimizer state bytes, at least 256 MiB)")
    durable.add_argument("--fsync", choices=["step", "every-n", "checkpoint"], default="checkpoint",
                         help="when the step log is flushed to disk: every step, every N steps "
                              "(--fsync-every-steps), or at checkpoints (default); bounds what a machine loss loses")
    durable.add_argument("--fsync-every-steps", type=int, default=100, help="N of --fsync every-n")
    durable.add_argument("--log-io", choices=["auto", "buffered", "direct"], default="auto",
                         help="how the step log writes gradients: with direct I/O from the gradient's memory "
                              "where the filesystem takes it (auto, the default: no copy on the shard's CPU), "
                              "always so (direct: every logged byte crosses the disk, for fast local disks), or "
                              "through the page cache (buffered: for network volumes)")
    durable.add_argument("--write-ahead", action="store_true",
                         help="write each step's log record before its update runs, so a step whose write fails "
                              "(EIO) is applied nowhere on its shard; costs the write's time on every step (by "
                              "default the record is written while the update runs)")
    durable.add_argument("--checkpoint-copy-max-bytes", type=int, default=1 << 30,
                         help="a shard's part of a session up to this many bytes (parameters + optimizer state) is "
                              "copied for a checkpoint so its steps go on while it is written; a larger part is "
                              "written in place while its steps wait, with no copy (default 1 GiB; 0: never copy)")


SERVER_EXTRA = "pip install -e '.[server]'"  # what a client-only install lacks to serve


def _not_installed(exc: ImportError) -> str:
    """The one line ``optserve serve`` prints when the server's dependencies cannot be imported."""
    return f"optserve serve: the server is not installed ({SERVER_EXTRA}): {exc}"


def _quiet_grpc() -> None:
    """gRPC's C core logs nothing (it reads GRPC_VERBOSITY once, when grpc is first imported, so
    this runs before that; a GRPC_VERBOSITY already in the environment wins). Inherited by a local
    Ray's processes, the shard actors included."""
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")


@contextlib.contextmanager
def _quiet_start():
    """While the server starts: Ray's Python log records below ERROR (its token-authentication
    notice, ...) are dropped, and what is printed through ``sys.stdout`` / ``sys.stderr`` (the
    actors' output Ray forwards, warnings) is held, then printed if the start succeeds and dropped
    if it fails (the failure is then one line). optserve's own log handler writes to the real
    stderr throughout."""
    import ray  # noqa: F401 - importing ray sets its logger up (and its level), so import it first

    if not faulthandler.is_enabled():  # what ray.init does, which it cannot with sys.stderr held
        faulthandler.enable(all_threads=False)
    logger = logging.getLogger("ray")
    level = logger.level
    logger.setLevel(logging.ERROR)
    real = sys.stdout, sys.stderr
    held = io.StringIO(), io.StringIO()
    sys.stdout, sys.stderr = held
    started = False
    try:
        yield
        started = True
    finally:
        sys.stdout, sys.stderr = real
        logger.setLevel(level)
        if started:
            for stream, text in zip(real, (h.getvalue() for h in held)):
                stream.write(text)
                stream.flush()


def serve(args: argparse.Namespace) -> int:
    """Runs the server until SIGINT / SIGTERM; returns the exit status. A missing server install, a
    bad flag value or a failed start (port in use, Ray unreachable, resources Ray lacks, a
    checkpoint folder another server holds) is one line on stderr and status 2, and unless
    ``--verbose`` nothing else is printed: the ports, the folder and the Ray cluster are checked
    in a few seconds at most, before Ray starts. SIGUSR1 prints every thread's stack on stderr
    (a server that hangs, starting or serving, tells where)."""
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    if not args.verbose:
        _quiet_grpc()
    try:  # the whole server: gRPC and its health and reflection services, then Ray and JAX as it starts
        from optserve.server.app import start_server
    except ImportError as exc:
        print(_not_installed(exc), file=sys.stderr)
        return 2
    try:
        config = _server_config(args)
        configure_logging(config.log_level)
        with contextlib.nullcontext() if args.verbose else _quiet_start():
            running = start_server(config)
    except InvalidArgument as exc:
        print(f"optserve serve: {exc}", file=sys.stderr)
        return 2
    except (StartError, DirectoryLocked, DeviceUnusable) as exc:  # the message says it all, in one line
        print(f"optserve serve: could not start: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:  # jax / ray / ... imported lazily while starting
        print(_not_installed(exc), file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - a port in use, Ray unreachable, ...: one line, not a traceback
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        more = "" if args.verbose else " (--verbose shows Ray's and gRPC's own messages)"
        print(f"optserve serve: could not start: {type(exc).__name__}: {detail}{more}", file=sys.stderr)
        return 2
    _announce(running, config)
    _serve_until_signalled(running, config)
    return 0


def _server_config(args: argparse.Namespace) -> ServerConfig:
    """``optserve serve``'s flags as a validated :class:`ServerConfig` (InvalidArgument naming a bad one)."""
    limits = Limits(**{name: getattr(args, name) for name in Limits.FLAGS if getattr(args, name) is not None})
    return ServerConfig(
        host=args.host, port=args.port, shards=args.shards, ray_address=args.ray_address,
        gpus_per_shard=args.gpus_per_shard, shard_host=args.shard_host, precond_workers=args.precond_workers,
        gpus_per_precond_worker=args.gpus_per_precond_worker, precond_f64=args.precond_f64,
        gpu_rehearsal=args.rehearse_gpus,
        min_shard_bytes=args.min_shard_bytes, tls_cert=args.tls_cert, tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca, auth_tokens=args.auth_tokens, insecure=args.insecure,
        metrics_port=args.metrics_port, metrics_host=args.metrics_host, drain_s=args.drain_s,
        health_port=args.health_port, staged_push_ttl_s=args.staged_push_ttl_s, limits=limits,
        session_idle_s=args.session_idle_s, log_level=args.log_level, replicas=args.replicas,
        replica_silence_s=args.replica_silence_s, on_one_replica=args.on_one_replica,
        durability=None if args.checkpoint_dir is None else DurabilityConfig(
            args.checkpoint_dir, every_steps=args.checkpoint_every_steps, every_s=args.checkpoint_every_s,
            max_log_bytes=args.max_log_bytes, fsync=FsyncPolicy(args.fsync),
            fsync_every_steps=args.fsync_every_steps, log_io=LogIO(args.log_io),
            write_ahead=args.write_ahead, checkpoint_copy_max_bytes=args.checkpoint_copy_max_bytes),
    )


def _announce(running, config: ServerConfig) -> None:
    """What a started server prints on stdout: its address, its durability, its metrics endpoint."""
    print(f"optserve listening on {running.address}", flush=True)
    if config.durability is None:
        print("optserve: sessions are not durable: a shard process that dies loses the sessions it holds "
              "(they answer DATA_LOSS), and a server restart loses every session (see --checkpoint-dir)", flush=True)
    else:
        print(f"optserve: sessions are durable in {config.durability.checkpoint_dir} (step log fsync: "
              f"{config.durability.fsync.value}, writes: {config.durability.log_io.value}, order: "
              f"{'write-ahead' if config.durability.write_ahead else 'overlapped'})", flush=True)
    if running.metrics_address:
        print(f"optserve metrics at http://{running.metrics_address}/metrics", flush=True)


def _serve_until_signalled(running, config: ServerConfig) -> None:
    """Serves until SIGINT / SIGTERM, then drains for ``--drain-s`` and stops."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    # Serving, SIGUSR1's stacks are printed from Python's handler, run by this thread holding the
    # GIL: the other threads wait at a safe point while their frames are read (faulthandler's own
    # handler, kept while starting, reads them as they run: it crashed a busy server, SIGSEGV in
    # dump_traceback, as in cpython#116008).
    faulthandler.unregister(signal.SIGUSR1)
    signal.signal(signal.SIGUSR1, lambda *_: faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True))
    while not stop.wait(0.5):
        pass
    print("optserve draining", flush=True)
    running.drain()
    time.sleep(config.drain_s)
    print("optserve shutting down", flush=True)
    running.stop()


def _plugin_command(name: str):
    """The ``main(argv) -> int`` registered as ``name`` in the ``optserve.commands`` entry points
    (applications built on optserve, such as the demo), or None."""
    for entry in entry_points(group="optserve.commands", name=name):
        return entry.load()
    return None


def _run_plugin(name: str, command, argv: list[str]) -> int:
    """Runs a plugin command; an ``ImportError`` escaping it (an extra not installed) is one line on
    stderr and status 2 instead of a traceback."""
    try:
        return command(argv) or 0
    except ImportError as exc:
        print(f"optserve {name}: a dependency is not installed: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``optserve``; returns the exit status (2 for a usage or start error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] != "serve" and not argv[0].startswith("-"):
        try:
            command = _plugin_command(argv[0])
        except ImportError as exc:
            print(f"optserve {argv[0]}: not installed: {exc}", file=sys.stderr)
            return 2
        if command is not None:
            return _run_plugin(argv[0], command, argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "checkpoint":
        return verify_checkpoints(args.directory)
    return 2


def verify_checkpoints(directory: str) -> int:
    """``optserve checkpoint verify DIR``: one line per file (its state, its path, what was found)
    and a summary; returns the report's exit status (2: not a checkpoint directory)."""
    try:
        report = verify_directory(directory)
    except ImportError as exc:  # orbax, which reads the checkpoints' arrays: a server extra
        print(f"optserve checkpoint: the server is not installed ({SERVER_EXTRA}): {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, NotADirectoryError) as exc:
        print(f"optserve checkpoint verify: {exc}", file=sys.stderr)
        return 2
    for verdict in report.files:
        print(f"{verdict.state:8} {verdict.path}" + (f"  ({verdict.detail})" if verdict.detail else ""))
    counts = report.counts()
    print(f"{counts['intact']} intact, {counts['torn']} torn, {counts['corrupt']} corrupt")
    return report.exit_status


if __name__ == "__main__":
    sys.exit(main())
