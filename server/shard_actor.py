"""Process host of a shard: the Ray actor that serves ShardData, and the coordinator's handle on
all of them (:class:`RayShardFleet`).

A composition root: it builds each session's compute side (optimizer, updater, roots), its
domain side (the shard session and its clock) and serves them on the wire (data plane and clock
endpoint). The coordinator reaches the actors over Ray; clients reach them over gRPC.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from concurrent import futures
from typing import Optional, Sequence

import grpc
import numpy as np
import ray
from ray.exceptions import RayActorError
from ray.util import get_placement_group
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from optserve.protos import contract
from optserve.protos.heap import keep_large_buffers_on_heap, release_free_memory
from optserve.server.compute.buffers import aligned_empty
from optserve.server.compute.preconditioner_pool import check_gpus
from optserve.server.compute.updater import compile_stats, Updater
from optserve.server.domain.clock import LocalClock
from optserve.server.domain.config import ServerConfig
from optserve.server.domain.coordinator import ShardOpening, ShardSummary
from optserve.server.domain.errors import unwrap, InvalidArgument, OptservError, SessionLost, Unavailable
from optserve.server.domain.refusals import log_value
from optserve.server.domain.shard_session import ShardRegistry, ShardSession, ShardSessionStatus, StepObserver
from optserve.server.ops.health import Health
from optserve.server.ops.logs import configure_logging
from optserve.server.ops.metrics import resident_bytes, session_gauges, ShardMetrics
from optserve.server.storage import CorruptCheckpoint, ShardStore, StepLogReader
from optserve.server.wire.clock_service import ClockServer, PeerClock
from optserve.server.wire.limits import server_options
from optserve.server.wire.shard_servicer import add_to_server

log = logging.getLogger(__name__)


class ShardActor:
    """One shard: holds per-session state and serves its data plane (wrap with ``ray.remote``).

    Args:
      index: shard index (0-based).
      config: the server's configuration (bind host, threads, timeouts).
      security: the server's :class:`~optserve.server.wire.security.ServerSecurity` (TLS, tokens,
        internal secret).
      precond_pool: the server's :class:`~optserve.server.compute.preconditioner_pool.PreconditionerPool`
        (``None``: no preconditioner workers).
      ports: ``(data, clock)`` ports to bind if free (a restarted shard takes its predecessor's, so
        clients and peers find it where it was); 0 or a taken port: any free one.
      recovering: durable servers: sessions are being restored onto this shard; until
        :meth:`recovered`, a call naming a session it does not hold yet is UNAVAILABLE (retry), not
        NOT_FOUND.
    """

    def __init__(self, index: int, config: ServerConfig, security, precond_pool=None, ports: tuple = (0, 0),
                 recovering: bool = False):


        keep_large_buffers_on_heap()  # received chunks and each step's tensor-sized buffers reuse freed memory
        if config.log_level is not None:

            configure_logging(config.log_level)
        self._index = index
        self._config = config
        self._precond_pool = precond_pool.for_shard(index) if precond_pool is not None else None
        self._registry = ShardRegistry(recovering=recovering)
        self._security = security
        self._metrics = ShardMetrics(index, lambda: session_gauges(self._registry.sessions(), str(index)))
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.grpc_threads),
                                   options=contract.SERVER_OPTIONS + server_options(config.limits),
                                   interceptors=security.interceptors(open_services=Health.OPEN_SERVICES))
        self._health = Health(self._server, ("optserve.v1.ShardData",))
        # half the threads at most for open PushPull streams, the rest for everything else
        self._data = add_to_server(self._registry, self._server, max_open_streams=max(1, config.grpc_threads // 2),
                                   tokens=security.tokens,
                                   max_streams_per_tenant=config.limits.max_streams_per_tenant)
        host = config.data_host
        port = _bind(lambda p: security.add_port(self._server, f"{host}:{p}"), ports[0])
        self._server.start()
        advertised = ray.util.get_node_ip_address() if host in ("0.0.0.0", "::", "[::]", "") else host
        self._address = f"{advertised}:{port}"
        # clocks of the sessions this shard is home to
        self._clocks = ClockServer(host, advertised, security.internal, port=ports[1])
        self._node_id = ray.get_runtime_context().get_node_id()
        self._health.serving()

    def address(self) -> str:
        return self._address

    def clock_address(self) -> str:
        """Where the other shards of the sessions this shard is home to reach their clocks."""
        return self._clocks.address

    def reachable(self, opening: ShardOpening) -> tuple[int, int, str]:
        """Durable servers: how far this shard's part of a session can be restored, read from disk
        without loading it: ``(checkpoint version, last logged version, checkpoint path)`` (a
        session this shard still holds in memory: its version, twice).

        Raises:
          SessionLost: a damaged manifest or log record (the message names the file).
        """

        config = opening.config
        held = self._registry.find(config.name)
        if held is not None:
            return held.version, held.version, ""
        by_name = config.spec_by_name
        durability = self._config.durability
        store = ShardStore(durability.checkpoint_dir, config.name, opening.shard_index, durability, False)
        try:
            reach = store.reachable(lambda: {n: aligned_empty(by_name[n].shape, np.float32)
                                             for n in opening.tensor_names})
        except CorruptCheckpoint as exc:
            raise SessionLost(f"session {config.name!r} cannot be restored on shard {opening.shard_index}: "
                              f"{exc}") from None
        finally:
            store.close()
        return tuple(reach)

    def open_session(self, opening: ShardOpening, restore: bool = False, upto: Optional[int] = None) -> int:
        """Holds ``opening.tensor_names`` of a session: builds its optimizer (once), updater,
        clock (home shard) or clock handle (others), and registers it on the data plane.

        Durable servers keep the session's step log and checkpoints; with ``restore`` the shard
        first loads its latest checkpoint and replays its log (a restarted shard or server), up to
        version ``upto`` (None: all of it).
        Returns the session's version on this shard.

        A new session's optimizer is checked first: its per-tensor options (``{tensor name: value}``
        maps such as adamw's ``mask``) are restricted to this shard's tensors, and its ``init`` is
        traced abstractly over them (``Updater.init_problem``), so a state the kernel cannot build
        is refused before this shard holds anything of the session.

        Raises:
          SessionLost: ``restore`` found a damaged checkpoint or log (the message names the file).
          InvalidArgument: a per-tensor option that does not name exactly the session's tensors, or
            an optimizer that cannot build its state for this shard's tensors (the message names
            the session, the optimizer, the tensors and the kernel's error, on one line).
        """
        from optserve.optim_kernels import args_for_tensors
        from optserve.server.compute.root_offload import build_shard_optimizer

        config = opening.config
        held = self._registry.find(config.name)
        if restore and held is not None:  # a re-attached shard kept it in memory
            return held.version
        by_name = config.spec_by_name
        durability = self._config.durability
        home = opening.home_clock is None
        try:  # per-tensor options ({tensor name: value}, e.g. adamw's mask) restricted to this shard's tensors
            args = args_for_tensors(config.optimizer_name, config.optimizer_args, [t.name for t in config.tensors],
                                    opening.tensor_names)
        except ValueError as exc:
            raise InvalidArgument(f"session {config.name!r}: {exc}") from None
        optimizer, preconditioners = build_shard_optimizer(
            config.optimizer_name, args, {n: by_name[n].shape for n in opening.tensor_names},
            self._precond_pool, in_process=config.preconditioners.in_process,
            max_age=config.preconditioners.max_age)
        specs = {n: (by_name[n].shape, by_name[n].dtype.numpy) for n in opening.tensor_names}
        updater = Updater(optimizer, preconditioners, specs)
        if not restore:  # a state the kernel cannot build is refused before this shard holds anything
            problem = updater.init_problem()
            if problem is not None:
                log.info("event=session_refused session=%s shard=%d reason=%s", log_value(config.name),
                         opening.shard_index, log_value(problem))
                raise InvalidArgument(f"session {config.name!r}: {problem}")
        store = None
        if durability is not None:
            store = ShardStore(durability.checkpoint_dir, config.name, opening.shard_index, durability, home)
        if home:
            clock = LocalClock(config, opening.participants, reduce_timeout_s=self._config.step_timeout_s,
                               checkpoints=durability.policy(config.gradient_bytes) if durability else None,
                               journal=store.journal_entry if store else None)
        else:
            clock = PeerClock(opening.home_clock, config.name, self._security.internal,
                              reduce_timeout_s=self._config.step_timeout_s)
        session = ShardSession(config, list(opening.tensor_names), opening.shard_index, clock,
                               updater, self._config.step_timeout_s,
                               self._config.vote_timeout_s, owner=opening.owner, creator=opening.creator,
                               observer=self._observer(config.name),
                               staged_push_ttl_s=self._config.staged_push_ttl_s, limits=self._config.limits)
        if store is not None:
            try:
                if restore:
                    session.restore(store, StepLogReader, store.journal, upto=upto)
                else:
                    store.start_logs(None)
                    session.attach_store(store)
            except CorruptCheckpoint as exc:
                store.close()
                raise SessionLost(f"session {config.name!r} cannot be restored on shard {opening.shard_index}: "
                                  f"{exc}") from None
        if home and opening.participants > 1:
            self._clocks.add(config.name, clock)
        self._registry.add(session)
        if restore:
            log.warning("event=session_restored session=%s shard=%d version=%d", config.name, opening.shard_index,
                        session.version)
        return session.version

    def recovered(self) -> None:
        """Every session this shard should hold is restored (see ``recovering``)."""
        self._registry.recovering = False

    def peer_up(self, shard_index: int, names: Sequence[str]) -> None:
        """Shard ``shard_index`` serves those sessions again (see :meth:`peer_down`)."""
        for session in self._sessions_named(names):
            peer_up = getattr(session.clock, "peer_up", None)
            if peer_up is not None:
                peer_up(shard_index)

    def _sessions_named(self, names: Sequence[str]) -> list:
        return [s for s in map(self._registry.find, names) if s is not None]

    def checkpoint_session(self, name: str) -> bool:
        """A checkpoint of the session's part here if it has steps since its last one, written
        before this returns (the session is about to be unloaded)."""
        session = self._registry.find(name)
        return bool(session is not None and session.checkpoint_now())

    def checkpoint_all(self) -> int:
        """Durable servers, at shutdown: a checkpoint of every session with steps since its last
        one, written before this returns; returns how many were written."""
        return sum(bool(session.checkpoint_now()) for session in self._registry.sessions())

    def peer_down(self, shard_index: int, names: Sequence[str]) -> None:
        """Shard ``shard_index`` died and is being restarted: the votes this shard's clocks hold
        for those sessions end now (UNAVAILABLE: the client retries) instead of at their timeout."""

        for session in self._sessions_named(names):
            peer_down = getattr(session.clock, "peer_down", None)
            if peer_down is not None:
                peer_down(shard_index, Unavailable(f"session {session.config.name!r}: shard {shard_index} is "
                                                   f"restarting; nothing was applied, retry"))

    def set_home_clock(self, name: str, address: str) -> None:
        """The session's home shard restarted at another clock address: peers call it there."""

        session = self._registry.find(name)
        if session is not None and isinstance(session.clock, PeerClock):
            session.clock.repoint(address)

    def close_session(self, name: str, reason: str = "") -> bool:
        """Drops the session's part on this shard; with a ``reason`` (the session was lost), calls
        still waiting in it fail with SessionLost(``reason``) instead of waiting out their timeouts."""

        session = self._registry.find(name)
        if session is not None and reason:
            session.abandon(SessionLost(reason))
        self._clocks.remove(name)
        if session is not None:
            session.close_store()
        removed = self._registry.remove(name)
        self._data.regions.reap()  # its shared-memory regions go now, not at the reaper's next sweep
        self._metrics.forget(name)
        if removed:  # its buffers are free: give their pages back now (the heap would keep up to 1 GiB of them)
            release_free_memory()
        return removed

    def internal_trust(self):
        """The internal endpoints' secret and TLS identity this shard was started with (a
        re-attaching coordinator gives the same to the shards it starts)."""
        return self._security.internal

    def compile_stats(self) -> dict:
        """This process's XLA compilations and shared compiled updates
        (:func:`~optserve.server.compute.updater.compile_stats`)."""

        return compile_stats()

    def pid(self) -> int:
        """The shard's process id (operators and fault tests kill it)."""

        return os.getpid()

    def _observer(self, session: str):
        """The session's metrics observer; a no-op one when the server exports no metrics."""

        return self._metrics.observer(session) if self._config.metrics_port is not None else StepObserver()

    def session_series(self, name: str):
        """The series the session's home shard keeps: ``(accepted, refused, rounds)`` records
        (rounds: an elastic session's ``RoundRecord`` per version, else empty)."""
        session = self._registry.get(name)
        accepted, refused = session.series.snapshot() if session.series is not None else ([], [])
        rounds = session.history(0) if session.config.is_elastic and session.series is not None else []
        return accepted, refused, rounds

    def session_activity(self) -> dict:
        """Session name -> its last activity on this shard (unix seconds)."""
        return self._registry.activity()

    def metrics(self) -> list:
        """This shard's metric families (prometheus ``Metric`` objects), read now."""
        return self._metrics.collect()

    def server_status(self) -> dict:
        """``{"node_id", "sessions", "param_bytes", "resident_bytes"}`` of this shard, now."""

        sessions = self._registry.sessions()
        return {"node_id": self._node_id, "sessions": len(sessions),
                "param_bytes": sum(s.updater.param_bytes() for s in sessions), "resident_bytes": resident_bytes()}

    def session_status(self, name: str) -> ShardSessionStatus:
        return dataclasses.replace(self._registry.get(name).status(), node_id=self._node_id)

    def drain(self) -> None:
        """Health says NOT_SERVING (load balancers and probes stop sending new work)."""
        self._health.draining()

    def stop(self) -> None:
        self._health.draining()
        self._server.stop(grace=0.5).wait()
        self._clocks.stop()


