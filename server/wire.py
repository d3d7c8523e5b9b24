"""Wire <-> domain conversions for the control plane (decode + validate at the edge)."""

from __future__ import annotations

import json

from optserve.protos.optserve.v1 import control_pb2, tensor_pb2
from optserve.server.assembly import wire_dtype
from optserve.server.config import Mode, PreconditionerOptions, SessionConfig, StalenessPolicy, TensorSpec
from optserve.server.coordinator import SessionRecord
from optserve.server.errors import InvalidArgument


def session_config_from_proto(message: control_pb2.SessionConfig) -> SessionConfig:
    """Decodes and validates a SessionConfig; errors name the field or option."""
    tensors = tuple(
        TensorSpec(t.name, wire_dtype(t.dtype, what=f"tensor {t.name!r}"), tuple(int(d) for d in t.shape))
        for t in message.tensors
    )
    if not message.optimizer.name:
        raise InvalidArgument("optimizer.name must be set")
    try:
        args = json.loads(message.optimizer.args_json or "{}")
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"optimizer {message.optimizer.name!r}: args_json is not valid JSON: {exc}") from None
    if not isinstance(args, dict):
        raise InvalidArgument(f"optimizer {message.optimizer.name!r}: args_json must be a JSON object")
    try:
        mode = Mode(message.mode)
    except ValueError:
        raise InvalidArgument(f"mode must be MODE_SYNC or MODE_ASYNC, got {message.mode}") from None
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
    )


def preconditioner_options_from_proto(message: control_pb2.PreconditionerOptions) -> PreconditionerOptions:
    return PreconditionerOptions(in_process=message.in_process,
                                 max_age=message.max_age if message.HasField("max_age") else None)


def preconditioner_options_to_proto(options: PreconditionerOptions) -> control_pb2.PreconditionerOptions:
    message = control_pb2.PreconditionerOptions(in_process=options.in_process)
    if options.max_age is not None:
        message.max_age = options.max_age
    return message


def preconditioner_status_to_proto(status) -> dict:
    """The ShardStatus fields for a shard's Shampoo status dict (``{}`` for other optimizers)."""
    if not status:
        return {}
    offload = control_pb2.RootOffloadStatus(
        offloaded=status["offloaded"], max_age=-1 if status["max_age"] is None else status["max_age"],
        roots_installed=status["roots_installed"], waits=status["waits"], resubmits=status["resubmits"])
    return {"preconditioners": [control_pb2.PreconditionerStatus(**b) for b in status["blocks"]], "root_offload": offload}


def assignment_to_proto(a) -> control_pb2.ShardAssignment:
    return control_pb2.ShardAssignment(
        shard_index=a.shard_index, address=a.address, tensor_names=list(a.tensor_names), param_bytes=a.param_bytes)


def session_info_to_proto(record: SessionRecord) -> control_pb2.SessionInfo:
    return control_pb2.SessionInfo(
        config=session_config_to_proto(record.config),
        shards=[assignment_to_proto(a) for a in record.assignments],
    )


_REASONS = {
    "invalid": control_pb2.REJECT_REASON_INVALID,
    "nonfinite": control_pb2.REJECT_REASON_NONFINITE,
    "aborted": control_pb2.REJECT_REASON_ABORTED,
}


def status_to_proto(record: SessionRecord, clock: dict, shards: list[dict]) -> control_pb2.GetStatusResponse:
    rejected = {control_pb2.REJECT_REASON_STALE: clock["stale"]}
    for shard in shards:
        for reason, count in shard["rejected"].items():
            if reason in _REASONS:
                rejected[_REASONS[reason]] = rejected.get(_REASONS[reason], 0) + count
    return control_pb2.GetStatusResponse(
        name=record.config.name,
        version=clock["version"],
        steps_applied=min(s["version"] for s in shards),
        pushes_accepted=clock["accepted"],
        rejected=[control_pb2.RejectCount(reason=r, count=c) for r, c in sorted(rejected.items())],
        shards=[
            control_pb2.ShardStatus(assignment=assignment_to_proto(a), version=s["version"],
                                    initialized=s["initialized"], node_id=s["node_id"], device=s["device"],
                                    **preconditioner_status_to_proto(s.get("preconditioners")))
            for a, s in zip(record.assignments, shards)
        ],
    )
