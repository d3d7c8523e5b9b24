"""Typed configuration, validated at the edge: the server's flags and a session's definition.

Constructing these dataclasses validates them; an invalid value raises
:class:`~optserve.server.domain.errors.InvalidArgument` naming the option.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import ipaddress
import math
from typing import Any, Optional

import numpy as np

from optserve.server.domain.durability import DurabilityConfig
from optserve.server.domain.errors import InvalidArgument
from optserve.server.domain.limits import Limits


class DType(enum.Enum):
    """Supported tensor dtypes (values are the wire enum numbers of ``optserve.v1.DType``)."""

    FLOAT32 = 1
    BFLOAT16 = 2
    FLOAT16 = 3

    @property
    def itemsize(self) -> int:
        return 4 if self is DType.FLOAT32 else 2

    @property
    def numpy(self):
        """The NumPy dtype (bfloat16 via ml_dtypes, a server dependency that ``optserve status``
        on a client-only install never needs)."""
        if self is DType.BFLOAT16:
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(np.float32 if self is DType.FLOAT32 else np.float16)


class Mode(enum.Enum):
    SYNC = 1
    ASYNC = 2


class StalenessPolicy(enum.Enum):
    REJECT = 1
    SCALE = 2


class LatePolicy(enum.Enum):
    """Elastic sync: a gradient computed from a version whose round already closed is dropped
    (counted, and its worker told) or folded into the open round (NEXT) under the staleness policy."""

    DROP = 1
    NEXT = 2


DEFAULT_LEASE_S = 5.0
MAX_WORKER_ID = 64
WORKER_SEPARATOR = "/"  # a push's client_id is "<worker_id>/<instance>" (a bare client_id is its own worker)


def worker_of(client_id: str) -> str:
    """The worker a push's ``client_id`` belongs to (its part before the first '/')."""
    return client_id.split(WORKER_SEPARATOR, 1)[0]


