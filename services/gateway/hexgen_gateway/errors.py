"""Errors as OpenAI's API answers them: ``{"error": {"message", "type", "param", "code"}}``
with the matching HTTP status, and the coordinator's gRPC statuses mapped onto them.

| coordinator | HTTP | type |
|---|---|---|
| INVALID_ARGUMENT (the field named) | 400 | invalid_request_error (param: the request's part) |
| UNAUTHENTICATED (no key, or a bad one) | 401 + WWW-Authenticate | invalid_request_error |
| PERMISSION_DENIED (the key's role may not) | 403 | invalid_request_error |
| NOT_FOUND | 404 | invalid_request_error |
| ALREADY_EXISTS | 409 | invalid_request_error |
| RESOURCE_EXHAUSTED (``retry-after-s``) | 429 + Retry-After | rate_limit_error |
| UNAVAILABLE, nothing answers (at any coordinator shard) | 503 | service_unavailable |
| coordinator shards redirecting in a circle (`ShardRedirectLoopError`) | 502 | server_error |
| DEADLINE_EXCEEDED | 504 | timeout |
| anything else | 500 | server_error |

A 401's code is ``invalid_api_key`` and a 403's ``permission_denied`` (the OpenAI SDKs raise
`AuthenticationError` and `PermissionDeniedError` for them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import grpc

from hexgen_client.errors import (
    CoordinatorError,
    CoordinatorOverloadedError,
    ShardRedirectLoopError,
)

__all__ = ["OpenAIError", "bad_request", "from_coordinator"]


class OpenAIError(Exception):
    """An answer in OpenAI's error shape: `status` (HTTP), `type`, `param`, `code`, and
    extra response `headers` (Retry-After)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def retry_after_headers(seconds: float | None) -> dict[str, str]:
    """``Retry-After`` (whole seconds, rounded up, as HTTP wants) and ``retry-after-ms``
    (which the OpenAI SDKs read first) from the coordinator's hint."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return {}
    return {
        "Retry-After": str(max(1, math.ceil(seconds))),
        "retry-after-ms": str(round(seconds * 1000)),
    }


def from_coordinator(exc: CoordinatorError, param_of: Mapping[str, str]) -> OpenAIError:
    """The OpenAI error for a coordinator's error. `param_of` maps the coordinator's field
    (the path before the first ``": "`` of an INVALID_ARGUMENT's details, e.g.
    ``query.workflow.stages[0].calls[0].output_tokens``) by its last part (``output_tokens``)
    or whole to the request's own name for it (``max_tokens``), which the error's param and
    message then name."""
    details = exc.details
    if isinstance(exc, CoordinatorOverloadedError):
        return OpenAIError(
            429,
            f"the cluster refused the request: {details}",
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers=retry_after_headers(exc.retry_after_s),
        )
    if isinstance(exc, ShardRedirectLoopError):  # the coordinators disagree on its owner
        return OpenAIError(502, str(exc), type="server_error", code="shard_redirect_loop")
    code = exc.code
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return OpenAIError(
            401,
            details,
            code="invalid_api_key",
            headers={"WWW-Authenticate": 'Bearer realm="hexgen-flow"'},
        )
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return OpenAIError(403, details, code="permission_denied")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field, _, why = details.partition(": ") if ": " in details else ("", "", details)
        if not field:
            return bad_request(details, None)
        param = _param(field, param_of)
        # The message names the request's field too, not the coordinator's
        # (``max_tokens: ...``, not ``expected.stages[0].calls[0].output_tokens: ...``).
        return bad_request(f"{param}: {why}", param)
    if code == grpc.StatusCode.ALREADY_EXISTS:
        return OpenAIError(409, details, code="conflict")
    if code == grpc.StatusCode.FAILED_PRECONDITION:  # e.g. a call for a workflow that ended
        return OpenAIError(409, details, code="workflow_ended")
    if code == grpc.StatusCode.NOT_FOUND:
        return OpenAIError(404, details, code="not_found")
    if code == grpc.StatusCode.UNAVAILABLE:
        return OpenAIError(503, str(exc), type="service_unavailable", code="unavailable")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return OpenAIError(504, str(exc), type="timeout", code="timeout")
    return OpenAIError(500, f"coordinator: {code.name}: {details}", type="server_error")


def _param(field: str, param_of: Mapping[str, str]) -> str:
    if field in param_of:
        return param_of[field]
    last = field.rsplit(".", 1)[-1].split("[", 1)[0]
    return param_of.get(last, field)
