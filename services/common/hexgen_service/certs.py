"""A local certificate authority and the mesh's certificates, for `hexgen-flow auth init`
and `hexgen-flow up --secure`.

One CA signs a server certificate (every service's listening side: the names and addresses
a client dials are in its subject alternative names) and a worker client certificate (the
workers' door takes only that CA's client certificates). Keys are ECDSA P-256; private keys
are written mode 0600. Certificates last a year by default; the CA ten.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["DEFAULT_SERVER_NAMES", "CertificateAuthority", "write_private"]

DEFAULT_SERVER_NAMES = (
    "localhost",
    "127.0.0.1",
    "::1",
    "coordinator",
    "tuner",
    "gateway",
)
"""Who the server certificate is valid for: loopback, and compose's service names."""


def write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path`, readable by its owner only (also when it existed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(path, 0o600)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _san(names: Sequence[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


@dataclass
class CertificateAuthority:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @staticmethod
    def create(common_name: str = "hexgen-flow local CA", days: int = 3650) -> CertificateAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
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
            .sign(key, hashes.SHA256())
        )
        return CertificateAuthority(key, cert)

    @staticmethod
    def load(cert_path: Path, key_path: Path) -> CertificateAuthority:
        cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
        key = serialization.load_pem_private_key(Path(key_path).read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{key_path}: not an EC private key")
        return CertificateAuthority(key, cert)

    def save(self, cert_path: Path, key_path: Path) -> None:
        Path(cert_path).write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        write_private(Path(key_path), _key_pem(self.key))

    def issue(
        self,
        common_name: str,
        *,
        server_names: Sequence[str] = (),
        client: bool = False,
        days: int = 365,
        not_before: datetime.datetime | None = None,
    ) -> tuple[bytes, bytes]:
        """A certificate (PEM) and its private key (PEM) for `common_name`: a server
        certificate valid for `server_names`, a client certificate if `client`."""
        key = ec.generate_private_key(ec.SECP256R1())
        start = not_before or datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
        usages = [ExtendedKeyUsageOID.SERVER_AUTH] if server_names else []
        if client:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(start + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        )
        if server_names:
            builder = builder.add_extension(_san(server_names), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)

    def write_issued(
        self,
        cert_path: Path,
        key_path: Path,
        common_name: str,
        *,
        server_names: Sequence[str] = (),
        client: bool = False,
    ) -> None:
        """`issue`, written to `cert_path` and `key_path` (the key mode 0600)."""
        cert, key = self.issue(common_name, server_names=server_names, client=client)
        Path(cert_path).write_bytes(cert)
        write_private(Path(key_path), key)
