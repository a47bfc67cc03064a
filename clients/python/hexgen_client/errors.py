"""Errors of the Python client; the CLI prints them on one line and exits with code 2."""

from __future__ import annotations

import grpc

from hexgen_flow.errors import HexgenFlowError

__all__ = [
    "ClusterError",
    "CoordinatorError",
    "CoordinatorOverloadedError",
    "CoordinatorUnavailableError",
]


class CoordinatorError(HexgenFlowError):
    """The coordinator answered an RPC with an error status."""

    def __init__(
        self, address: str, code: grpc.StatusCode, details: str, message: str | None = None
    ) -> None:
        self.address = address
        self.code = code
        """The gRPC status code."""
        self.details = details
        """The server's (or grpc's) description of the error."""
        super().__init__(message or f"coordinator at {address}: {code.name}: {details}")


class CoordinatorUnavailableError(CoordinatorError):
    """Nothing answers at the coordinator's address (or it stopped answering), or it
    answered UNAVAILABLE (its Redis is unreachable): worth retrying."""

    def __init__(self, address: str, details: str = "") -> None:
        if details.startswith("redis unavailable"):
            message = f"coordinator at {address}: UNAVAILABLE: {details}"
        elif _tls_trouble(details):
            message = (
                f"no connection to the coordinator at {address}: it closed the connection or "
                "the TLS handshake failed (a plaintext client at a TLS port, or a CA that did "
                f"not sign its certificate: check --tls-ca or $HEXGEN_FLOW_TLS_CA): {details}"
            )
        else:
            message = f"cannot reach the coordinator at {address}: is `hexgen-flow up` running?"
        super().__init__(address, grpc.StatusCode.UNAVAILABLE, details, message)


def _tls_trouble(details: str) -> bool:
    # A TLS server closes a plaintext client's connection at once ("Socket closed").
    lowered = details.lower()
    return any(w in lowered for w in ("ssl", "tls", "handshake", "certificate", "socket closed"))


class CoordinatorOverloadedError(CoordinatorError):
    """The coordinator refused a submission (RESOURCE_EXHAUSTED: admission control, or a
    limit on running queries); `retry_after_s` is its hint (wall seconds), None without one."""

    def __init__(self, address: str, details: str, retry_after_s: float | None) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(address, grpc.StatusCode.RESOURCE_EXHAUSTED, details)


class ClusterError(HexgenFlowError):
    """A local cluster (`LocalCluster`, `hexgen-flow up`) that cannot start or run."""
