"""Wire layer of the coordinator: the Control gRPC service (decode, one coordinator call, encode)."""

from __future__ import annotations

import logging
from typing import Optional

import grpc

from optserve.protos.optserve.v1 import control_pb2, control_pb2_grpc
from optserve.server.domain.sessions import Coordinator
from optserve.server.wire.convert import (attach_expectation_from_proto, series_to_proto, server_status_to_proto,
                                          session_config_from_proto, session_info_to_proto, status_to_proto)
from optserve.server.wire.errors import add_unary_service, grpc_errors
from optserve.server.wire.security import TokenTable


class ControlServicer(control_pb2_grpc.ControlServicer):
    """Control on the coordinator. ``tokens``: the server's tenant tokens (None: no tenants)."""

    refusal_log_level = logging.INFO  # a refused create / attach / close is one INFO line (wire.errors)

    def __init__(self, coordinator: Coordinator, tokens: Optional[TokenTable] = None):
        self._coordinator = coordinator
        self._tokens = tokens

    def _tenant(self, context) -> str:
        return self._tokens.tenant(context) if self._tokens is not None else ""

    @grpc_errors
    def CreateSession(self, request, context):
        tenant = self._tenant(context)
        config = session_config_from_proto(request.config, self._coordinator.limits)
        record = self._coordinator.create_session(config, tenant, request.client_id)
        try:
            return control_pb2.CreateSessionResponse(session=session_info_to_proto(record))
        except BaseException:  # a create that fails leaves nothing behind
            self._coordinator.close_session(config.name, tenant)
            raise

    @grpc_errors
    def GetSession(self, request, context):
        record = self._coordinator.get_session(request.name, self._tenant(context),
                                               attach_expectation_from_proto(request, self._coordinator.limits))
        return control_pb2.GetSessionResponse(session=session_info_to_proto(record))

    @grpc_errors
    def ListSessions(self, request, context):
        return control_pb2.ListSessionsResponse(names=self._coordinator.list_sessions(self._tenant(context)))

    @grpc_errors
    def CloseSession(self, request, context):
        self._coordinator.close_session(request.name, self._tenant(context))
        return control_pb2.CloseSessionResponse()

    @grpc_errors
    def GetStatus(self, request, context):
        return status_to_proto(self._coordinator.status(request.name, self._tenant(context)))

    @grpc_errors
    def GetServerStatus(self, request, context):
        return server_status_to_proto(self._coordinator.shards(
            self._tokens.tenant(context) if self._tokens is not None else None))

    @grpc_errors
    def GetSeries(self, request, context):
        return series_to_proto(self._coordinator.series(request.name, self._tenant(context)))


def add_to_server(servicer: ControlServicer, server: grpc.Server) -> None:
    """Serves Control (undecodable requests refused INVALID_ARGUMENT, see :func:`add_unary_service`)."""
    add_unary_service(server, control_pb2, "Control", servicer)
