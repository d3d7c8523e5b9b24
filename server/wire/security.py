"""Who may call what: TLS credentials, tenant tokens, and the secret of the internal endpoints.

One interceptor (:class:`AuthInterceptor`) checks every call on the client-facing ports
(Control, each shard's ShardData): the ``authorization: Bearer <token>`` metadata must name a
tenant from the server's token file, else UNAUTHENTICATED. Servicers then ask
:meth:`TokenTable.tenant` which tenant a call belongs to. The internal endpoints (the session
clocks between shards) accept only the server's own processes: :class:`InternalSecretInterceptor`
requires the secret generated at start and handed to the shard actors, and, when the server runs
with TLS, they speak TLS with a certificate generated at start for them alone.

Tokens are never logged and never appear in an error or a status.
"""

from __future__ import annotations

import dataclasses
import datetime
import hmac
import ipaddress
import pathlib
import secrets
from typing import Optional

import grpc

from optserve.protos import contract
from optserve.server.domain.errors import InvalidArgument

AUTHORIZATION_KEY = "authorization"
INTERNAL_SECRET_KEY = "x-optserve-internal"
INTERNAL_SERVER_NAME = "optserve-internal"  # the internal certificate's name (peers verify against it)
_BEARER = "bearer "


@dataclasses.dataclass(frozen=True)
class TlsMaterial:
    """PEM bytes of a TLS identity: certificate chain and private key, and the CA that client
    certificates must chain to (``client_ca``; None: no client certificates asked for)."""

    cert: bytes
    key: bytes = dataclasses.field(repr=False)
    client_ca: Optional[bytes] = None

    @classmethod
    def from_files(cls, cert: str, key: str, client_ca: Optional[str] = None) -> "TlsMaterial":
        """Reads the files; errors name the flag."""

        def read(path: str, flag: str) -> bytes:
            try:
                return pathlib.Path(path).read_bytes()
            except OSError as exc:
                raise InvalidArgument(f"{flag}: cannot read {path!r}: {exc.strerror}") from None

        return cls(read(cert, "--tls-cert"), read(key, "--tls-key"),
                   read(client_ca, "--tls-client-ca") if client_ca else None)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.client_ca,
                                           require_client_auth=self.client_ca is not None)


class TokenTable:
    """Tenant tokens: ``token -> tenant name``.

    The file has one token per line, optionally followed by the tenant's name (``token name``);
    a token without a name is its own tenant, named ``tenant-<line>``. Blank lines and ``#``
    comments are skipped.
    """

    def __init__(self, tenants: dict[str, str]):
        if not tenants:
            raise InvalidArgument("--auth-tokens: the file holds no token")
        self._tenants = dict(tenants)

    @classmethod
    def from_file(cls, path: str) -> "TokenTable":
        try:
            lines = pathlib.Path(path).read_text().splitlines()
        except OSError as exc:
            raise InvalidArgument(f"--auth-tokens: cannot read {path!r}: {exc.strerror}") from None
        tenants: dict[str, str] = {}
        for number, line in enumerate(lines, 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) > 2:
                raise InvalidArgument(f"--auth-tokens: line {number}: expected 'token [name]'")
            if fields[0] in tenants:
                raise InvalidArgument(f"--auth-tokens: line {number}: a token is listed twice")
            tenants[fields[0]] = fields[1] if len(fields) == 2 else f"tenant-{number}"
        return cls(tenants)

    def lookup(self, metadata) -> Optional[str]:
        """The tenant of a call's metadata (``(key, value)`` pairs), or None."""
        for key, value in metadata or ():
            if key == AUTHORIZATION_KEY and isinstance(value, str) and value[:len(_BEARER)].lower() == _BEARER:
                token = value[len(_BEARER):].strip()
                for known, tenant in self._tenants.items():  # constant time per comparison
                    if hmac.compare_digest(known.encode(), token.encode()):
                        return tenant
        return None

    def tenant(self, context: grpc.ServicerContext) -> str:
        """The tenant of a call that passed :class:`AuthInterceptor`."""
        return self.lookup(context.invocation_metadata()) or ""


