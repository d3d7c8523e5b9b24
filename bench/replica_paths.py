"""How a step's gradient reaches a hot standby (issue 59): the client fans out to both copies, or
the primary forwards. Measured on the bed, each path in the same run, rounds interleaved.

    .venv/bin/python -m bench.replica_paths --mb 64 --rounds 7 --rate 1gbit

Three hosts on one bridge (:class:`bench.netns.NetBed`): the client (h1), the primary (h2), the
standby (h3). Each host's NIC is shaped to ``--rate`` each way (``tc tbf`` on both ends of its
link; ``none`` leaves the veth unshaped, bound by this machine's CPU). One step's gradient
(``--mb``, sent as a gRPC stream of 1 MiB chunks, the replica stream's order of frame size) goes:

- **one copy**: client -> primary, acknowledged once the primary holds all of it (the baseline);
- **forward** (optserve's path): client -> primary, which relays each chunk to the standby as it
  arrives, acknowledged once the standby holds all of it;
- **fan-out**: client -> primary and client -> standby at once, acknowledged once both hold it.

Printed: the median time to the acknowledgement per path, its ratio to one copy, and the bytes
each host's NIC sent per step (read from ``/proc/net/dev`` in each host around every step). For a
sync step of W workers the bytes follow: with fan-out every worker also sends its gradient to the
standby (W gradients reach it), while the primary forwards the step's mean once (one gradient).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import queue
import statistics
import subprocess
import sys
import time
from typing import Iterator, Optional

CHUNK = 1 << 20
SERVICE = "bench.ReplicaPaths"
PATHS = ("one copy", "forward", "fan-out")
_same = (lambda b: b, lambda b: b)  # raw bytes both ways: no protobuf in the way of the bytes measured


def nic_counters() -> dict:
    """This process's network namespace: eth0's ``{"rx", "tx"}`` bytes so far."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                fields = rest.split()
                return {"rx": int(fields[0]), "tx": int(fields[8])}
    return {"rx": 0, "tx": 0}


def _chunks(total: int) -> Iterator[bytes]:
    block = bytes(CHUNK)
    for start in range(0, total, CHUNK):
        yield block[:min(CHUNK, total - start)]


def serve(port: int, standby: Optional[str]) -> None:
    """A host's end: ``Take`` holds a stream's bytes and answers their count; with ``standby``
    (the primary) a call whose metadata says ``forward`` relays each chunk there as it arrives
    and answers once the standby holds them all. ``Counters`` answers this host's NIC counters."""
    import grpc

    relay = grpc.insecure_channel(standby) if standby else None
    take_there = relay.stream_unary(f"/{SERVICE}/Take", *_same) if relay else None

    def take(chunks, context):
        forward = dict(context.invocation_metadata()).get("forward") == "1"
        if not forward:
            return str(sum(len(c) for c in chunks)).encode()
        pending: queue.SimpleQueue = queue.SimpleQueue()
        answer = concurrent.futures.ThreadPoolExecutor(1).submit(take_there, iter(pending.get, None))
        for chunk in chunks:
            pending.put(chunk)
        pending.put(None)
        return answer.result()  # the standby's count: it holds them all

    handlers = {"Take": grpc.stream_unary_rpc_method_handler(take, *_same),
                "Counters": grpc.unary_unary_rpc_method_handler(
                    lambda _request, _context: json.dumps(nic_counters()).encode(), *_same)}
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(8),
                         options=[("grpc.max_receive_message_length", 2 * CHUNK)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_insecure_port(f"0.0.0.0:{port}")
    server.start()
    print("serving", flush=True)
    server.wait_for_termination()


def drive(primary: str, standby: str, size: int, rounds: int) -> None:
    """The client: ``rounds`` rounds of the three paths (their order turned each round); prints
    one ``RESULT`` line of JSON: seconds and per-host bytes sent, per path."""
    import grpc

    stubs = {}
    for name, address in (("primary", primary), ("standby", standby)):
        channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 2 * CHUNK)])
        stubs[name] = (channel.stream_unary(f"/{SERVICE}/Take", *_same),
                       channel.unary_unary(f"/{SERVICE}/Counters", *_same))
    pool = concurrent.futures.ThreadPoolExecutor(2)

    def step(path: str) -> None:
        if path == "one copy":
            assert int(stubs["primary"][0](_chunks(size))) == size
        elif path == "forward":
            assert int(stubs["primary"][0](_chunks(size), metadata=(("forward", "1"),))) == size
        else:
            both = [pool.submit(stubs[name][0], _chunks(size)) for name in ("primary", "standby")]
            assert [int(f.result()) for f in both] == [size, size]

    def counters() -> dict:
        return {"client": nic_counters(), **{name: json.loads(stubs[name][1](b"")) for name in ("primary", "standby")}}

    for path in PATHS:  # warm: connections up, windows grown
        step(path)
    results = {path: {"seconds": [], "sent": []} for path in PATHS}
    for round_ in range(rounds):
        for path in PATHS[round_ % 3:] + PATHS[:round_ % 3]:
            before = counters()
            began = time.perf_counter()
            step(path)
            results[path]["seconds"].append(time.perf_counter() - began)
            after = counters()
            results[path]["sent"].append({host: after[host]["tx"] - before[host]["tx"] for host in after})
    print("RESULT " + json.dumps(results), flush=True)


