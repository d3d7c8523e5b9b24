"""Wire layer of the coordinator: the Control gRPC service."""

from __future__ import annotations

from optserve.protos.optserve.v1 import control_pb2, control_pb2_grpc
from optserve.server.coordinator import Coordinator
from optserve.server.errors import grpc_errors
from optserve.server.wire import session_config_from_proto, session_info_to_proto, status_to_proto


class ControlServicer(control_pb2_grpc.ControlServicer):
    def __init__(self, coordinator: Coordinator):
        self._coordinator = coordinator

    @grpc_errors
    def CreateSession(self, request, context):
        record = self._coordinator.create_session(session_config_from_proto(request.config))
        return control_pb2.CreateSessionResponse(session=session_info_to_proto(record))

    @grpc_errors
    def GetSession(self, request, context):
        return control_pb2.GetSessionResponse(session=session_info_to_proto(self._coordinator.get_session(request.name)))

    @grpc_errors
    def ListSessions(self, request, context):
        return control_pb2.ListSessionsResponse(names=self._coordinator.list_sessions())

    @grpc_errors
    def CloseSession(self, request, context):
        self._coordinator.close_session(request.name)
        return control_pb2.CloseSessionResponse()

    @grpc_errors
    def GetStatus(self, request, context):
        return status_to_proto(*self._coordinator.status(request.name))