def _refusing_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str):
    """A handler of the same kind as ``handler`` that aborts every call with ``code``."""

    def abort(request, context):
        context.abort(code, message)

    if handler is None:
        return None
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(abort)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(abort)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(abort)
    return grpc.stream_stream_rpc_method_handler(abort)


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose token names no tenant (UNAUTHENTICATED), before any handler runs."""

    def __init__(self, tokens: TokenTable, open_services: tuple[str, ...] = ()):
        self._tokens = tokens
        self._open = tuple(f"/{service}/" for service in open_services)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler_call_details.method.startswith(self._open):
            return handler
        if self._tokens.lookup(handler_call_details.invocation_metadata) is None:
            return _refusing_handler(handler, grpc.StatusCode.UNAUTHENTICATED,
                                     "missing or unknown token: send 'authorization: Bearer <token>'")
        return handler


class InternalSecretInterceptor(grpc.ServerInterceptor):
    """Refuses every call that does not carry the server's internal secret (UNAUTHENTICATED)."""

    def __init__(self, secret: str):
        self._secret = secret.encode()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == INTERNAL_SECRET_KEY and hmac.compare_digest(str(value).encode(), self._secret):
                return handler
        return _refusing_handler(handler, grpc.StatusCode.UNAUTHENTICATED, "internal endpoint: not a server process")


@dataclasses.dataclass(frozen=True)
class InternalTrust:
    """How the server's own processes talk to each other: a shared secret, and (when the server
    runs with TLS) a certificate made at start for the internal endpoints, trusted only by them."""

    secret: str = dataclasses.field(repr=False)
    tls: Optional[TlsMaterial] = None

    @classmethod
    def generate(cls, with_tls: bool) -> "InternalTrust":
        return cls(secrets.token_hex(32), self_signed(INTERNAL_SERVER_NAME) if with_tls else None)

    def server_credentials(self) -> Optional[grpc.ServerCredentials]:
        return self.tls.server_credentials() if self.tls is not None else None

    def channel(self, address: str) -> grpc.Channel:
        """A channel to another server process's internal endpoint; it reconnects at most a
        second apart (a restarted home shard's peers vote again within a second of it serving)."""
        options = contract.RECONNECT_OPTIONS + contract.keepalive_options(address)  # a peer host may vanish
        if self.tls is None:
            return grpc.insecure_channel(address, options=options)
        credentials = grpc.ssl_channel_credentials(root_certificates=self.tls.cert)
        return grpc.secure_channel(address, credentials, options=options + (
            ("grpc.ssl_target_name_override", INTERNAL_SERVER_NAME),))

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((INTERNAL_SECRET_KEY, self.secret),)


def self_signed(name: str) -> TlsMaterial:
    """A fresh EC key and a self-signed certificate for ``name`` (and 127.0.0.1), valid 10 years."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=3650))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return TlsMaterial(cert.public_bytes(serialization.Encoding.PEM),
                       key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()))


@dataclasses.dataclass(frozen=True)
class ServerSecurity:
    """Everything a server process needs to secure its ports (picklable: handed to the shard actors).

    Attributes:
      tls: the server's TLS identity for the client-facing ports (None: plaintext).
      tokens: tenant tokens (None: no tenants; every caller is the one anonymous tenant "").
      internal: the internal endpoints' secret and TLS identity.
    """

    tls: Optional[TlsMaterial]
    tokens: Optional[TokenTable]
    internal: InternalTrust

    @classmethod
    def from_config(cls, config) -> "ServerSecurity":
        """Reads the files a :class:`~optserve.server.domain.config.ServerConfig` names; makes the
        internal secret (and certificate, with TLS). Errors name the flag."""
        tls = TlsMaterial.from_files(config.tls_cert, config.tls_key, config.tls_client_ca) if config.tls_cert else None
        tokens = TokenTable.from_file(config.auth_tokens) if config.auth_tokens else None
        return cls(tls, tokens, InternalTrust.generate(with_tls=tls is not None))

    def interceptors(self, open_services: tuple[str, ...] = ()) -> list[grpc.ServerInterceptor]:
        """For a client-facing gRPC server: the token check, if the server has tenants."""
        return [AuthInterceptor(self.tokens, open_services)] if self.tokens is not None else []

    def add_port(self, server: grpc.Server, address: str) -> int:
        """Binds ``address`` on a client-facing server, with TLS when configured; returns the port."""
        if self.tls is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, self.tls.server_credentials())
