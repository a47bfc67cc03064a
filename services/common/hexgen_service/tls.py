"""TLS for the mesh's gRPC links: credentials from PEM files, one place for every service.

A server given ``--tls-cert/--tls-key`` serves TLS only (a plaintext client fails its
handshake); with ``--tls-ca`` as well on a door that requires client certificates (the
workers' door) it takes only peers whose certificate that CA signed (mutual TLS). A client
given a CA file verifies the server against it; with a certificate and key of its own it
shows them (a worker). `hexgen_service.certs` makes a local CA and these files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from hexgen_flow.errors import ConfigError

__all__ = [
    "TLS_CA_ENV",
    "TlsFiles",
    "add_tls_options",
    "ca_from_env",
    "channel_credentials",
    "server_credentials",
]

TLS_CA_ENV = "HEXGEN_FLOW_TLS_CA"
"""Where clients and the CLI look for the CA file when no flag gives one."""


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


def _read(path: Path, flag: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read {path}: {exc.strerror}") from None
    if b"-----BEGIN" not in data:
        raise ConfigError(f"{flag}: {path} is not a PEM file")
    return data


def server_credentials(files: TlsFiles, *, require_client_cert: bool) -> grpc.ServerCredentials:
    """A server's TLS credentials; `require_client_cert` needs `files.ca` (mutual TLS)."""
    if files.cert is None or files.key is None:
        raise ConfigError("--tls-cert/--tls-key: a TLS server needs a certificate and its key")
    if require_client_cert and files.ca is None:
        raise ConfigError("--tls-ca: checking client certificates needs the CA that signs them")
    ca = _read(files.ca, "--tls-ca") if files.ca is not None else None
    return grpc.ssl_server_credentials(
        [(_read(files.key, "--tls-key"), _read(files.cert, "--tls-cert"))],
        root_certificates=ca if require_client_cert else None,
        require_client_auth=require_client_cert,
    )


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """A client's TLS credentials: the CA to trust (None: the system's), and its own
    certificate when it has one."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(files.ca, "--tls-ca") if files.ca is not None else None,
        private_key=_read(files.key, "--tls-key") if files.key is not None else None,
        certificate_chain=_read(files.cert, "--tls-cert") if files.cert is not None else None,
    )


def ca_from_env(ca: str | None) -> str | None:
    """`ca`, else ``$HEXGEN_FLOW_TLS_CA`` (empty counts as unset)."""
    return ca or os.environ.get(TLS_CA_ENV) or None


VERIFY_COORDINATOR = (
    "verify a TLS coordinator with this CA (default: $HEXGEN_FLOW_TLS_CA, else plaintext)"
)


def add_tls_options(parser: Any, *, serves: str | None, ca_help: str = VERIFY_COORDINATOR) -> None:
    """``--tls-cert``/``--tls-key`` (the certificate this process `serves` with, e.g.
    "TLS", "HTTPS"; or shows as a client when `serves` is None) and ``--tls-ca``, on an
    argparse parser or argument group; values are file paths or None."""
    shows = (
        f"serve {serves} with this certificate (PEM)"
        if serves
        else ("show this client certificate (PEM)")
    )
    parser.add_argument("--tls-cert", default=None, metavar="FILE", help=shows)
    parser.add_argument(
        "--tls-key", default=None, metavar="FILE", help="the private key of --tls-cert (PEM)"
    )
    parser.add_argument("--tls-ca", default=None, metavar="FILE", help=ca_help)
