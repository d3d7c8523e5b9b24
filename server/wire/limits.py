"""Request bounds checked on the wire, before a request is turned into domain records.

A ``CreateSession`` request is bounded (tensor count, name sizes, ranks, optimizer-argument JSON
size and nesting) before a single :class:`~optserve.server.domain.config.TensorSpec` is built or
its JSON parsed; the sizes that need the decoded session (bytes per session, memory budget,
sessions per tenant) are the coordinator's. Limits are the server's
:class:`~optserve.server.domain.config.Limits`.
"""

from __future__ import annotations

import re

from optserve.protos.optserve.v1 import control_pb2
from optserve.server.domain.config import Limits
from optserve.server.domain.errors import InvalidArgument

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_JSON_BRACKET = re.compile(r"[\[\]{}]")


def server_options(limits: Limits) -> tuple[tuple[str, int], ...]:
    """gRPC server options that enforce ``limits`` in the transport (request metadata size:
    larger headers are refused by gRPC itself with RESOURCE_EXHAUSTED, before any handler runs)."""
    return (("grpc.max_metadata_size", limits.max_metadata_bytes),
            ("grpc.absolute_max_metadata_size", limits.max_metadata_bytes))


def json_depth(text: str, stop_above: int) -> int:
    """The nesting depth of JSON ``text`` (strings ignored), counted without parsing it; counting
    stops once it exceeds ``stop_above``."""
    depth = deepest = 0
    for match in _JSON_BRACKET.finditer(_JSON_STRING.sub("", text)):
        if match.group() in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > stop_above:
                    break
        else:
            depth -= 1
    return deepest


def check_optimizer_args(spec: control_pb2.OptimizerSpec, limits: Limits) -> None:
    """The optimizer arguments' JSON is small and shallow enough to parse (INVALID_ARGUMENT naming
    the limit otherwise: deep nesting would exhaust the parser's recursion).

    Only the request's size is bounded here. Each argument's type and value (shape, finiteness,
    range) are the kernel's rules, checked once, by the coordinator, when it builds the optimizer
    (:func:`~optserve.server.compute.kernels.check_optimizer`)."""
    size = len(spec.args_json.encode("utf-8", "surrogatepass"))
    if size > limits.max_json_bytes:
        raise limits.exceeded("max_json_bytes", f"optimizer {spec.name[:200]!r}: args_json of {size} bytes")
    depth = json_depth(spec.args_json, limits.max_json_depth)
    if depth > limits.max_json_depth:
        raise InvalidArgument(f"optimizer {spec.name[:200]!r}: args_json is nested deeper than "
                              f"max_json_depth={limits.max_json_depth} (server flag --max-json-depth)")


def check_session_request(message: control_pb2.SessionConfig, limits: Limits) -> None:
    """Bounds a session definition before it is decoded: tensor count, each tensor's name size and
    rank, the optimizer arguments' size (RESOURCE_EXHAUSTED) and nesting (INVALID_ARGUMENT)."""
    count = len(message.tensors)
    if count > limits.max_tensors:
        raise limits.exceeded("max_tensors", f"session {message.name[:200]!r}: {count} tensors")
    for tensor in message.tensors:
        name_bytes = len(tensor.name.encode("utf-8", "surrogatepass"))
        if name_bytes > limits.max_tensor_name_bytes:
            raise limits.exceeded("max_tensor_name_bytes", f"session {message.name[:200]!r}: tensor name "
                                  f"{tensor.name[:64]!r}... of {name_bytes} bytes")
        if len(tensor.shape) > limits.max_tensor_rank:
            raise limits.exceeded("max_tensor_rank", f"session {message.name[:200]!r}: tensor {tensor.name!r} of "
                                  f"rank {len(tensor.shape)}")
    check_optimizer_args(message.optimizer, limits)
