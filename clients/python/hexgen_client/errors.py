"""Errors of the Python client; the CLI prints them on one line and exits with code 2."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from hexgen_flow.errors import HexgenFlowError

__all__ = [
    "CoordinatorError",
    "CoordinatorOverloadedError",
    "CoordinatorUnavailableError",
    "ShardRedirectLoopError",
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
    answered UNAVAILABLE (its Redis is unreachable, or, sharded, the query's shard has no
    coordinator during a takeover): worth retrying. `message` replaces the one-line
    explanation (several coordinators tried: `hexgen_client.routing`)."""

    def __init__(
        self,
        address: str,
        details: str = "",
        *,
        answered: bool = False,
        message: str | None = None,
    ) -> None:
        self.answered = answered or details.startswith("redis unavailable")
        """Whether the coordinator itself answered UNAVAILABLE (it runs, but cannot serve
        this now), rather than nothing answering at its address."""
        super().__init__(
            address,
            grpc.StatusCode.UNAVAILABLE,
            details,
            message if message is not None else _unavailable_message(address, details, answered),
        )


def _unavailable_message(address: str, details: str, answered: bool) -> str:
    if answered or details.startswith("redis unavailable"):
        return f"coordinator at {address}: UNAVAILABLE: {details}"
    if _tls_trouble(details):
        return (
            f"no connection to the coordinator at {address}: it closed the connection or "
            "the TLS handshake failed (a plaintext client at a TLS port, or a CA that did "
            f"not sign its certificate: check --tls-ca or $HEXGEN_FLOW_TLS_CA): {details}"
        )
    return f"cannot reach the coordinator at {address}: is `hexgen-flow up` running?"


def _tls_trouble(details: str) -> bool:
    # A TLS server closes a plaintext client's connection at once ("Socket closed").
    lowered = details.lower()
    return any(w in lowered for w in ("ssl", "tls", "handshake", "certificate", "socket closed"))


class ShardRedirectLoopError(CoordinatorError):
    """Coordinators redirected a query's RPC in a circle, or further than a client follows:
    they disagree on who owns its shard (not the same ``--shards``, or a stale lease)."""

    def __init__(self, query_id: str, hops: Sequence[str], details: str) -> None:
        self.hops = tuple(hops)
        """The addresses it was sent to, in order, then the owner the last one named."""
        super().__init__(
            self.hops[-1],
            grpc.StatusCode.FAILED_PRECONDITION,
            details,
            f"query {query_id!r}: the coordinators keep redirecting it "
            f"({' -> '.join(self.hops)}); do they all run with the same --shards? "
            f"Last answer: {details}",
        )


class CoordinatorOverloadedError(CoordinatorError):
    """The coordinator refused a submission (RESOURCE_EXHAUSTED: admission control, or a
    limit on running queries); `retry_after_s` is its hint (wall seconds), None without one."""

    def __init__(self, address: str, details: str, retry_after_s: float | None) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(address, grpc.StatusCode.RESOURCE_EXHAUSTED, details)
