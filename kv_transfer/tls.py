"""Mutual TLS for the ``grpc`` KV transport: the material every worker of a cluster shares.

One CA, one certificate and its key make the cluster's identity: each KV server presents the
certificate and asks every client for one signed by the CA; each client checks the server's
against the CA, under one server name (``server_name``, the certificate's DNS name), since
workers are reached by address and a certificate made ahead of time cannot name them all.
The material comes from files (a cluster's own CA, e.g. Kubernetes secrets) or is made once per
cluster when the config is built (``generate``: an ECDSA P-256 CA and a leaf signed by it),
and travels to the workers with their options, as the cluster token does.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_SERVER_NAME = "tandem-kv"


@dataclass(frozen=True)
class TLSMaterial:
    """PEM bytes: the CA that signs the cluster's certificates, the certificate, its key."""

    ca: bytes
    cert: bytes
    key: bytes = field(repr=False)
    server_name: str = DEFAULT_SERVER_NAME

    @classmethod
    def from_files(
        cls, ca_file: str, cert_file: str, key_file: str, server_name: str = DEFAULT_SERVER_NAME
    ) -> TLSMaterial:
        return cls(
            Path(ca_file).read_bytes(),
            Path(cert_file).read_bytes(),
            Path(key_file).read_bytes(),
            server_name,
        )

    @classmethod
    def generate(
        cls,
        server_name: str = DEFAULT_SERVER_NAME,
        valid_days: int = 3650,
        ip_addresses: tuple[str, ...] = (),
    ) -> TLSMaterial:
        """A fresh CA and a certificate for ``server_name`` (and ``ip_addresses``) signed by
        it (needs the ``cryptography`` package). The CA's key is dropped: nothing else can be
        signed."""
        ca_cert, key, cert = _make(server_name, valid_days, ip_addresses)
        return cls(ca_cert, cert, key, server_name)

    def server_credentials(self) -> Any:
        import grpc

        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> Any:
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


def _make(
    server_name: str, valid_days: int, ip_addresses: tuple[str, ...]
) -> tuple[bytes, bytes, bytes]:
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=valid_days)

    def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tandem cluster CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, server_name)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName(server_name),
                    *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses),
                ]
            ),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    encoding = serialization.Encoding.PEM
    return ca_cert.public_bytes(encoding), pem_key(key), cert.public_bytes(encoding)
