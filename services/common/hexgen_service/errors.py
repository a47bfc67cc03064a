"""Bad requests at the service edge: a gRPC status and a message naming the field."""

from __future__ import annotations

import grpc

from hexgen_wire.metadata import RETRY_AFTER_KEY, SHARD_OWNER_KEY  # the wire contract

__all__ = [
    "RETRY_AFTER_KEY",
    "SHARD_OWNER_KEY",
    "AlreadyExistsError",
    "FailedPreconditionError",
    "InvalidFieldError",
    "OverloadedError",
    "UnavailableError",
    "abort_invalid",
]


class InvalidFieldError(ValueError):
    """A request field that cannot be accepted; `field` is its path, e.g.
    ``workflow.stages[2].calls[0].input_tokens``."""

    def __init__(self, field: str, message: str, *, reason: str = "invalid") -> None:
        self.field = field
        self.reason = reason
        """Why, in a word, for the metrics (admission's refusals: ``infeasible``,
        ``too_large``; ``invalid`` otherwise)."""
        super().__init__(f"{field}: {message}")


class AlreadyExistsError(ValueError):
    """An id resubmitted with different content (ALREADY_EXISTS at the edge)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class OverloadedError(RuntimeError):
    """Admission control refused a request (RESOURCE_EXHAUSTED at the edge); the client may
    retry after `retry_after_s` wall seconds (sent as the ``retry-after-s`` trailer)."""

    def __init__(self, message: str, retry_after_s: float, *, reason: str = "overloaded") -> None:
        self.retry_after_s = retry_after_s
        self.reason = reason
        """Why, in a word, for the metrics (``hexgen_flow_queries_rejected_total``'s
        ``reason``: overloaded, running_limit, tenant_limit, rate_limit, quota,
        redis_memory)."""
        super().__init__(message)


class FailedPreconditionError(RuntimeError):
    """The request is valid but the state it acts on does not allow it now (a call for a
    closed or ended workflow session): FAILED_PRECONDITION at the edge."""


class UnavailableError(RuntimeError):
    """A dependency (Redis) is unreachable for now (UNAVAILABLE at the edge: retryable)."""


async def abort_invalid(
    context: grpc.aio.ServicerContext[object, object], error: InvalidFieldError
) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
