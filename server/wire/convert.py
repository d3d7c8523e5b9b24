"""Proto <-> domain conversions for the control plane: the one place each record is converted.

Decoding validates at the edge (errors name the field or option); encoding turns the domain's
typed status records into ``GetStatusResponse``.
"""

from __future__ import annotations

import json
import secrets
from typing import Optional

from optserve.protos.optserve.v1 import control_pb2, tensor_pb2
from optserve.protos.status_records import RootStatus
from optserve.server.domain.shard import wire_dtype
from optserve.server.domain.config import (DEFAULT_LEASE_S, ElasticOptions, LatePolicy, Limits, Mode,
                                           PreconditionerOptions, SessionConfig, StalenessPolicy, TensorSpec)
from optserve.server.domain.errors import InvalidArgument, RejectReason
from optserve.server.domain.sessions import AttachExpectation, SessionRecord, SessionStatus
from optserve.server.wire.limits import check_optimizer_args, check_session_request


def session_config_from_proto(message: control_pb2.SessionConfig, limits: Optional[Limits] = None) -> SessionConfig:
    """Decodes and validates a SessionConfig, bounded by ``limits`` (default: :class:`Limits`'
    defaults) before anything is built; errors name the field, option or limit."""
    limits = limits or Limits()
    check_session_request(message, limits)
    tensors = tuple(
        TensorSpec(t.name, wire_dtype(t.dtype, what=f"tensor {t.name!r}"), tuple(int(d) for d in t.shape))
        for t in message.tensors
    )
    if not message.optimizer.name:
        raise InvalidArgument("optimizer.name must be set")
    args = _optimizer_args(message.optimizer, limits)
    mode = _mode(message.mode)
    try:
        policy = StalenessPolicy(message.staleness_policy or StalenessPolicy.REJECT.value)
    except ValueError:
        raise InvalidArgument(f"staleness_policy must be REJECT or SCALE, got {message.staleness_policy}") from None
    wire = None if message.wire_dtype == tensor_pb2.DTYPE_UNSPECIFIED else wire_dtype(message.wire_dtype, what="wire_dtype")
    return SessionConfig(
        name=message.name,
        tensors=tensors,
        optimizer_name=message.optimizer.name,
        optimizer_args=args,
        preconditioners=preconditioner_options_from_proto(message.optimizer.preconditioners),
        mode=mode,
        num_workers=message.num_workers or 1,
        max_staleness=None if message.max_staleness < 0 else message.max_staleness,
        staleness_policy=policy,
        allow_nonfinite=message.allow_nonfinite,
        wire_dtype=wire,
        elastic=_elastic_options(message),
        incarnation=_incarnation(message.incarnation),
        sparse_mean_over_senders=message.sparse_mean_over_senders,
        replicas=message.replicas or None,
    )


def _incarnation(given: str) -> str:
    """A new session's incarnation: the one a request carries (a restore names its own), else fresh."""
    if len(given) > 64:
        raise InvalidArgument(f"incarnation must have at most 64 characters, got {len(given)}")
    return given or secrets.token_hex(8)


def _elastic_options(message: control_pb2.SessionConfig) -> ElasticOptions:
    try:
        late = LatePolicy(message.late or LatePolicy.DROP.value)
    except ValueError:
        raise InvalidArgument(f"late must be LATE_POLICY_DROP or LATE_POLICY_NEXT, got {message.late}") from None
    for name in ("min_workers", "max_workers"):
        if getattr(message, name) < 0:
            raise InvalidArgument(f"{name} must be >= 1 (0: num_workers), got {getattr(message, name)}")
    return ElasticOptions(min_workers=message.min_workers or None, max_workers=message.max_workers or None,
                          lease_s=message.lease_s or DEFAULT_LEASE_S, straggler_s=message.straggler_s or None,
                          late=late)