@dataclasses.dataclass(frozen=True)
class ElasticOptions:
    """Sync sessions whose workers come and go (see :mod:`optserve.server.domain.clock.rounds`).

    Attributes:
      min_workers: a round may commit with this many pushes (at the straggler deadline, or once
        every current member pushed); None: ``num_workers`` (strict rounds).
      max_workers: most members at once; None: ``num_workers``.
      lease_s: a member not heard of (push, pull, renewal) for this long leaves.
      straggler_s: seconds after a round's first push at which it commits with whoever pushed (at
        least ``min_workers``); None: adaptive, half the median of the last 16 round periods
        (commit to commit), at least 50 ms, and none before two rounds committed.
      late: what happens to a gradient whose round already closed.
    """

    min_workers: Optional[int] = None
    max_workers: Optional[int] = None
    lease_s: float = DEFAULT_LEASE_S
    straggler_s: Optional[float] = None
    late: LatePolicy = LatePolicy.DROP

    def __post_init__(self):
        for name in ("min_workers", "max_workers"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidArgument(f"{name} must be >= 1, got {value}")
        if not (math.isfinite(self.lease_s) and self.lease_s > 0):
            raise InvalidArgument(f"lease_s must be a finite number > 0, got {self.lease_s}")
        if self.straggler_s is not None and not (math.isfinite(self.straggler_s) and self.straggler_s > 0):
            raise InvalidArgument(f"straggler_s must be a finite number > 0 (or unset: adaptive), got {self.straggler_s}")

    def to_json(self) -> dict:
        return {"min_workers": self.min_workers, "max_workers": self.max_workers, "lease_s": self.lease_s,
                "straggler_s": self.straggler_s, "late": self.late.name}

    @classmethod
    def from_json(cls, data: Optional[dict]) -> "ElasticOptions":
        if not data:
            return cls()
        return cls(data["min_workers"], data["max_workers"], float(data["lease_s"]), data["straggler_s"],
                   LatePolicy[data["late"]])


MAX_TENSOR_BYTES = (1 << 63) - 1  # chunk offsets and byte counts are int64 on the wire


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One named tensor: ``shape`` outermost first, ``dtype`` as stored on the server."""

    name: str
    dtype: DType
    shape: tuple[int, ...]

    def __post_init__(self):
        if not self.name:
            raise InvalidArgument("tensor name must be non-empty")
        if any(d < 0 for d in self.shape):
            raise InvalidArgument(f"tensor {self.name!r}: negative dimension in shape {list(self.shape)}")
        if self.nbytes > MAX_TENSOR_BYTES:
            raise InvalidArgument(f"tensor {self.name!r}: shape {list(self.shape)} holds {self.size} elements, "
                                  f"{self.nbytes} bytes: more than int64 byte offsets can address")

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class PreconditionerOptions:
    """Shampoo and SOAP sessions: where inverse roots (SOAP: eigenbases) are computed (see
    :mod:`optserve.server.compute.root_offload`).

    Attributes:
      in_process: compute roots inside the shards' update even when the server has workers.
      max_age: the age bound in steps (>= 0); ``None``: 2 x preconditioning_compute_steps.
    """

    in_process: bool = False
    max_age: Optional[int] = None

    def __post_init__(self):
        if self.max_age is not None and self.max_age < 0:
            raise InvalidArgument(f"optimizer preconditioners: max_age must be >= 0, got {self.max_age}")


@dataclasses.dataclass(frozen=True)
class SessionConfig:
    """A session: its tensors, optimizer and step semantics.

    Attributes:
      name: unique session name (1-200 characters).
      tensors: the model's tensors, names unique.
      optimizer_name / optimizer_args: a registry entry of ``optserve.optim_kernels`` and its
        keyword arguments (the coordinator checks them with the compute layer's
        :func:`~optserve.server.compute.kernels.check_optimizer`).
      mode: SYNC (a step = mean of ``num_workers`` pushes against one version) or ASYNC.
      num_workers: pushes per sync step, >= 1.
      max_staleness: async: the largest accepted staleness, >= 0; None means unlimited.
      staleness_policy: async: REJECT stale pushes, or SCALE steps by 1 / (1 + staleness).
      allow_nonfinite: pass NaN/Inf gradients to the optimizer instead of rejecting them.
      wire_dtype: default wire dtype advertised to clients (None: each tensor's own).
      preconditioners: Shampoo and SOAP: where their roots (SOAP: eigenbases) are computed, and their age bound.
      elastic: sync: membership and rounds (``min_workers``, ``max_workers``, leases, stragglers).
      incarnation: which creation of a session of this name this is ("" in sessions made before
        it existed): pushes for another are refused (see ``PushHeader.incarnation``).
      sparse_mean_over_senders: sync: a tensor some pushes sent as SparseLoCo selections is
        averaged per entry over the pushes that named it (False: over all the step's pushes).
      replicas: copies of the session's state in memory: 2, each part also held by its shard's
        hot standby (a ``--replicas 2`` server); 1, the shard's process alone; None: the
        server's ``--replicas`` (the coordinator sets it when the session is created).
    """

    name: str
    tensors: tuple[TensorSpec, ...]
    optimizer_name: str
    optimizer_args: dict[str, Any]
    mode: Mode = Mode.SYNC
    num_workers: int = 1
    max_staleness: Optional[int] = None
    staleness_policy: StalenessPolicy = StalenessPolicy.REJECT
    allow_nonfinite: bool = False
    wire_dtype: Optional[DType] = None
    preconditioners: PreconditionerOptions = dataclasses.field(default_factory=PreconditionerOptions)
    elastic: ElasticOptions = dataclasses.field(default_factory=ElasticOptions)
    incarnation: str = ""
    sparse_mean_over_senders: bool = False
    replicas: Optional[int] = None

    def __post_init__(self):
        if not 1 <= len(self.name) <= 200:
            raise InvalidArgument(f"session name must have 1-200 characters, got {len(self.name)}")
        if not self.tensors:
            raise InvalidArgument(f"session {self.name!r} has no tensors")
        counts = collections.Counter(t.name for t in self.tensors)  # linear: sessions may have 100k tensors
        duplicates = sorted(n for n, c in counts.items() if c > 1)
        if duplicates:
            raise InvalidArgument(f"session {self.name!r}: duplicate tensor name {duplicates[0]!r}")
        if self.num_workers < 1:
            raise InvalidArgument(f"num_workers must be >= 1, got {self.num_workers}")
        if self.replicas not in (None, 1, 2):
            raise InvalidArgument(f"session {self.name!r}: replicas must be 1 or 2 (unset: the server's --replicas), "
                                  f"got {self.replicas}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise InvalidArgument(f"max_staleness must be >= 0, got {self.max_staleness}")
        if not self.min_workers <= self.num_workers <= self.max_workers:
            raise InvalidArgument(f"min_workers <= num_workers <= max_workers must hold, got {self.min_workers}, "
                                  f"{self.num_workers}, {self.max_workers}")

    @property
    def min_workers(self) -> int:
        return self.num_workers if self.elastic.min_workers is None else self.elastic.min_workers

    @property
    def max_workers(self) -> int:
        return self.num_workers if self.elastic.max_workers is None else self.elastic.max_workers

    @property
    def is_elastic(self) -> bool:
        """Sync rounds with membership: ``min_workers < num_workers`` or ``max_workers > num_workers``
        (otherwise a round is exactly ``num_workers`` pushes, from any clients)."""
        return self.mode is Mode.SYNC and (self.min_workers < self.num_workers or self.max_workers > self.num_workers)

    @property
    def spec_by_name(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.tensors}

    @property
    def gradient_bytes(self) -> int:
        """Bytes of one float32 gradient of every tensor (what one step adds to the step logs)."""
        return sum(t.size * 4 for t in self.tensors)

    def to_json(self) -> dict:
        """The session's definition as JSON-able data (durable sessions' catalog); see :meth:`from_json`."""
        return {
            "name": self.name,
            "tensors": [[t.name, t.dtype.name, list(t.shape)] for t in self.tensors],
            "optimizer_name": self.optimizer_name, "optimizer_args": self.optimizer_args,
            "mode": self.mode.name, "num_workers": self.num_workers, "max_staleness": self.max_staleness,
            "staleness_policy": self.staleness_policy.name, "allow_nonfinite": self.allow_nonfinite,
            "wire_dtype": self.wire_dtype.name if self.wire_dtype is not None else None,
            "preconditioners": dataclasses.asdict(self.preconditioners),
            "elastic": self.elastic.to_json(),
            "incarnation": self.incarnation,
            "sparse_mean_over_senders": self.sparse_mean_over_senders,
            "replicas": self.replicas,
        }

    @classmethod
    def from_json(cls, data: dict) -> "SessionConfig":
        return cls(
            name=data["name"],
            tensors=tuple(TensorSpec(n, DType[d], tuple(int(x) for x in shape)) for n, d, shape in data["tensors"]),
            optimizer_name=data["optimizer_name"], optimizer_args=dict(data["optimizer_args"]),
            mode=Mode[data["mode"]], num_workers=int(data["num_workers"]), max_staleness=data["max_staleness"],
            staleness_policy=StalenessPolicy[data["staleness_policy"]], allow_nonfinite=bool(data["allow_nonfinite"]),
            wire_dtype=DType[data["wire_dtype"]] if data["wire_dtype"] else None,
            preconditioners=PreconditionerOptions(**data["preconditioners"]),
            elastic=ElasticOptions.from_json(data.get("elastic")),
            incarnation=str(data.get("incarnation", "")),
            sparse_mean_over_senders=bool(data.get("sparse_mean_over_senders", False)),
            replicas=data.get("replicas"),
        )


ONE_REPLICA_POLICIES = ("continue", "refuse")  # ServerConfig.on_one_replica


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """``optserve serve`` flags.

    Attributes:
      host / port: where the coordinator's Control service listens (port 0: pick a free one).
      shards: number of shard actors (>= 1).
      ray_address: "local" (start an embedded Ray), "auto" (join a running cluster) or an address.
      gpus_per_shard: GPUs each shard actor requests from Ray (0: CPU).
      shard_host: interface the shards' data services bind to (defaults to ``host``).
      precond_workers / gpus_per_precond_worker / precond_f64: Shampoo's preconditioner workers
        (:mod:`optserve.server.compute.preconditioner_pool`): how many, GPUs each, float64 roots.
      gpu_rehearsal: Ray reserves and assigns the GPUs asked for, and each actor's JAX runs on the
        CPU (``--rehearse-gpus``: a GPU deployment's placement checked where no GPU is).
      grpc_threads: thread pool size of each gRPC server (threads start as calls need them; those
        past 8 end after 20 s without work: ``server/wire/thread_pool.py``). A shard's PushPull
        steps and its clock's votes wait (for the other shards' votes, their turn, their round)
        on an event loop, holding no thread (:mod:`~optserve.server.domain.waits`): threads run
        the work between the waits, and the unary calls (a shard's data plane has a pool of this
        size for each, so that a unary call, such as a lease renewal, never queues behind steps).
      min_shard_bytes: a session spreads over only as many shards as give each at least this
        many parameter bytes (:func:`~optserve.server.domain.sessions.placement.place_tensors`); smaller models
        stay on one shard, where a step needs no cross-shard round trips. 0: every session uses
        every shard.
      step_timeout_s: longest wait for a sync barrier or a cross-shard reduction.
      vote_timeout_s: how long shards that staged a push wait for their peers to stage theirs
        before refusing it everywhere (a client that vanished between shards).
      staged_push_ttl_s: how long a push staged without auto-commit (the client-driven two-phase
        path) waits for its Commit or Abort before the shard drops it and frees its buffers (> 0).
      tls_cert / tls_key: PEM files of the server's certificate chain and key: TLS on every port.
      tls_client_ca: PEM file of the CA client certificates must chain to (mutual TLS).
      auth_tokens: file of tenant tokens, one per line (``token [name]``): every call must carry one.
      insecure: allow binding a non-loopback interface without TLS and tokens.
      metrics_port: serve Prometheus metrics at ``http://metrics_host:metrics_port/metrics``
        (None: off; 0: pick a free port). The endpoint has no authentication: it names sessions.
      drain_s: on SIGINT / SIGTERM, how long health checks say NOT_SERVING before the server stops.
      health_port: also answer ``grpc.health.v1.Health`` (only it) in plaintext on this port of
        ``host`` (None: off; 0: a free port), for probes that cannot speak TLS (Kubernetes' gRPC probes).
      durability: checkpoints, step logs and recovery
        (:class:`~optserve.server.domain.durability.DurabilityConfig`; None: sessions are not durable).
      limits: bounds on requests, sessions and tenants (:class:`Limits`).
      log_level: "debug", "info", "warning" or "error": the server's processes (coordinator and
        shards) log at this level to stderr (None: the host program configures logging).
      replicas: 2: every shard has a hot standby in another shard process (on another Ray node
        unless ``replica_same_node``, for single-machine tests), which holds each step before it
        is acknowledged and serves in the shard's place when its process dies.
      replica_silence_s: ``--replicas 2``: a shard's primary or standby process that does not
        answer the coordinator's probes (20 a second) for this long counts as lost (its standby is
        promoted; a lost standby is replaced), without waiting for Ray to declare its node dead.
      on_one_replica: ``--replicas 2``: what a session part does while only one copy of it is
        in sync (its standby lost, or its primary lost and the standby promoted, until a fresh
        standby caught up): "continue" acknowledges steps with that one copy (they are lost if it
        is lost too meanwhile); "refuse" acknowledges nothing (clients retry UNAVAILABLE; a step
        applied meanwhile is acknowledged once the fresh standby holds it).
      session_idle_s: a session's idle lease: one that no client pushed to, committed on, pulled
        from or initialized for this many seconds is closed (None: sessions never expire).
    """

    host: str = "127.0.0.1"
    port: int = 0
    shards: int = 2
    ray_address: str = "local"
    gpus_per_shard: float = 0.0
    shard_host: Optional[str] = None
    precond_workers: int = 0
    gpus_per_precond_worker: float = 0.0
    precond_f64: bool = False
    gpu_rehearsal: bool = False
    grpc_threads: int = 256
    min_shard_bytes: int = 4 << 20
    step_timeout_s: float = 300.0
    vote_timeout_s: float = 30.0
    staged_push_ttl_s: float = 60.0
    tls_cert: Optional[str] = None
    tls_key: Optional[str] = None
    tls_client_ca: Optional[str] = None
    auth_tokens: Optional[str] = None
    insecure: bool = False
    metrics_port: Optional[int] = None
    metrics_host: str = "127.0.0.1"
    drain_s: float = 1.0
    health_port: Optional[int] = None
    durability: Optional[DurabilityConfig] = None
    replicas: int = 1
    replica_same_node: bool = False
    replica_silence_s: float = 0.5
    on_one_replica: str = "continue"
    limits: Limits = dataclasses.field(default_factory=Limits)
    session_idle_s: Optional[float] = None
    log_level: Optional[str] = None

    def __post_init__(self):
        if self.shards < 1:
            raise InvalidArgument(f"--shards must be >= 1, got {self.shards}")
        if not 0 <= self.port <= 65535:
            raise InvalidArgument(f"--port must be in [0, 65535], got {self.port}")
        if self.gpus_per_shard < 0 or self.gpus_per_precond_worker < 0:
            raise InvalidArgument("GPU counts must be >= 0")
        if self.gpu_rehearsal and not (self.gpus_per_shard > 0 or self.gpus_per_precond_worker > 0):
            raise InvalidArgument("--rehearse-gpus needs --gpus-per-shard or --gpus-per-precond-worker")
        if self.precond_workers < 0:
            raise InvalidArgument(f"--precond-workers must be >= 0, got {self.precond_workers}")
        if self.replicas not in (1, 2):
            raise InvalidArgument(f"--replicas must be 1 or 2, got {self.replicas}")
        if self.on_one_replica not in ONE_REPLICA_POLICIES:
            raise InvalidArgument(f"--on-one-replica must be one of {', '.join(ONE_REPLICA_POLICIES)}, got "
                                  f"{self.on_one_replica!r}")
        if self.on_one_replica != "continue" and self.replicas == 1:
            raise InvalidArgument(f"--on-one-replica {self.on_one_replica} is what a session does when one of "
                                  f"its two copies is lost: it needs --replicas 2")
        if not self.replica_silence_s > 0:
            raise InvalidArgument(f"--replica-silence-s must be > 0, got {self.replica_silence_s}")
        if self.min_shard_bytes < 0:
            raise InvalidArgument(f"--min-shard-bytes must be >= 0, got {self.min_shard_bytes}")
        if self.grpc_threads < 2:
            raise InvalidArgument(f"grpc_threads must be >= 2, got {self.grpc_threads}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise InvalidArgument(f"--metrics-port must be in [0, 65535], got {self.metrics_port}")
        if self.health_port is not None and not 0 <= self.health_port <= 65535:
            raise InvalidArgument(f"--health-port must be in [0, 65535], got {self.health_port}")
        if not self.staged_push_ttl_s > 0:
            raise InvalidArgument(f"--staged-push-ttl-s must be > 0, got {self.staged_push_ttl_s}")
        if self.log_level is not None and self.log_level not in ("debug", "info", "warning", "error"):
            raise InvalidArgument(f"--log-level must be one of debug, info, warning, error, got {self.log_level!r}")
        if self.session_idle_s is not None and not self.session_idle_s > 0:
            raise InvalidArgument(f"--session-idle-s must be > 0, got {self.session_idle_s}")
        if self.drain_s < 0:
            raise InvalidArgument(f"--drain-s must be >= 0, got {self.drain_s}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidArgument("--tls-cert and --tls-key go together: give both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise InvalidArgument("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS)")
        metrics_host = self.metrics_host if self.metrics_port is not None else "127.0.0.1"
        exposed = [h for h in (self.host, self.data_host, metrics_host) if not is_loopback(h)]
        if exposed and not (self.tls_cert and self.auth_tokens) and not self.insecure:
            raise InvalidArgument(
                f"binding {exposed[0]!r} exposes optserve to the network: give --tls-cert/--tls-key and "
                f"--auth-tokens, or --insecure to run without them")

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def data_host(self) -> str:
        """Interface the shard actors bind (a wildcard makes them advertise their node's IP)."""
        return self.shard_host or self.host


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an interface to bind) is reachable only from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