class RayShardFleet:
    """The coordinator's :class:`~optserve.server.domain.coordinator.ShardFleet` over Ray actors.

    Args:
      actors: shard actor handles, index = position.
    """

    placement_group = None  # set by start_shards: the Ray placement group the actors run in
    reattached: list = []  # set by start_shards: shards a previous coordinator left running

    def __init__(self, actors: list, start_actor=None):

        self.actors = actors
        self.addresses = ray.get([a.address.remote() for a in actors])
        self.clock_addresses = ray.get([a.clock_address.remote() for a in actors])
        self._start_actor = start_actor  # index -> a new actor for that shard (see restart)

    def dead_shards(self, timeout_s: float = 5.0) -> list[int]:
        """Indices of the shards whose actor died (a shard that is only slow to answer is alive)."""

        refs = [actor.pid.remote() for actor in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        done, dead = set(ready), []
        for index, ref in enumerate(refs):
            if ref in done:
                try:
                    ray.get(ref)
                except RayActorError:
                    dead.append(index)
        return dead

    def restart(self, index: int, recovering: bool = False) -> str:
        """Replaces shard ``index``'s (dead) actor by a new one in the same placement bundle, on
        its predecessor's ports if they are free; returns its data-plane address. The shard's
        sessions are not restored here (see ``Coordinator.shard_restarted``)."""

        if self._start_actor is None:
            raise RuntimeError("this fleet cannot start shard actors")
        ray.kill(self.actors[index])
        ports = (_port(self.addresses[index]), _port(self.clock_addresses[index]))
        actor = self._start_actor(index, ports, recovering)
        address, clock_address = ray.get([actor.address.remote(), actor.clock_address.remote()])
        self.actors[index] = actor
        self.addresses[index], self.clock_addresses[index] = address, clock_address
        return address

    def unload_session(self, name: str) -> None:
        """A final checkpoint of the session on every shard, then they free it (durable servers)."""
        _ray_get([a.checkpoint_session.remote(name) for a in self.actors])
        self.close_session(name)

    def restore_session(self, opening: ShardOpening, upto: Optional[int] = None) -> int:
        return _ray_get(self.actors[opening.shard_index].open_session.remote(opening, True, upto))

    def reachable(self, opening: ShardOpening) -> tuple[int, int, str]:
        return _ray_get(self.actors[opening.shard_index].reachable.remote(opening))

    def peer_down(self, home_index: int, shard_index: int, names: Sequence[str]) -> None:
        _tell(self.actors[home_index].peer_down.remote(shard_index, list(names)))

    def peer_up(self, home_index: int, shard_index: int, names: Sequence[str]) -> None:
        _tell(self.actors[home_index].peer_up.remote(shard_index, list(names)))

    def set_home_clock(self, shard_index: int, name: str, address: str) -> None:
        _tell(self.actors[shard_index].set_home_clock.remote(name, address))

    def recovered(self, shard_index: int) -> None:
        _ray_get(self.actors[shard_index].recovered.remote())

    def checkpoint_all(self, timeout_s: float = 600.0) -> int:
        """A final checkpoint of every durable session with new steps (server shutdown)."""
        return sum(r or 0 for r in self.shard_reports("checkpoint_all", timeout_s=timeout_s))

    def pids(self) -> list[int]:
        """Each shard's process id (by index)."""
        return _ray_get([actor.pid.remote() for actor in self.actors])

    def open_session(self, openings: Sequence[ShardOpening]) -> None:
        """Opens the session on every shard of ``openings`` at once and returns once each answered,
        also when one refused (so a close that follows a refusal finds every part a shard opened).

        Raises:
          the first shard's error (in ``openings`` order); when several refused with
          InvalidArgument (e.g. each holds a tensor the optimizer cannot build a state for), one
          InvalidArgument with their distinct messages (the first three).
        """
        refs = [self.actors[o.shard_index].open_session.remote(o) for o in openings]
        errors = []
        for ref in refs:
            try:
                _ray_get(ref)
            except Exception as exc:  # noqa: BLE001 - raised below, once every shard answered
                errors.append(exc)
        if not errors:
            return
        if len(errors) > 1 and all(isinstance(e, InvalidArgument) for e in errors):
            messages = list(dict.fromkeys(str(e) for e in errors))
            more = f" (and {len(messages) - 3} more shards refused likewise)" if len(messages) > 3 else ""
            raise InvalidArgument("; ".join(messages[:3]) + more)
        raise errors[0]

    def close_session(self, name: str, reason: str = "") -> None:
        """On every shard that answers; a dead shard holds nothing any more."""
        for ref in [a.close_session.remote(name, reason) for a in self.actors]:
            _tell(ref)

    def session_status(self, name: str, shard_indices: Sequence[int]) -> list[ShardSessionStatus]:
        return _ray_get([self.actors[i].session_status.remote(name) for i in shard_indices])

    def session_series(self, name: str, shard_index: int):
        return _ray_get(self.actors[shard_index].session_series.remote(name))

    def session_activity(self) -> dict[str, float]:
        """Session -> its latest activity on the shards that answer within 5 s (unix seconds)."""
        latest: dict[str, float] = {}
        for report in self.shard_reports("session_activity", timeout_s=5.0):
            for name, when in (report or {}).items():
                latest[name] = max(when, latest.get(name, 0.0))
        return latest

    def shard_summaries(self) -> list[ShardSummary]:
        reports = self.shard_reports("server_status", timeout_s=5.0)
        return [ShardSummary(i, self.addresses[i], healthy=False) if r is None else
                ShardSummary(i, self.addresses[i], r["node_id"], r["sessions"], r["param_bytes"], r["resident_bytes"],
                             healthy=True)
                for i, r in enumerate(reports)]

    def shard_reports(self, method: str, timeout_s: float = 10.0) -> list:
        """``actor.<method>()`` of every shard, or None for a shard that did not answer in time."""

        refs = [getattr(actor, method).remote() for actor in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        done = set(ready)
        out = []
        for ref in refs:
            try:
                out.append(ray.get(ref) if ref in done else None)
            except Exception:  # noqa: BLE001 - a dead shard reports as unhealthy
                out.append(None)
        return out


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _bind(add_port, port: int) -> int:
    """``add_port(port)`` (a gRPC server's), falling back to any free port if ``port`` is taken."""
    if port:
        try:
            return add_port(port)
        except RuntimeError:
            log.warning("port %d is taken: the restarted shard listens on another one", port)
    return add_port(0)


def _tell(ref) -> None:
    """Waits for a notice to a shard; a shard that died meanwhile misses it (it holds nothing any
    more: a durable one restores its sessions when it is restarted, and hears of its peers then)."""

    try:
        ray.get(ref)
    except RayActorError:
        pass
    except Exception as exc:  # re-raise the domain error inside a RayTaskError
        raise _domain_error(exc) from None


def _domain_error(exc: BaseException) -> BaseException:
    """The domain error a shard raised, as it raised it, from what ``ray.get`` raised: Ray hands
    back a ``RayTaskError(<the error's class>)`` whose text is the remote traceback; its
    ``cause`` is the error itself, whose message is what a client reads."""
    exc = unwrap(exc)
    cause = getattr(exc, "cause", None)
    if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(cause, OptservError):
        return cause
    return exc


def _ray_get(refs):
    """``ray.get(refs)``, with what Ray raises turned into what the layers below speak: the domain
    error inside a task's error, and a dead or restarting shard actor as Unavailable (the client
    retries)."""

    try:
        return ray.get(refs)
    except ray.exceptions.RayActorError as exc:  # ActorDiedError, ActorUnavailableError: a shard restarting
        raise Unavailable(f"a shard of this server is restarting ({type(exc).__name__}); retry") from None
    except Exception as exc:  # re-raise the domain error inside a RayTaskError
        raise _domain_error(exc) from None


BUNDLE_CPUS = 0.01  # what each shard's bundle reserves: enough to be placed, nothing a task misses
PLACEMENT_TIMEOUT_S = 300.0  # longest wait for Ray to reserve the bundles (an autoscaler may add nodes)


def shard_bundles(config: ServerConfig) -> list[dict[str, float]]:
    """One placement-group bundle per shard: a token CPU amount, and the shard's GPUs."""
    bundle = {"CPU": BUNDLE_CPUS}
    if config.gpus_per_shard > 0:
        bundle["GPU"] = config.gpus_per_shard
    return [dict(bundle) for _ in range(config.shards)]


def _spread_placement_group(config: ServerConfig, timeout_s: float = PLACEMENT_TIMEOUT_S, **group_options):
    """A SPREAD placement group for the shards, reserved: one bundle per shard, on as many nodes
    as the cluster has (SPREAD is soft, so one node holds them all when there is one).

    Fails fast, before asking Ray, when the embedded Ray lacks the GPUs the bundles need; on a
    cluster joined by address (an autoscaler may add nodes) it waits up to ``timeout_s``
    (:func:`~optserve.server.compute.preconditioner_pool.check_gpus`).

    Raises:
      RuntimeError: the embedded Ray has too few GPUs (at once), or Ray could not reserve the
        bundles within ``timeout_s`` (the group is removed).
    """



    check_gpus("--gpus-per-shard", config.gpus_per_shard, config.shards, "shards")
    bundles = shard_bundles(config)
    group = placement_group(bundles, strategy="SPREAD", **group_options)
    ready = group.ready()
    deadline = time.monotonic() + timeout_s
    while True:
        done, _ = ray.wait([ready], timeout=min(30.0, max(0.0, deadline - time.monotonic())))
        if done:
            return group
        if time.monotonic() >= deadline:
            remove_placement_group(group)
            raise RuntimeError(f"Ray could not place {len(bundles)} shards (a bundle of {bundles[0]} each) "
                               f"within {timeout_s:.0f} s: the cluster's nodes lack the resources")
        log.warning("waiting for Ray to place %d shards (a bundle of %s each)", len(bundles), bundles[0])


DETACHED_NAMESPACE = "optserve"  # where a durable server on a cluster names its detached shard actors


def detached_names(config: ServerConfig) -> tuple[str, list[str]]:
    """A durable server's placement group and shard actor names on a Ray cluster: derived from its
    checkpoint folder, the durable identity a restarted coordinator finds them by."""
    prefix = detached_prefix(config)
    return f"{prefix}-shards", [f"{prefix}-shard-{i}" for i in range(config.shards)]


def detached_prefix(config: ServerConfig) -> str:
    """The name prefix of a durable server's detached actors on a cluster (see :func:`detached_names`)."""

    return "optserve-" + hashlib.sha1(os.path.abspath(config.durability.checkpoint_dir).encode()).hexdigest()[:12]


def _find_detached(group_name: str, actor_names: list[str]):
    """The placement group and the live shard actors a previous coordinator left (None for an
    actor that is gone), or None when there is no such group."""

    try:
        group = get_placement_group(group_name)
    except ValueError:
        return None
    actors = []
    for name in actor_names:
        try:
            actor = ray.get_actor(name, namespace=DETACHED_NAMESPACE)
            ray.get(actor.pid.remote(), timeout=30)
            actors.append(actor)
        except Exception:  # noqa: BLE001 - gone, dead or not answering: started anew
            actors.append(None)
    return group, actors


def start_shards(config: ServerConfig, security, precond_pool=None) -> RayShardFleet:
    """Starts ``config.shards`` shard actors (actor options in one place); returns once all serve.

    The shards are spread over the Ray cluster's nodes: a placement group with the SPREAD strategy
    reserves one small bundle per shard (:func:`shard_bundles`), and shard ``i`` runs in bundle
    ``i``. On one node every bundle lands there. The returned fleet's ``placement_group`` must be
    removed (``ray.util.remove_placement_group``) once its actors are stopped; removing it also
    kills any actor still in it.

    A durable server on a Ray cluster (``--ray-address`` and ``--checkpoint-dir``) names its
    placement group and actors, detached from the coordinator (:func:`detached_names`): they
    outlive a coordinator that crashes, and the next coordinator with the same checkpoint folder
    re-attaches to them (``fleet.reattached`` lists the shards it found alive, which keep their
    sessions in memory and their security; the others are started anew and restore theirs).
    """


    detached = config.durability is not None and config.ray_address != "local"
    group_name, actor_names = detached_names(config) if detached else (None, None)
    found = _find_detached(group_name, actor_names) if detached else None
    if found is not None:
        group, alive = found
        live = [a for a in alive if a is not None]
        if live:  # new actors must trust the survivors' internal endpoints
            security = dataclasses.replace(security, internal=ray.get(live[0].internal_trust.remote()))
    else:
        group = _spread_placement_group(config, **({"name": group_name, "lifetime": "detached"} if detached else {}))
        alive = [None] * config.shards
    options = {"num_cpus": 0, "max_concurrency": 16}
    if config.gpus_per_shard > 0:  # the actor's JAX then sees (only) the GPUs Ray assigned it
        options["num_gpus"] = config.gpus_per_shard
    cls = ray.remote(ShardActor)

    def start_actor(index: int, ports: tuple = (0, 0), recovering: bool = False):
        named = {"name": actor_names[index], "namespace": DETACHED_NAMESPACE, "lifetime": "detached"} if detached else {}
        for attempt in range(50):  # a dead detached actor's name is freed shortly after its death
            try:
                return cls.options(**options, **named, scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=index)).remote(index, config, security, precond_pool, ports,
                                                                       recovering)
            except ValueError:
                if not named or attempt == 49:
                    raise

                time.sleep(0.2)

    recovering = config.durability is not None  # sessions of the catalog are restored before clients come
    try:
        fleet = RayShardFleet([a if a is not None else start_actor(i, recovering=recovering)
                               for i, a in enumerate(alive)], start_actor)
    except BaseException:
        remove_placement_group(group)  # and with it the actors already started
        raise
    fleet.placement_group = group
    fleet.reattached = [i for i, a in enumerate(alive) if a is not None]
    if fleet.reattached:
        log.warning("event=shards_reattached shards=%s", ",".join(map(str, fleet.reattached)))
    return fleet
