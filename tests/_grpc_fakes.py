"""Stand-ins for what grpc hands the SDK, for tests of the SDK's handling of them."""

from __future__ import annotations

import grpc


class FailedCall(grpc.RpcError):
    """A failed call as grpc raises it: a status code, details, trailing metadata (none by default)."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple = ()):
        super().__init__(details)
        self._code, self._details, self._trailing = code, details, trailing

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailing
