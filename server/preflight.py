"""Checks before a server starts anything: the ports it will listen on, the Ray cluster it will
join. Each failure is a :class:`StartError` whose message is one line naming the flag, the address
and the cause, found in about a second instead of after Ray has started."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Optional

from optserve.server.domain.config import ServerConfig


class StartError(RuntimeError):
    """The server cannot start, found before starting the part that would fail (a port in use, a
    Ray cluster that does not answer). The message is one line naming the flag, the address and
    the cause."""


RAY_PROBE_TIMEOUT_S = 5.0  # how long to wait for a Ray cluster's GCS before declaring it unreachable
_NOT_A_GCS = "not a Ray GCS (the head node's --port, 6379 by default)"


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def check_ports(config: ServerConfig) -> None:
    """Binds every port the server will listen on (``--port``, and ``--health-port`` /
    ``--metrics-port`` when given) on its interface, all at once, then closes them: a port in use,
    an interface this machine lacks or two flags naming one port fail here, before Ray starts.

    The sockets set SO_REUSEADDR as the gRPC and HTTP servers do, so connections a stopped server
    left in TIME_WAIT do not count as in use (a restart on the same port works); anything
    listening there does. Port 0 (a free port) checks only the interface.

    Raises:
      StartError: naming the flag, the address and the cause.
    """
    wanted = [("--port", config.host, config.port)]
    if config.health_port is not None:
        wanted.append(("--health-port", config.host, config.health_port))
    if config.metrics_port is not None:
        wanted.append(("--metrics-port", config.metrics_host, config.metrics_port))
    held: list[socket.socket] = []
    try:
        for flag, host, port in wanted:
            held += _listen_once(flag, host, port)
    finally:
        for sock in held:
            sock.close()


def _listen_once(flag: str, host: str, port: int) -> list[socket.socket]:
    """Listening sockets on every address ``host`` resolves to that could be bound (at least one,
    as gRPC needs one); the caller closes them."""
    bare = host.strip("[]") or None  # "" and None: every interface
    try:
        addresses = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise StartError(f"{flag}: cannot listen on {_host_port(host, port)}: unknown interface "
                         f"({exc.strerror or exc})") from None
    bound: list[socket.socket] = []
    failure: Optional[OSError] = None
    for family, kind, proto, _, sockaddr in addresses:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
            sock.listen(1)  # a listening socket makes a second bind of the port fail, even with SO_REUSEADDR
        except OSError as exc:
            sock.close()
            failure = failure or exc
            continue
        bound.append(sock)
    if not bound:
        reason = (failure.strerror or str(failure)) if failure is not None else "no address to bind"
        raise StartError(f"{flag}: cannot listen on {_host_port(host, port)}: {reason.lower()}")
    return bound


def _ray_target(address: str) -> Optional[tuple[str, str]]:
    """(the GCS address ``ray.init`` would connect to, where it came from), or None when Ray is
    started here or the target is not known in advance."""
    if address == "local":  # ray.init() without an address joins RAY_ADDRESS when it is set
        from_env = os.environ.get("RAY_ADDRESS", "")
        return (from_env, "RAY_ADDRESS") if from_env not in ("", "local", "auto") else None
    if address == "auto":  # RAY_ADDRESS, else the cluster `ray start` recorded on this machine
        try:
            from ray._private.services import canonicalize_bootstrap_address
        except ImportError:  # Ray moved it: ray.init finds (or fails to find) the cluster itself
            return None
        try:
            found = canonicalize_bootstrap_address("auto")
        except ConnectionError as exc:
            raise StartError(f"--ray-address auto: {str(exc).splitlines()[0] if str(exc) else 'no Ray cluster found'}"
                             ) from None
        except Exception:  # noqa: BLE001 - left to ray.init, which reports it itself
            return None
        return (found, "--ray-address auto") if found else None
    return address, "--ray-address"


def probe_ray_address(address: str, timeout_s: float = RAY_PROBE_TIMEOUT_S) -> None:
    """Checks, within ``timeout_s``, that the Ray cluster ``address`` names answers: its host
    resolves, its port accepts a TCP connection, and what listens there answers as a Ray GCS
    (:func:`_not_a_gcs`). ``ray.init`` on an address that does not answer retries for minutes,
    printing Ray's retry messages.

    ``address`` is ``--ray-address``: "local" probes RAY_ADDRESS if set (ray.init joins it),
    "auto" the cluster Ray would find, anything else is HOST:PORT of the GCS, or
    ray://HOST:PORT of a Ray Client server (whose port is only connected to).

    Raises:
      StartError: naming the address and the cause.
    """
    target = _ray_target(address)
    if target is None:
        return
    where, named = target
    client = where.startswith("ray://")  # Ray Client's server, not the GCS: only its port is checked
    host, sep, port_text = where[len("ray://"):].rpartition(":") if client else where.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        if client:  # its default port is Ray's business
            return
        raise StartError(f"{named} {where!r} is not a Ray cluster address: give HOST:PORT of its head node "
                         f"(ray start --head --port), ray://HOST:PORT, 'auto' or 'local'")
    port = int(port_text)
    deadline = time.monotonic() + timeout_s

    def unreachable(cause: str) -> StartError:
        return StartError(f"{named} {where}: the Ray cluster is unreachable: {cause}")

    resolved: dict = {}

    def resolve():
        try:
            resolved["addresses"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            resolved["error"] = exc

    resolving = threading.Thread(target=resolve, name="optserve-ray-probe", daemon=True)  # DNS may hang
    resolving.start()
    resolving.join(timeout_s)
    if "error" in resolved:
        error = resolved["error"]
        raise unreachable(f"cannot resolve host {host!r} ({error.strerror or error})")
    if "addresses" not in resolved:
        raise unreachable(f"cannot resolve host {host!r} within {timeout_s:g} s")
    failure: Optional[str] = None
    for family, kind, proto, _, sockaddr in resolved["addresses"]:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        with socket.socket(family, kind, proto) as sock:
            try:
                sock.settimeout(left)
                sock.connect(sockaddr)
            except OSError as exc:
                failure = None if isinstance(exc, TimeoutError) else (exc.strerror or str(exc)).lower()
                continue
        not_gcs = None if client else _not_a_gcs(_host_port(host, port), deadline)
        if not_gcs is not None:
            raise unreachable(not_gcs)
        return
    raise unreachable(failure or f"no answer within {timeout_s:g} s")


def _not_a_gcs(address: str, deadline: float) -> Optional[str]:
    """Why what listens at ``address`` is not a Ray GCS, or None if it answers as one by
    ``deadline`` (a ``time.monotonic()``), or cannot be asked (Ray's TLS, an unknown Ray release).

    Asks the GCS for its cluster id (what ``ray.init`` asks first), naming the method from the
    installed Ray's own service descriptors; a cluster with token authentication refusing the
    unauthenticated call still proves it is a GCS.
    """
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return None
    import grpc  # here, not at the top: the CLI imports this module before it sets GRPC_VERBOSITY

    try:
        from ray.core.generated import gcs_service_pb2

        method = gcs_service_pb2.DESCRIPTOR.services_by_name["NodeInfoGcsService"].methods_by_name["GetClusterId"]
    except (ImportError, KeyError):
        return None
    with grpc.insecure_channel(address) as channel:  # an empty request message is zero bytes
        ask = channel.unary_unary(f"/{method.containing_service.full_name}/{method.name}")
        try:
            ask(b"", timeout=max(0.5, deadline - time.monotonic()))
        except grpc.RpcError as exc:
            code = exc.code()
            if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                return None
            if code is grpc.StatusCode.DEADLINE_EXCEEDED:
                return f"something listens there, but it did not answer in time: {_NOT_A_GCS}"
            if code is grpc.StatusCode.UNIMPLEMENTED:
                return f"something answers there, but {_NOT_A_GCS}"
            detail = (exc.details() or "").strip().splitlines()
            return f"something listens there, but {_NOT_A_GCS} ({code.name}{': ' + detail[0] if detail else ''})"
    return None
