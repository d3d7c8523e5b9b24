"""A throwaway PKI for TLS tests: one CA, a server certificate and a client certificate it signed.

    pki = make_pki(tmp_path)
    grpc.ssl_server_credentials([(pki.server_key.read_bytes(), pki.server_cert.read_bytes())],
                                root_certificates=pki.ca.read_bytes(), require_client_auth=True)
    Client(address, tls=pki.ca, client_cert=(pki.client_cert, pki.client_key))

The server certificate is valid for ``127.0.0.1`` and ``localhost`` (so loopback tests verify it
without ``tls_server_name``), the client certificate for client authentication only. Keys are
ECDSA P-256 (fast to generate), written as unencrypted PKCS#8 PEM. Uses ``cryptography``.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import pathlib
from typing import Optional, Union

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclasses.dataclass(frozen=True)
class PKI:
    """Paths of the PEM files :func:`make_pki` wrote."""

    ca: pathlib.Path  # the CA certificate (the bundle clients and servers verify peers with)
    server_cert: pathlib.Path  # SAN: IP 127.0.0.1, DNS localhost; serverAuth
    server_key: pathlib.Path
    client_cert: pathlib.Path  # CN optserve-test-client; clientAuth
    client_key: pathlib.Path


def make_pki(tmp_dir: Union[str, pathlib.Path], *, days: int = 7) -> PKI:
    """Writes a fresh CA, server certificate and client certificate (with their keys) into ``tmp_dir``."""
    directory = pathlib.Path(tmp_dir)
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    validity = (now - datetime.timedelta(hours=1), now + datetime.timedelta(days=days))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("optserve-test-ca")
    ca_cert = (
        _builder(ca_name, ca_name, ca_key.public_key(), validity)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(common_name: str, usage, san: Optional[x509.SubjectAlternativeName]):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            _builder(_name(common_name), ca_name, key.public_key(), validity)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        )
        if san is not None:
            builder = builder.add_extension(san, critical=False)
        return key, builder.sign(ca_key, hashes.SHA256())

    server_san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")])
    server_key, server_cert = leaf("localhost", ExtendedKeyUsageOID.SERVER_AUTH, server_san)
    client_key, client_cert = leaf("optserve-test-client", ExtendedKeyUsageOID.CLIENT_AUTH, None)

    pki = PKI(ca=directory / "ca.pem", server_cert=directory / "server.pem", server_key=directory / "server.key",
              client_cert=directory / "client.pem", client_key=directory / "client.key")
    _write_cert(pki.ca, ca_cert)
    _write_cert(pki.server_cert, server_cert)
    _write_key(pki.server_key, server_key)
    _write_cert(pki.client_cert, client_cert)
    _write_key(pki.client_key, client_key)
    return pki


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: x509.Name, issuer: x509.Name, public_key, validity) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(validity[0])
        .not_valid_after(validity[1])
    )


def _write_cert(path: pathlib.Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _write_key(path: pathlib.Path, key) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)
