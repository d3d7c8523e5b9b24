"""How the client reaches a server: one policy for every channel it opens.

The coordinator's channel and each shard's data-plane channel are opened by the same
:class:`Transport`, so they share one set of credentials (plaintext, TLS, mutual TLS), the
contract's channel options (:data:`optserve.protos.contract.CHANNEL_OPTIONS`, and
:data:`~optserve.protos.contract.RECONNECT_OPTIONS`: dials at most a second apart while a server
restarts; and on channels to other machines keepalive,
:data:`~optserve.protos.contract.KEEPALIVE_OPTIONS`: a connection to a host that vanished is found
dead within seconds and its calls end UNAVAILABLE, which the SDK retries on a fresh connection
after reading the shard map again) and the tenant token: a client interceptor
(:class:`BearerTokenInterceptor`) adds ``authorization: Bearer <token>`` to every call of every
kind, including the custom-serializer stream calls of the data plane. The token is kept by the
interceptor alone and never appears in a repr or an error message.

Arguments are checked here, before any channel is opened: errors are
:class:`~optserve.client.errors.InvalidArgumentError` naming the argument.
"""

from __future__ import annotations

import collections
import os
from typing import Optional, Union

import grpc

from optserve.client.errors import InvalidArgumentError
from optserve.protos import contract

TLSArg = Union[bool, str, "os.PathLike[str]"]
ClientCert = tuple[Union[str, "os.PathLike[str]"], Union[str, "os.PathLike[str]"]]

# gRPC's option naming the name to verify the server certificate against (instead of the dialled host).
_SERVER_NAME_OPTION = "grpc.ssl_target_name_override"
# Each channel dials connections of its own: gRPC Python otherwise shares one connection among all
# channels of a process to the same address with the same options, so the Clients of a process
# (threads each with its own Client, as a crowd of workers would be) would all take turns on
# one TCP connection to a shard, each Client's transfers held up by the others'.
_OWN_CONNECTIONS = (("grpc.use_local_subchannel_pool", 1),)
_REDACTED = "<redacted>"


class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
    grpc.ClientCallDetails,
):
    """A call's details with the metadata replaced (gRPC's own ``ClientCallDetails`` is abstract)."""


class BearerTokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``("authorization", "Bearer <token>")`` to the metadata of every call (all four kinds).

    The token is held here only; ``repr`` shows it redacted.
    """

    __slots__ = ("_header",)

    def __init__(self, token: str):
        self._header = ("authorization", f"Bearer {token}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(token={_REDACTED})"

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        metadata = tuple(details.metadata or ()) + (self._header,)
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


class LoopBearerTokenInterceptor(grpc.aio.StreamStreamClientInterceptor):
    """:class:`BearerTokenInterceptor` for the ``grpc.aio`` channels of the data plane's long-lived
    stream calls (:mod:`optserve.client._loop_call`); ``repr`` shows the token redacted."""

    __slots__ = ("_header",)

    def __init__(self, header: tuple[str, str]):
        self._header = header

    def __repr__(self) -> str:
        return f"{type(self).__name__}(token={_REDACTED})"

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        details = client_call_details
        metadata = grpc.aio.Metadata(*tuple(details.metadata or ()), self._header)
        return await continuation(grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                                             details.credentials, details.wait_for_ready),
                                  request_iterator)


class Transport:
    """Opens the client's channels: all with the same credentials, options and token.

    Args:
      token: the tenant token sent with every call as ``authorization: Bearer <token>``; a
        non-empty string of printable ASCII without whitespace. ``None``: no token.
      tls: ``False``: plaintext. ``True``: TLS, verifying the server with gRPC's default root
        certificates (its bundled set, or the file named by ``GRPC_DEFAULT_SSL_ROOTS_FILE_PATH``).
        A path (``str`` or ``os.PathLike``): TLS, verifying the server with that PEM CA bundle.
      client_cert: ``(cert_chain_path, private_key_path)`` (PEM) for mutual TLS; needs ``tls``.
      tls_server_name: the name to verify the server certificate against instead of the dialled
        host (e.g. when shards advertise IP addresses); needs ``tls``.

    Raises:
      InvalidArgumentError: naming the argument that is wrong (a missing file, a client
        certificate without TLS, a malformed token; the token itself is never quoted).
    """

    def __init__(self, *, token: Optional[str] = None, tls: TLSArg = False, client_cert: Optional[ClientCert] = None,
                 tls_server_name: Optional[str] = None):
        self._interceptor = None if token is None else BearerTokenInterceptor(_checked_token(token))
        self._tls = _checked_tls(tls)
        self._client_cert = _checked_client_cert(client_cert, self._tls)
        self._server_name = _checked_server_name(tls_server_name, self._tls)
        self._credentials = self._channel_credentials()
        self._options = contract.CHANNEL_OPTIONS + contract.RECONNECT_OPTIONS + _OWN_CONNECTIONS + (
            ((_SERVER_NAME_OPTION, self._server_name),) if self._server_name is not None else ())

    @property
    def secure(self) -> bool:
        """Whether channels use TLS."""
        return self._credentials is not None

    @property
    def has_token(self) -> bool:
        return self._interceptor is not None

    def open(self, address: str) -> grpc.Channel:
        """A new channel to ``address`` ("host:port"); with keepalive unless it is a loopback
        address (a server on this machine cannot vanish without its connections being reset)."""
        options = self._options + contract.keepalive_options(address)
        if self._credentials is None:
            channel = grpc.insecure_channel(address, options=options)
        else:
            channel = grpc.secure_channel(address, self._credentials, options=options)
        return channel if self._interceptor is None else grpc.intercept_channel(channel, self._interceptor)

    def open_on_loop(self, address: str) -> "grpc.aio.Channel":
        """Like :meth:`open`, a ``grpc.aio`` channel (for stream-stream calls only); called on the
        event loop it will serve (:mod:`optserve.client._loop`)."""
        options = self._options + contract.keepalive_options(address)
        interceptors = None if self._interceptor is None else [LoopBearerTokenInterceptor(self._interceptor._header)]
        if self._credentials is None:
            return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
        return grpc.aio.secure_channel(address, self._credentials, options=options, interceptors=interceptors)

    def describe(self) -> str:
        """The settings as keyword arguments, for reprs (the token shown redacted)."""
        tls = self._tls if isinstance(self._tls, bool) else os.fspath(self._tls)
        parts = [f"tls={tls!r}"]
        if self._client_cert is not None:
            parts.append(f"client_cert={tuple(os.fspath(p) for p in self._client_cert)!r}")
        if self._server_name is not None:
            parts.append(f"tls_server_name={self._server_name!r}")
        parts.append(f"token={_REDACTED if self.has_token else None}")
        return ", ".join(parts)

    def __repr__(self) -> str:
        return f"Transport({self.describe()})"

    def _channel_credentials(self) -> Optional[grpc.ChannelCredentials]:
        if self._tls is False:
            return None
        root = None if self._tls is True else _read_pem(self._tls, "tls")
        key = chain = None
        if self._client_cert is not None:
            chain = _read_pem(self._client_cert[0], "client_cert (certificate chain)")
            key = _read_pem(self._client_cert[1], "client_cert (private key)")
        return grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=chain)


def _checked_token(token) -> str:
    if not isinstance(token, str):
        raise InvalidArgumentError(f"token must be a str, got {type(token).__name__}")
    if not token:
        raise InvalidArgumentError("token must be a non-empty string")
    if not all("!" <= c <= "~" for c in token):  # printable ASCII, no whitespace: a valid header value
        raise InvalidArgumentError("token must be printable ASCII without whitespace or newlines")
    return token


def _is_path(value) -> bool:
    return isinstance(value, (str, os.PathLike))


def _checked_tls(tls) -> TLSArg:
    if isinstance(tls, bool):
        return tls
    if not _is_path(tls):
        raise InvalidArgumentError(f"tls must be False, True or the path of a PEM CA bundle, got {type(tls).__name__}")
    if not os.fspath(tls) or not os.path.isfile(tls):
        raise InvalidArgumentError(f"tls: no CA bundle file at {os.fspath(tls)!r}")
    return tls


def _checked_client_cert(client_cert, tls: TLSArg) -> Optional[ClientCert]:
    if client_cert is None:
        return None
    if (not isinstance(client_cert, (tuple, list)) or len(client_cert) != 2
            or not all(_is_path(p) for p in client_cert)):
        raise InvalidArgumentError("client_cert must be a (cert_chain_path, private_key_path) pair of paths")
    if tls is False:
        raise InvalidArgumentError("client_cert needs TLS: pass tls=True or tls=<CA bundle path> too")
    for what, path in zip(("certificate chain", "private key"), client_cert):
        if not os.fspath(path) or not os.path.isfile(path):
            raise InvalidArgumentError(f"client_cert: no {what} file at {os.fspath(path)!r}")
    return tuple(client_cert)


def _checked_server_name(name, tls: TLSArg) -> Optional[str]:
    if name is None:
        return None
    if not isinstance(name, str) or not name or any(c.isspace() for c in name):
        raise InvalidArgumentError(f"tls_server_name must be a non-empty host name, got {name!r}")
    if tls is False:
        raise InvalidArgumentError("tls_server_name needs TLS: pass tls=True or tls=<CA bundle path> too")
    return name


def _read_pem(path, what: str) -> bytes:
    """The file's bytes; refused unless it holds a PEM block (names the argument, never the contents)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise InvalidArgumentError(f"{what}: cannot read {os.fspath(path)!r}: {exc.strerror}") from None
    if b"-----BEGIN " not in data:
        raise InvalidArgumentError(f"{what}: {os.fspath(path)!r} is not a PEM file")
    return data
