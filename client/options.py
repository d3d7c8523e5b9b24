"""What a session is created with, as one typed, validated record: :class:`SessionOptions`.

``Client.create_session``, the torch adapter (``RemoteOptimizer``) and the JAX adapter
(``optserve.client.jax.create_session``) all build a :class:`SessionOptions`, so every option is
validated the same way (errors are ``InvalidArgumentError`` naming the option, raised before any
server is contacted) and reaches the wire through one conversion, :meth:`SessionOptions.to_config`.
:meth:`SessionOptions.from_config` reads a session's configuration back (``Session.options``).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Optional, Union

import numpy as np

from optserve.client import _wire
from optserve.client.errors import InvalidArgumentError
from optserve.protos import contract
from optserve.protos.optserve.v1 import control_pb2, tensor_pb2

_MODES = {"sync": control_pb2.MODE_SYNC, "async": control_pb2.MODE_ASYNC}
_POLICIES = {"reject": control_pb2.STALENESS_POLICY_REJECT, "scale": control_pb2.STALENESS_POLICY_SCALE}
SPARSE_MEANS = ("all", "senders")
_LATE = {"drop": control_pb2.LATE_POLICY_DROP, "next": control_pb2.LATE_POLICY_NEXT}
_SPEC_KEYS = ("name", "args", "preconditioners")
_INT32_MAX = (1 << 31) - 1


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


@dataclasses.dataclass(frozen=True)
class PreconditionerOptions:
    """Shampoo's inverse roots (other optimizers ignore these; see ``PreconditionerOptions`` in
    control.proto).

    Attributes:
      in_process: compute the roots inside the shards' update even when the server has
        preconditioner workers.
      max_age: the largest preconditioner age in steps an update may use (>= 0; 0 reproduces
        in-process Shampoo exactly); ``None``: the server's default (2 x preconditioning_compute_steps).
    """

    in_process: bool = False
    max_age: Optional[int] = None

    def __post_init__(self) -> None:
        if not isinstance(self.in_process, (bool, np.bool_)):
            raise InvalidArgumentError(f"preconditioners: in_process must be a bool, got {self.in_process!r}")
        if self.max_age is not None and (not _is_int(self.max_age) or not 0 <= self.max_age <= _INT32_MAX):
            raise InvalidArgumentError(f"preconditioners: max_age must be an int >= 0 or None, got {self.max_age!r}")
        object.__setattr__(self, "in_process", bool(self.in_process))
        object.__setattr__(self, "max_age", None if self.max_age is None else int(self.max_age))

    @classmethod
    def from_mapping(cls, spec: Mapping[str, Any]) -> "PreconditionerOptions":
        """``{"in_process": bool, "max_age": int}`` (both optional)."""
        if not isinstance(spec, Mapping):
            raise InvalidArgumentError(f"preconditioners must be a dict {{'in_process', 'max_age'}}, got {spec!r}")
        unknown = sorted(set(spec) - {"in_process", "max_age"}, key=str)
        if unknown:
            raise InvalidArgumentError(f"preconditioners: unknown option {unknown[0]!r} (in_process, max_age)")
        return cls(**spec)

    def to_proto(self) -> control_pb2.PreconditionerOptions:
        message = control_pb2.PreconditionerOptions(in_process=self.in_process)
        if self.max_age is not None:
            message.max_age = self.max_age
        return message

    @classmethod
    def from_proto(cls, message: control_pb2.PreconditionerOptions) -> "PreconditionerOptions":
        return cls(in_process=message.in_process, max_age=message.max_age if message.HasField("max_age") else None)


@dataclasses.dataclass(frozen=True)
class SessionOptions:
    """Everything a session is created with, besides its name and tensors.

    Attributes:
      optimizer: the registry name of the optimizer (e.g. ``"adam"``, ``"adafactor_hf"``, ``"shampoo"``).
      optimizer_args: its keyword arguments (a JSON object: str keys, JSON values); the server
        checks them against the kernel's constructor.
      preconditioners: Shampoo's :class:`PreconditionerOptions` (a dict with the same keys is
        accepted); ``None``: the server's defaults.
      mode: ``"sync"`` (a step = mean of ``num_workers`` pushes on one version) or ``"async"``.
      num_workers: sync: pushes per step (>= 1).
      max_staleness: async: the largest accepted staleness in versions (>= 0); ``None``: unlimited.
      staleness_policy: async: ``"reject"`` stale pushes (ABORTED) or ``"scale"`` them by 1/(1+s).
      wire_dtype: default wire dtype of gradients and pulled parameters (``"float32"``,
        ``"bfloat16"``/``"bf16"``, ``"float16"``/``"f16"``, a NumPy dtype or an enum value; stored
        as its canonical name); ``None``: each tensor's own dtype.
      allow_nonfinite: pass NaN / Inf gradients to the optimizer instead of refusing them.
      min_workers / max_workers: elastic sync: a round may commit with ``min_workers`` pushes (once
        every current member pushed, or at the straggler deadline), and at most ``max_workers``
        workers are members at once; ``None``: ``num_workers`` (strict rounds: exactly
        ``num_workers`` pushes, no membership).
      lease_s: elastic sync: a member not heard of this long leaves (the SDK renews its lease in
        the background while user code computes).
      straggler_s: elastic sync: a round commits this long after its first push with whoever
        pushed (at least ``min_workers``); ``None``: adaptive (half the median period of the
        recent rounds, at least 50 ms).
      late: elastic sync: a gradient whose round already committed is ``"drop"``-ped (the worker
        is told in ``Session.last_step``) or folded into the ``"next"`` round under the staleness policy.
      sparse_mean: sync: how a step averages a tensor pushed as SparseLoCo selections (DiLoCo's
        ``compression``): ``"all"``, over all the step's pushes (an entry a push did not send counts
        as its zero), or ``"senders"``, each entry over the pushes that sent it.
      replicas: copies of the session's state the server keeps in memory: ``2``, each shard's part
        also on its hot standby, which holds every step before it is acknowledged (a server
        started with ``--replicas 2``; another refuses the session, FAILED_PRECONDITION); ``1``,
        one (lost with its shard's process unless the server is durable); ``None``: the server's
        ``--replicas``. An attached session reports the number the server uses.

    Raises (on construction):
      InvalidArgumentError: naming the option that is wrong.
    """

    optimizer: str
    optimizer_args: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)
    preconditioners: Optional[PreconditionerOptions] = None
    mode: str = "sync"
    num_workers: int = 1
    max_staleness: Optional[int] = None
    staleness_policy: str = "reject"
    wire_dtype: Optional[str] = None
    allow_nonfinite: bool = False
    min_workers: Optional[int] = None
    max_workers: Optional[int] = None
    lease_s: float = 5.0
    straggler_s: Optional[float] = None
    late: str = "drop"
    sparse_mean: str = "all"
    replicas: Optional[int] = None

    @property
    def elastic(self) -> bool:
        """Sync rounds with membership (``min_workers < num_workers`` or ``max_workers > num_workers``)."""
        return self.mode == "sync" and ((self.min_workers or self.num_workers) < self.num_workers
                                        or (self.max_workers or self.num_workers) > self.num_workers)

    def __post_init__(self) -> None:
        if not isinstance(self.optimizer, str) or not self.optimizer:
            raise InvalidArgumentError(f"optimizer: the name must be a non-empty string, got {self.optimizer!r}")
        args = {} if self.optimizer_args is None else self.optimizer_args
        if not isinstance(args, Mapping) or not all(isinstance(k, str) for k in args):
            raise InvalidArgumentError(f"optimizer_args of {self.optimizer!r} must be a dict with str keys, got {args!r}")
        try:
            json.dumps(dict(args), allow_nan=True)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"optimizer_args of {self.optimizer!r} must be JSON values: {exc}") from None
        object.__setattr__(self, "optimizer_args", dict(args))  # a copy: later edits of the caller's dict do not leak in
        if isinstance(self.preconditioners, Mapping):
            object.__setattr__(self, "preconditioners", PreconditionerOptions.from_mapping(self.preconditioners))
        elif self.preconditioners is not None and not isinstance(self.preconditioners, PreconditionerOptions):
            raise InvalidArgumentError(
                f"preconditioners must be a PreconditionerOptions or a dict, got {self.preconditioners!r}")
        if not isinstance(self.mode, str) or self.mode not in _MODES:
            raise InvalidArgumentError(f"mode must be 'sync' or 'async', got {self.mode!r}")
        if not _is_int(self.num_workers) or not 1 <= self.num_workers <= _INT32_MAX:
            raise InvalidArgumentError(f"num_workers must be an int >= 1, got {self.num_workers!r}")
        if self.max_staleness is not None and (not _is_int(self.max_staleness)
                                               or not 0 <= self.max_staleness <= _INT32_MAX):
            raise InvalidArgumentError(f"max_staleness must be an int >= 0 or None, got {self.max_staleness!r}")
        if not isinstance(self.staleness_policy, str) or self.staleness_policy not in _POLICIES:
            raise InvalidArgumentError(f"staleness_policy must be 'reject' or 'scale', got {self.staleness_policy!r}")
        wire = _wire.wire_option_enum(self.wire_dtype, what="wire_dtype")
        if wire == contract.SPARSE:
            raise InvalidArgumentError("wire_dtype: a session's default cannot be sparse (DiLoCo's "
                                       "compression='sparseloco' encodes its pushes so)")
        if self.sparse_mean not in SPARSE_MEANS:
            raise InvalidArgumentError(f"sparse_mean must be one of {', '.join(map(repr, SPARSE_MEANS))}, "
                                       f"got {self.sparse_mean!r}")
        object.__setattr__(self, "wire_dtype", None if wire is None else _wire.wire_option_name(wire))
        if self.replicas is not None and (not _is_int(self.replicas) or self.replicas not in (1, 2)):
            raise InvalidArgumentError(f"replicas must be 1, 2 or None (the server's --replicas), got {self.replicas!r}")
        if not isinstance(self.allow_nonfinite, (bool, np.bool_)):
            raise InvalidArgumentError(f"allow_nonfinite must be a bool, got {self.allow_nonfinite!r}")
        object.__setattr__(self, "allow_nonfinite", bool(self.allow_nonfinite))
        object.__setattr__(self, "num_workers", int(self.num_workers))
        if self.max_staleness is not None:
            object.__setattr__(self, "max_staleness", int(self.max_staleness))
        self._check_elastic()

    def _check_elastic(self) -> None:
        for name in ("min_workers", "max_workers"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 1 <= value <= _INT32_MAX):
                raise InvalidArgumentError(f"{name} must be an int >= 1 or None, got {value!r}")
        low, high = self.min_workers or self.num_workers, self.max_workers or self.num_workers
        if not low <= self.num_workers <= high:
            raise InvalidArgumentError(f"min_workers <= num_workers <= max_workers must hold, got {low}, "
                                       f"{self.num_workers}, {high}")
        for name in ("lease_s", "straggler_s"):
            value = getattr(self, name)
            if value is None and name == "straggler_s":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise InvalidArgumentError(f"{name} must be a number of seconds > 0, got {value!r}")
        if self.late not in _LATE:
            raise InvalidArgumentError(f"late must be 'drop' or 'next', got {self.late!r}")

    @classmethod
    def from_spec(cls, optimizer: Union[Mapping[str, Any], "SessionOptions"], **options: Any) -> "SessionOptions":
        """From an optimizer spec ``{"name": str, "args": {...}, "preconditioners": {...}}``
        ("args" and "preconditioners" optional) and the other options as keywords.

        A :class:`SessionOptions` passes through (with ``options`` replacing its fields).
        """
        if isinstance(optimizer, SessionOptions):
            return dataclasses.replace(optimizer, **options) if options else optimizer
        if not isinstance(optimizer, Mapping) or not isinstance(optimizer.get("name"), str):
            raise InvalidArgumentError(
                f'optimizer must be {{"name": str, "args": dict, "preconditioners": dict}}, got {optimizer!r}')
        unknown = sorted(set(optimizer) - set(_SPEC_KEYS), key=str)
        if unknown:
            raise InvalidArgumentError(f"optimizer spec: unknown key {unknown[0]!r} (name, args, preconditioners)")
        return cls(optimizer=optimizer["name"], optimizer_args=optimizer.get("args") or {},
                   preconditioners=optimizer.get("preconditioners"), **options)

    @property
    def spec(self) -> dict[str, Any]:
        """The optimizer spec dict (``name``, ``args``, and ``preconditioners`` when set)."""
        spec: dict[str, Any] = {"name": self.optimizer, "args": dict(self.optimizer_args)}
        if self.preconditioners is not None:
            spec["preconditioners"] = dataclasses.asdict(self.preconditioners)
        return spec

    def to_config(self, name: str, tensors: Mapping[str, np.ndarray]) -> control_pb2.SessionConfig:
        """The ``SessionConfig`` creating session ``name`` with ``tensors`` (name -> array, or
        anything with ``dtype`` and ``shape``; float32, bfloat16 or float16)."""
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"session name must be a non-empty string, got {name!r}")
        return control_pb2.SessionConfig(
            name=name,
            tensors=[tensor_pb2.TensorSpec(name=n, dtype=_wire.array_dtype_enum(a, name=n), shape=list(a.shape))
                     for n, a in tensors.items()],
            optimizer=self.to_optimizer_spec(),
            mode=self.to_mode(),
            num_workers=self.num_workers,
            max_staleness=-1 if self.max_staleness is None else self.max_staleness,
            staleness_policy=_POLICIES[self.staleness_policy],
            allow_nonfinite=self.allow_nonfinite,
            min_workers=self.min_workers or 0, max_workers=self.max_workers or 0, lease_s=float(self.lease_s),
            straggler_s=float(self.straggler_s or 0.0), late=_LATE[self.late],
            sparse_mean_over_senders=self.sparse_mean == "senders",
            replicas=self.replicas or 0,
            # int8 is each client's gradient encoding (Session.wire_dtype), not a server-side default
            wire_dtype=(_wire.dtype_enum(self.wire_dtype, what="wire_dtype") if self.wire_dtype != contract.INT8_NAME
                        else None) or tensor_pb2.DTYPE_UNSPECIFIED,
        )

    def to_optimizer_spec(self) -> control_pb2.OptimizerSpec:
        """The optimizer as the wire carries it: ``SessionConfig.optimizer`` when creating a
        session, ``GetSessionRequest.expect_optimizer`` when attaching with expectations."""
        optimizer = control_pb2.OptimizerSpec(name=self.optimizer, args_json=json.dumps(dict(self.optimizer_args)))
        if self.preconditioners is not None:
            optimizer.preconditioners.CopyFrom(self.preconditioners.to_proto())
        return optimizer

    def to_mode(self) -> int:
        """The ``Mode`` enum value of :attr:`mode` (``SessionConfig.mode``, ``GetSessionRequest.expect_mode``)."""
        return _MODES[self.mode]

    @classmethod
    def from_config(cls, config: control_pb2.SessionConfig) -> "SessionOptions":
        """The options of an existing session, from its ``SessionConfig`` (as the server reports it)."""
        modes = {v: k for k, v in _MODES.items()}
        policies = {v: k for k, v in _POLICIES.items()}
        preconditioners = config.optimizer.preconditioners if config.optimizer.HasField("preconditioners") else None
        return cls(
            optimizer=config.optimizer.name,
            optimizer_args=json.loads(config.optimizer.args_json or "{}"),
            preconditioners=None if preconditioners is None else PreconditionerOptions.from_proto(preconditioners),
            mode=modes.get(config.mode, "sync"),
            num_workers=config.num_workers or 1,
            max_staleness=None if config.max_staleness < 0 else config.max_staleness,
            staleness_policy=policies.get(config.staleness_policy, "reject"),
            wire_dtype=config.wire_dtype or None,
            allow_nonfinite=config.allow_nonfinite,
            min_workers=config.min_workers or None,
            max_workers=config.max_workers or None,
            lease_s=config.lease_s or 5.0,
            straggler_s=config.straggler_s or None,
            late={v: k for k, v in _LATE.items()}.get(config.late, "drop"),
            sparse_mean="senders" if config.sparse_mean_over_senders else "all",
            replicas=config.replicas or None,
        )
