"""Errors of the Python client; the CLI prints them on one line and exits with code 2."""

from __future__ import annotations

import grpc

from hexgen_flow.errors import HexgenFlowError

__all__ = ["ClusterError", "CoordinatorError", "CoordinatorUnavailableError"]


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
    """Nothing answers at the coordinator's address (or it stopped answering)."""

    def __init__(self, address: str, details: str = "") -> None:
        super().__init__(
            address,
            grpc.StatusCode.UNAVAILABLE,
            details,
            f"cannot reach the coordinator at {address}: is `hexgen-flow up` running?",
        )


class ClusterError(HexgenFlowError):
    """A local cluster (`LocalCluster`, `hexgen-flow up`) that cannot start or run."""