def _shape(bed, rate: str) -> None:
    """Each host's NIC at ``rate`` each way: its uplink (eth0 in its namespace) and its downlink
    (its port on the bridge)."""
    for host in bed.hosts.values():
        for ns, dev in ((host.ns, "eth0"), (bed.switch, host.port)):
            subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "512kb",
                            "latency", "100ms"], check=True, capture_output=True)


def report(results: dict, size: int, workers: int) -> str:
    base = statistics.median(results["one copy"]["seconds"])
    lines = [f"{'path':<10} {'median s':>9} {'vs one copy':>12}   MB sent per step: client / primary / standby"]
    for path in PATHS:
        median = statistics.median(results[path]["seconds"])
        sent = {host: statistics.median(s[host] for s in results[path]["sent"]) / 1e6
                for host in ("client", "primary", "standby")}
        lines.append(f"{path:<10} {median:>9.3f} {median / base:>11.2f}x   "
                     f"{sent['client']:.1f} / {sent['primary']:.1f} / {sent['standby']:.1f}")
    gradient = size / 1e6
    lines.append(f"a sync step of {workers} workers ({gradient:.1f} MB each): the standby receives "
                 f"{workers * gradient:.1f} MB with fan-out (each worker's gradient), {gradient:.1f} MB "
                 f"forwarded (the step's mean, once)")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replica_paths", description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=64.0, help="one step's gradient, MB")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--rate", default="1gbit", help="each host's NIC, each way (tc rate), or none")
    parser.add_argument("--workers", type=int, default=4, help="a sync step's workers, for the bytes it implies")
    parser.add_argument("--role", choices=("serve", "drive"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=50061, help=argparse.SUPPRESS)
    parser.add_argument("--primary", help=argparse.SUPPRESS)
    parser.add_argument("--standby", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    size = int(args.mb * 1e6)
    if args.role == "serve":
        serve(args.port, args.standby)
        return 0
    if args.role == "drive":
        drive(args.primary, args.standby, size, args.rounds)
        return 0
    from bench.netns import NetBed

    me = [sys.executable, "-m", "bench.replica_paths"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p))
    with NetBed(("h1", "h2", "h3")) as bed:
        client, primary, standby = (bed.hosts[n] for n in ("h1", "h2", "h3"))
        if args.rate != "none":
            _shape(bed, args.rate)
        at = lambda host: f"{host.address}:{args.port}"  # noqa: E731
        ends = [standby.spawn("standby", me + ["--role", "serve", "--port", str(args.port)], env),
                primary.spawn("primary", me + ["--role", "serve", "--port", str(args.port), "--standby", at(standby)],
                              env)]
        for end in ends:
            end.wait_for("serving", timeout_s=60)
        run = client.spawn("client", me + ["--role", "drive", "--primary", at(primary), "--standby", at(standby),
                                            "--mb", str(args.mb), "--rounds", str(args.rounds)], env)
        line = run.wait_for("RESULT", timeout_s=1800)
        results = json.loads(line.split(" ", 1)[1])
    print(f"replica paths: {args.mb:.0f} MB per step, NICs at {args.rate} each way, {args.rounds} rounds interleaved")
    print(report(results, size, args.workers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
