"""The coordinator's handle on the shard actors: :class:`RayShardFleet` (the coordinator's
:class:`~optserve.server.domain.sessions.coordinator.ShardFleet` over Ray), and :func:`start_shards`,
which starts them: one SPREAD placement group with a bundle per shard, actor options in one
place, and, for a durable server on a Ray cluster, detached names a restarted coordinator finds
them by (:func:`detached_names`).

What Ray raises is turned here into what the domain speaks (:func:`_ray_get`): the domain error a
shard raised, and a dead or restarting shard actor as Unavailable.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading
import time
from typing import Optional, Sequence

import ray
from ray.exceptions import OutOfMemoryError, RayActorError, WorkerCrashedError
from ray.util import get_placement_group
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from optserve.server.compute.devices import refuse_problems
from optserve.server.domain.config import ServerConfig
from optserve.server.domain.errors import unwrap, InvalidArgument, OptservError, ResourceExhausted, Unavailable
from optserve.server.domain.sessions import ShardOpening, ShardSummary
from optserve.server.domain.shard import ShardSessionStatus
from optserve.server.ops.memory_trace import environment as tracing_environment
from optserve.server.preflight import StartError
from optserve.server.shard_actor import ShardActor, shard_device_request
from optserve.server.shard_placement import bundle_node_ips, shard_host_refusal, spread_placement_group, start_standbys
from optserve.server.standby_fleet import StandbyActors
from optserve.server.storage.ownership import claim_shard

log = logging.getLogger(__name__)

# What a call to an actor raises once its process is gone: it died (RayActorError: ActorDiedError,
# ActorUnavailableError while Ray restarts it), Ray's memory monitor killed it (OutOfMemoryError,
# raised by every later call too), or it crashed mid-call (WorkerCrashedError).
ACTOR_GONE = (RayActorError, OutOfMemoryError, WorkerCrashedError)


class RayShardFleet:
    """The coordinator's :class:`~optserve.server.domain.sessions.coordinator.ShardFleet` over Ray actors.

    Args:
      actors: shard actor handles, index = position.
    """
    placement_group = None  # set by start_shards: the Ray placement group the actors run in
    reattached: list = []  # set by start_shards: shards a previous coordinator left running
    standbys: Optional[StandbyActors] = None  # set by start_shards with --replicas 2

    def __init__(self, actors: list, start_actor=None):
        self.actors = actors
        self.devices = usable_devices([a.device_report.remote() for a in actors])  # DeviceReport by index
        self.addresses = ray.get([a.address.remote() for a in actors])
        self.clock_addresses = ray.get([a.clock_address.remote() for a in actors])
        self._start_actor = start_actor  # index -> a new actor for that shard (see restart)
        self.checkpoint_dir: Optional[str] = None  # durable servers: a promoted standby claims the shard's files
        # held by whoever changes which actor is a shard's primary or standby (the watches)
        self.topology = threading.RLock()
        # primary actors that do not answer and are being failed over (ReplicaWatch): notices to
        # them are not sent (each would wait until Ray declares the process dead); a shard's
        # standby promoted in place of one is told as any primary is
        self.silent_actors: list = []

    def dead_shards(self, timeout_s: float = 5.0) -> list[int]:
        """Indices of the shards whose actor died (a shard that is only slow to answer is alive)."""
        return sorted(self.dead_actors(timeout_s))

    def dead_actors(self, timeout_s: float = 5.0) -> dict:
        """Shard index -> its actor, of the shards whose actor died (a caller holding
        :attr:`topology` acts on those still in :attr:`actors`: one may have been replaced since)."""
        actors = list(self.actors)
        refs = [actor.pid.remote() for actor in actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        done, dead = set(ready), {}
        for index, ref in enumerate(refs):
            if ref in done:
                try:
                    ray.get(ref)
                except ACTOR_GONE:
                    dead[index] = actors[index]
        return dead

    def restart(self, index: int, recovering: bool = False) -> str:
        """Replaces shard ``index``'s (dead) actor by a new one in the same placement bundle, on
        its predecessor's ports if they are free; returns its data-plane address. The shard's
        sessions are not restored here (see ``Coordinator.shards_restarted``)."""
        if self._start_actor is None:
            raise RuntimeError("this fleet cannot start shard actors")
        ray.kill(self.actors[index])
        ports = (_port(self.addresses[index]), _port(self.clock_addresses[index]))
        actor = self._start_actor(index, ports, recovering)
        try:
            self.devices[index] = usable_devices([actor.device_report.remote()])[0]
        except BaseException:  # its GPU is unusable: it must not hold the bundle's GPU while the next try waits
            ray.kill(actor)
            raise
        address, clock_address = ray.get([actor.address.remote(), actor.clock_address.remote()])
        self.actors[index] = actor
        self.addresses[index], self.clock_addresses[index] = address, clock_address
        return address

    @property
    def replicated(self) -> bool:
        """The shards have hot standbys (``--replicas 2``)."""
        return self.standbys is not None

    def has_standby(self, index: int) -> bool:
        return self.standbys is not None and self.standbys.actors[index] is not None

    def start_standbys(self, name: str, openings: Sequence[ShardOpening], only: Optional[int] = None,
                       replace: bool = False) -> list[int]:
        """Session ``name``'s parts (``openings``; ``only``: that shard's alone) get standbys: each
        is held by its shard's standby (``replace``: a part held there already is dropped first),
        every part learns the session is replicated, then each primary streams its part from its
        state now (a new session's: its initial values on); one inside a step is asked again, for
        up to 30 s. Returns the shards that had no standby (their parts get ``standby_missing``).

        Raises:
          Unavailable: a part stayed inside steps that long (that part goes on with one copy).
        """
        mine = [o for o in openings if only in (None, o.shard_index)]
        kept = [o for o in mine if self.has_standby(o.shard_index)]
        parts = self.standbys.follow(kept, _ray_get, ACTOR_GONE, replace)
        held = {o.shard_index for o in parts}
        missing = sorted(o.shard_index for o in mine if o.shard_index not in held)
        # --on-one-replica refuse: each awaits one
        _ray_get([self.actors[i].standby_missing.remote(name, "its shard has no standby now") for i in missing])
        _ray_get([self.actors[o.shard_index].set_replicated.remote(name) for o in openings])
        deadline = time.monotonic() + 30.0
        for opening in parts:
            while True:
                try:
                    _ray_get(self.actors[opening.shard_index].replicate_session.remote(
                        name, self.standbys.clock_addresses[opening.shard_index]))
                    break
                except Unavailable:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        return missing

    def add_standby(self, index: int) -> None:
        """Shard ``index`` has no standby (promoted, or died): a fresh one, on another node than
        the shard's (see :meth:`StandbyActors.start_fresh`)."""
        node = _ray_get(self.actors[index].server_status.remote())["node_id"]
        self.standbys.start_fresh(index, node)

    def forget_dead_standbys(self) -> list[int]:
        """Shards whose standby died, now without one (let their parts go on: :meth:`go_on_alone`)."""
        if self.standbys is None:
            return []
        actors = list(self.standbys.actors)
        dead = self.standbys.dead(ACTOR_GONE)
        with self.topology:
            dead = [index for index in dead if self.standbys.actors[index] is actors[index]]
            for index in dead:
                self.standbys.forget(index)
        return dead

    def forget_standby(self, index: int, why: str) -> None:
        """Shard ``index``'s standby is no longer one (it is unreachable): its actor is killed if
        Ray can still reach it (let its primary's parts go on: :meth:`go_on_alone`)."""
        actor = self.standbys.take(index)
        if actor is not None:
            log.error("event=standby_forgotten shard=%d why=%s", index, why)
            ray.kill(actor)

    def go_on_alone(self, index: int, names: Optional[Sequence[str]] = None, why: str = "") -> list[str]:
        """Shard ``index``'s sessions ``names`` (None: all of them) acknowledge with one copy from
        now on (their standby is gone, or holds them no more); returns those let go."""
        return _ray_get(self.actors[index].go_on_alone.remote(None if names is None else list(names), why))

    def promote(self, index: int, names: Sequence[str], timeout_s: float = 30.0) -> dict[str, Optional[str]]:
        """Shard ``index``'s primary is gone: its standby serves each session of ``names`` in its
        place and becomes shard ``index`` (its addresses from now on); returns session -> None
        (promoted) or why it could not be (not in sync). On a durable server the standby owns the
        shard's files first, under a new ownership epoch (the lost primary is fenced off them)."""
        standby = self.standbys.take(index)
        try:
            addresses = ray.get([standby.address.remote(), standby.clock_address.remote()])
        except ACTOR_GONE as exc:  # it died too: nothing to promote (the shard is restarted empty)
            return {name: f"its standby is gone too ({type(exc).__name__})" for name in names}
        if self.checkpoint_dir is not None:
            try:
                _ray_get(standby.own_files.remote(claim_shard(self.checkpoint_dir, index)))
            except Exception as exc:  # noqa: BLE001 - it cannot own the files: it serves nothing
                ray.kill(standby)
                return {name: f"its standby could not take the shard's files ({type(exc).__name__}: {exc})"
                        for name in names}
        outcomes: dict[str, Optional[str]] = {}
        promoting = {name: standby.promote_session.remote(name, timeout_s) for name in names}  # side by side
        for name, ref in promoting.items():
            try:
                _ray_get(ref)
                outcomes[name] = None
            except Exception as exc:  # noqa: BLE001 - that session is lost; the others are served
                outcomes[name] = f"{type(exc).__name__}: {exc}"
        dead, self.actors[index] = self.actors[index], standby
        self.addresses[index], self.clock_addresses[index] = addresses
        self.devices[index] = usable_devices([standby.device_report.remote()])[0]
        ray.kill(dead)
        return outcomes

    def unload_session(self, name: str) -> None:
        """A final checkpoint of the session on every shard, then they free it (durable servers)."""
        _ray_get([a.checkpoint_session.remote(name) for a in self.actors])
        self.close_session(name)

    def restore_session(self, opening: ShardOpening, upto: Optional[int] = None) -> int:
        return _ray_get(self.actors[opening.shard_index].open_session.remote(opening, True, upto))

    def reachable(self, opening: ShardOpening) -> tuple[int, int, str, int, int]:
        return _ray_get(self.actors[opening.shard_index].reachable.remote(opening))

    def peer_down(self, home_index: int, shard_index: int, names: Sequence[str]) -> None:
        if not self._silent(home_index):
            _tell(self.actors[home_index].peer_down.remote(shard_index, list(names)))

    def peer_up(self, home_index: int, shard_index: int, names: Sequence[str]) -> None:
        if not self._silent(home_index):
            _tell(self.actors[home_index].peer_up.remote(shard_index, list(names)))

    def set_home_clock(self, shard_index: int, name: str, address: str) -> None:
        if not self._silent(shard_index):
            _tell(self.actors[shard_index].set_home_clock.remote(name, address))

    def _silent(self, index: int) -> bool:
        return any(actor is self.actors[index] for actor in self.silent_actors)

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
        """On every shard (and standby) that answers; a dead shard holds nothing any more."""
        standbys = self.standbys.live() if self.standbys is not None else []
        for ref in [a.close_session.remote(name, reason) for a in [*self.actors, *standbys]]:
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
        standbys = self.standbys.reports() if self.standbys is not None else [None] * len(reports)
        return [ShardSummary(i, self.addresses[i], healthy=False, standby=s) if r is None else
                ShardSummary(i, self.addresses[i], r["node_id"], r["sessions"], r["param_bytes"], r["resident_bytes"],
                             healthy=True, device=r["device"],
                             standby=dataclasses.replace(s, in_sync=r.get("in_sync", 0),
                                                         replicated=r.get("replicated", 0)) if s is not None else None)
                for i, (r, s) in enumerate(zip(reports, standbys))]

    def drain(self) -> None:
        """Every shard's health says NOT_SERVING (without waiting for them); calls are still served."""
        for actor in self.actors:
            actor.drain.remote()

    def stop(self) -> None:
        """Stops and kills the shard actors (and standbys), then frees their placement group."""
        for actor in [*self.actors, *(self.standbys.live() if self.standbys is not None else [])]:
            try:
                ray.get(actor.stop.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - best effort, the actor is killed next
                pass
            ray.kill(actor)
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)

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


def _tell(ref) -> None:
    """Waits for a notice to a shard; a shard that died meanwhile misses it (it holds nothing any
    more: a durable one restores its sessions when it is restarted, and hears of its peers then)."""
    try:
        ray.get(ref)
    except ACTOR_GONE:
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
    error inside a task's error, a dead or restarting shard actor as Unavailable (the client
    retries), but one Ray's memory monitor killed as ResourceExhausted (a retry, e.g. of the create
    that filled the node, would only kill a shard again, and lose its other sessions)."""
    try:
        return ray.get(refs)
    except OutOfMemoryError:
        raise ResourceExhausted("a shard of this server was killed by Ray's memory monitor: the node ran out of "
                                "memory (see RAY_memory_usage_threshold); the shard is replaced, but what needs "
                                "that memory will not fit") from None
    except ACTOR_GONE as exc:  # a shard restarting
        raise Unavailable(f"a shard of this server is restarting ({type(exc).__name__}); retry") from None
    except Exception as exc:  # re-raise the domain error inside a RayTaskError
        raise _domain_error(exc) from None


def usable_devices(refs: list) -> list:
    """The actors' :class:`~optserve.server.compute.devices.DeviceReport` (``refs``: their
    ``device_report`` calls).

    Raises:
      DeviceUnusable: an actor's JAX cannot use the GPUs it was given (its one-line ``problem``).
    """
    return refuse_problems(ray.get(refs))


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

    Raises:
      StartError: once the bundles are placed and before any shard starts, a shard on another
        machine than this one could not serve there (:func:`shard_host_refusal`); a group this
        call reserved is removed.
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
        group = spread_placement_group(config, **({"name": group_name, "lifetime": "detached"} if detached else {}))
        alive = [None] * config.shards
    refusal = shard_host_refusal(config, ray.util.get_node_ip_address(), bundle_node_ips(group))
    if refusal is not None:  # before any shard starts; a group a previous coordinator left stays
        if found is None:
            remove_placement_group(group)
        raise StartError(refusal)
    # GPUs: the actor's JAX sees (only) those Ray assigned it, within the memory budget of its share
    # no task events: Ray's GCS keeps every call's events (some 10 kB per session opened and closed)
    # up to its cap of 100,000 tasks, memory an hour of sessions would grow it by
    options = {"num_cpus": 0, "max_concurrency": 16, "enable_task_events": False,
               **shard_device_request(config).ray_options()}
    traced = tracing_environment()  # OPTSERVE_TRACEMALLOC_*: reaches shards on a cluster started elsewhere too
    if traced:
        runtime_env = options.get("runtime_env", {})
        options["runtime_env"] = {**runtime_env, "env_vars": {**runtime_env.get("env_vars", {}), **traced}}
    cls = ray.remote(ShardActor)

    def start_actor(index: int, ports: tuple = (0, 0), recovering: bool = False):
        named = {"name": actor_names[index], "namespace": DETACHED_NAMESPACE, "lifetime": "detached"} if detached else {}
        # durable: the new actor owns the shard's files from now on; a predecessor still running
        # (cut off, not dead) finds itself superseded before its next write and exits
        epoch = claim_shard(config.durability.checkpoint_dir, index) if config.durability is not None else 0
        for attempt in range(50):  # a dead detached actor's name is freed shortly after its death
            try:
                return cls.options(**options, **named, scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=index)).remote(index, config, security, precond_pool, ports,
                                                                       recovering, epoch)
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
    if config.durability is not None:
        fleet.checkpoint_dir = config.durability.checkpoint_dir
    if config.replicas > 1:
        try:
            fleet.standbys = start_standbys(config, group, lambda index, strategy: cls.options(
                **options, scheduling_strategy=strategy).remote(index, config, security, precond_pool))
        except BaseException:
            fleet.stop()
            raise
    fleet.reattached = [i for i, a in enumerate(alive) if a is not None]
    if fleet.reattached:
        log.warning("event=shards_reattached shards=%s", ",".join(map(str, fleet.reattached)))
    return fleet
