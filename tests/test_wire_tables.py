"""The wire layer's tables agree with the domain and the protos: reasons, status codes, clock errors."""

from __future__ import annotations

import grpc
import pytest

from optserve.protos import contract
from optserve.protos.optserve.v1 import control_pb2
from optserve.server.domain import errors
from optserve.server.domain.clock.clock_records import Ticket
from optserve.server.wire import clock_service
from optserve.server.wire.errors import status_code_for


def test_reject_reasons_are_the_proto_enum():
    assert {r.name: r.value for r in errors.RejectReason} == {
        name[len("REJECT_REASON_"):]: value for name, value in control_pb2.RejectReason.items()
        if name != "REJECT_REASON_UNSPECIFIED"}
    assert {contract.REJECT_REASON_NAMES[r.value] for r in errors.RejectReason} == {
        r.name.lower() for r in errors.RejectReason}


@pytest.mark.parametrize("error, code", [
    (errors.NotFound("x"), grpc.StatusCode.NOT_FOUND),
    (errors.AlreadyExists("x"), grpc.StatusCode.ALREADY_EXISTS),
    (errors.InvalidArgument("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NonFinite("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (errors.Stale("x", 3), grpc.StatusCode.ABORTED),
    (errors.PeerRefused("x"), grpc.StatusCode.ABORTED),
    (errors.FailedPrecondition("x"), grpc.StatusCode.FAILED_PRECONDITION),
    (errors.PermissionDenied("x"), grpc.StatusCode.PERMISSION_DENIED),
    (errors.Cancelled("x"), grpc.StatusCode.CANCELLED),
    (errors.Timeout("x"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.SessionLost("x"), grpc.StatusCode.DATA_LOSS),
    (errors.ResourceExhausted("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (RuntimeError("x"), grpc.StatusCode.INTERNAL),
])
def test_every_domain_error_has_its_status_code(error, code):
    assert status_code_for(error) is code


def test_a_domain_error_inside_a_ray_error_keeps_its_code():
    class RayTaskError(Exception):
        def __init__(self, cause):
            super().__init__("wrapped")
            self.cause = cause

    assert status_code_for(RayTaskError(errors.Stale("old", 7))) is grpc.StatusCode.ABORTED


@pytest.mark.parametrize("error", [errors.NotFound("n"), errors.Stale("s", 9), errors.PeerRefused("p"),
                                   errors.InvalidArgument("i"), errors.FailedPrecondition("f"), errors.Timeout("t")])
def test_clock_refusals_cross_the_wire_as_the_same_error(error):
    back = clock_service._error_from_proto(clock_service._error_to_proto(error))
    assert type(back) is type(error) and str(back) == str(error)
    assert getattr(back, "current_version", None) == getattr(error, "current_version", None)


def test_tickets_cross_the_wire_unchanged():
    ticket = Ticket(ordinal=5, client_id="c", sequence=11, staleness=2, scale=1 / 3, closes_step=True, target_version=8)
    assert clock_service._ticket_from_proto(clock_service._ticket_to_proto(ticket)) == ticket