def _optimizer_args(spec: control_pb2.OptimizerSpec, limits: Limits) -> dict:
    check_optimizer_args(spec, limits)
    try:
        args = json.loads(spec.args_json or "{}")
    except (json.JSONDecodeError, RecursionError) as exc:
        raise InvalidArgument(f"optimizer {spec.name!r}: args_json is not valid JSON: {exc}") from None
    if not isinstance(args, dict):
        raise InvalidArgument(f"optimizer {spec.name!r}: args_json must be a JSON object")
    return args


def _mode(value: int) -> Mode:
    try:
        return Mode(value)
    except ValueError:
        raise InvalidArgument(f"mode must be MODE_SYNC or MODE_ASYNC, got {value}") from None


def attach_expectation_from_proto(request: control_pb2.GetSessionRequest, limits: Optional[Limits] = None):
    """What an attaching client expects (None when it states nothing)."""
    has_optimizer, has_mode = request.HasField("expect_optimizer"), request.expect_mode != control_pb2.MODE_UNSPECIFIED
    if not (has_optimizer or has_mode):
        return None
    spec = request.expect_optimizer
    return AttachExpectation(
        optimizer_name=spec.name or None if has_optimizer else None,
        optimizer_args=_optimizer_args(spec, limits or Limits()) if has_optimizer else None,
        preconditioners=preconditioner_options_from_proto(spec.preconditioners) if has_optimizer else None,
        mode=_mode(request.expect_mode) if has_mode else None,
    )


def session_config_to_proto(config: SessionConfig) -> control_pb2.SessionConfig:
    return control_pb2.SessionConfig(
        name=config.name,
        tensors=[tensor_pb2.TensorSpec(name=t.name, dtype=t.dtype.value, shape=list(t.shape)) for t in config.tensors],
        optimizer=control_pb2.OptimizerSpec(name=config.optimizer_name, args_json=json.dumps(config.optimizer_args),
                                            preconditioners=preconditioner_options_to_proto(config.preconditioners)),
        mode=config.mode.value,
        num_workers=config.num_workers,
        max_staleness=-1 if config.max_staleness is None else config.max_staleness,
        staleness_policy=config.staleness_policy.value,
        allow_nonfinite=config.allow_nonfinite,
        wire_dtype=config.wire_dtype.value if config.wire_dtype else tensor_pb2.DTYPE_UNSPECIFIED,
        min_workers=config.elastic.min_workers or 0, max_workers=config.elastic.max_workers or 0,
        lease_s=config.elastic.lease_s, straggler_s=config.elastic.straggler_s or 0.0, late=config.elastic.late.value,
        incarnation=config.incarnation,
        sparse_mean_over_senders=config.sparse_mean_over_senders,
        replicas=config.replicas or 0,
    )


def preconditioner_options_from_proto(message: control_pb2.PreconditionerOptions) -> PreconditionerOptions:
    return PreconditionerOptions(in_process=message.in_process,
                                 max_age=message.max_age if message.HasField("max_age") else None)


def preconditioner_options_to_proto(options: PreconditionerOptions) -> control_pb2.PreconditionerOptions:
    message = control_pb2.PreconditionerOptions(in_process=options.in_process)
    if options.max_age is not None:
        message.max_age = options.max_age
    return message


def root_status_to_proto(status: RootStatus | None) -> dict:
    """The ShardStatus fields for a shard's root status (``{}`` for kernels without roots)."""
    if status is None:
        return {}
    return {"preconditioners": [b.to_proto() for b in status.blocks], "root_offload": status.offload.to_proto()}


def assignment_to_proto(a) -> control_pb2.ShardAssignment:
    return control_pb2.ShardAssignment(
        shard_index=a.shard_index, address=a.address, tensor_names=list(a.tensor_names), param_bytes=a.param_bytes)


def session_info_to_proto(record: SessionRecord) -> control_pb2.SessionInfo:
    return control_pb2.SessionInfo(
        config=session_config_to_proto(record.config),
        shards=[assignment_to_proto(a) for a in record.assignments],
        hot_standby=record.config.replicas == 2,
    )


