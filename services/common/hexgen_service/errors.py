"""Bad requests at the service edge: a gRPC status and a message naming the field."""

from __future__ import annotations

import grpc

__all__ = ["InvalidFieldError", "abort_invalid"]


class InvalidFieldError(ValueError):
    """A request field that cannot be accepted; `field` is its path, e.g.
    ``workflow.stages[2].calls[0].input_tokens``."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


async def abort_invalid(
    context: grpc.aio.ServicerContext[object, object], error: InvalidFieldError
) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
