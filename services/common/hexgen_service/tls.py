"""TLS for the mesh's gRPC links: credentials from PEM files, one place for every service.

A server given ``--tls-cert/--tls-key`` serves TLS only (a plaintext client fails its
handshake); with ``--tls-ca`` as well on a door that requires client certificates (the
workers' door) it takes only peers whose certificate that CA signed (mutual TLS). A client
given a CA file verifies the server against it; with a certificate and key of its own it
shows them (a worker). `hexgen_service.certs` makes a local CA and these files. The
client's side (`TlsFiles`, `channel_credentials`, `ca_from_env`) is the wire contract's,
`hexgen_wire.tls`, which the SDK shares; it is re-exported here for the services.
"""

from __future__ import annotations

from typing import Any

import grpc

from hexgen_flow.errors import ConfigError
from hexgen_wire.tls import TLS_CA_ENV, TlsFiles, ca_from_env, channel_credentials, read_pem

__all__ = [
    "TLS_CA_ENV",
    "TlsFiles",
    "add_tls_options",
    "ca_from_env",
    "channel_credentials",
    "server_credentials",
]


def server_credentials(files: TlsFiles, *, require_client_cert: bool) -> grpc.ServerCredentials:
    """A server's TLS credentials; `require_client_cert` needs `files.ca` (mutual TLS)."""
    if files.cert is None or files.key is None:
        raise ConfigError("--tls-cert/--tls-key: a TLS server needs a certificate and its key")
    if require_client_cert and files.ca is None:
        raise ConfigError("--tls-ca: checking client certificates needs the CA that signs them")
    ca = read_pem(files.ca, "--tls-ca") if files.ca is not None else None
    return grpc.ssl_server_credentials(
        [(read_pem(files.key, "--tls-key"), read_pem(files.cert, "--tls-cert"))],
        root_certificates=ca if require_client_cert else None,
        require_client_auth=require_client_cert,
    )


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