def status_to_proto(status: SessionStatus) -> control_pb2.GetStatusResponse:
    """Stale refusals are the clock's count (it decides them); the others are summed over shards."""
    rejected = {RejectReason.STALE: status.clock.stale}
    for shard in status.shards:
        for reason, count in shard.rejected.items():
            if reason is not RejectReason.STALE:
                rejected[reason] = rejected.get(reason, 0) + count
    return control_pb2.GetStatusResponse(
        name=status.record.config.name,
        version=status.clock.version,
        steps_applied=min(s.version for s in status.shards),
        pushes_accepted=status.clock.accepted,
        staleness_p50=status.clock.staleness_p50,
        staleness_max=status.clock.staleness_max,
        last_activity_unix_s=status.last_activity_unix_s,
        rolled_back_from=status.rolled_back_from,
        elastic=status.clock.elastic.to_proto() if status.clock.elastic is not None else None,
        workers=[control_pb2.WorkerActivity(worker_id=w, last_push_unix_s=t) for w, t in status.clock.workers],
        rejected=[control_pb2.RejectCount(reason=r.value, count=c)
                  for r, c in sorted(rejected.items(), key=lambda item: item[0].value)],
        shards=[
            control_pb2.ShardStatus(assignment=assignment_to_proto(a), version=s.version, initialized=s.initialized,
                                    node_id=s.node_id, device=s.device, optimizer_state_bytes=s.state_bytes,
                                    durability=durability_to_proto(s.durability),
                                    hyperparams=[control_pb2.HyperparamValue(group=g, option=o, value=v, scheduled=k)
                                                 for g, o, v, k in s.hyperparams],
                                    **root_status_to_proto(s.preconditioners))
            for a, s in zip(status.record.assignments, status.shards)
        ],
    )


def durability_to_proto(status) -> "control_pb2.DurabilityStatus | None":
    """A shard's ``DurabilityStatus`` record -> the wire (None: not durable)."""
    return status.to_proto() if status is not None else None


def server_status_to_proto(shards) -> control_pb2.GetServerStatusResponse:
    """``ShardSummary`` records -> the wire."""
    return control_pb2.GetServerStatusResponse(shards=[
        control_pb2.ServerShard(index=s.index, address=s.address, node_id=s.node_id, sessions=s.sessions,
                                param_bytes=s.param_bytes, resident_bytes=s.resident_bytes, healthy=s.healthy,
                                device=device_to_proto(s.device), standby=None if s.standby is None else
                                control_pb2.ShardStandby(node_id=s.standby.node_id, healthy=s.standby.healthy,
                                                         in_sync=s.standby.in_sync,
                                                         replicated=s.standby.replicated))
        for s in shards])


def device_to_proto(report) -> "control_pb2.DevicePlacement | None":
    """A :class:`~optserve.server.compute.devices.DeviceReport` -> the wire (None: none)."""
    if report is None:
        return None
    return control_pb2.DevicePlacement(backend=report.backend, devices=list(report.devices),
                                       gpu_ids=list(report.gpu_ids), memory_fraction=report.memory_fraction,
                                       rehearsal=report.rehearsal)


def series_to_proto(series) -> control_pb2.GetSeriesResponse:
    """``(accepted, refused, rounds)`` records of :mod:`~optserve.server.domain.telemetry` and
    :mod:`~optserve.server.domain.clock.rounds` -> the wire."""
    accepted, refused, rounds = series
    response = control_pb2.GetSeriesResponse()
    for push in accepted:
        point = response.accepted.add(version=push.version, staleness=push.staleness, unix_s=push.unix_s)
        if push.telemetry.loss is not None:
            point.loss = push.telemetry.loss
        point.scalars.update(push.telemetry.scalars)
    response.refused.extend(control_pb2.RefusedPush(unix_s=r.unix_s, reason=r.reason.value) for r in refused)
    response.rounds.extend(r.to_proto() for r in rounds)
    return response
