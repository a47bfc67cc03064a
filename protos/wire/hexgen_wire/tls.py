"""A client's TLS for the mesh's gRPC links: the PEM files of one end of a link and the
channel credentials made of them (the servers' side: `hexgen_service.tls`).

A client given a CA file verifies the server against it; with a certificate and key of its
own it shows them (a worker).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from hexgen_flow.errors import ConfigError
from hexgen_wire.metadata import TLS_CA_ENV

__all__ = ["TLS_CA_ENV", "TlsFiles", "ca_from_env", "channel_credentials", "read_pem"]


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The PEM files of one end of a link; all None: plaintext."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None

    @property
    def enabled(self) -> bool:
        return self.cert is not None or self.ca is not None

    @staticmethod
    def from_flags(cert: str | None, key: str | None, ca: str | None) -> TlsFiles:
        """Check the flags' combination (a certificate needs its key); ConfigError if not."""
        if (cert is None) != (key is None):
            raise ConfigError("--tls-cert and --tls-key: give both or neither")
        return TlsFiles(
            Path(cert) if cert else None, Path(key) if key else None, Path(ca) if ca else None
        )


def read_pem(path: Path, flag: str) -> bytes:
    """The PEM file at `path`; ConfigError naming `flag` when unreadable or not PEM."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read {path}: {exc.strerror}") from None
    if b"-----BEGIN" not in data:
        raise ConfigError(f"{flag}: {path} is not a PEM file")
    return data


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """A client's TLS credentials: the CA to trust (None: the system's), and its own
    certificate when it has one."""
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(files.ca, "--tls-ca") if files.ca is not None else None,
        private_key=read_pem(files.key, "--tls-key") if files.key is not None else None,
        certificate_chain=read_pem(files.cert, "--tls-cert") if files.cert is not None else None,
    )


def ca_from_env(ca: str | None) -> str | None:
    """`ca`, else ``$HEXGEN_FLOW_TLS_CA`` (empty counts as unset)."""
    return ca or os.environ.get(TLS_CA_ENV) or None
