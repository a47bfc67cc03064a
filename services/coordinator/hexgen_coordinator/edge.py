"""The coordinator's service edge: every failure a client can cause or see becomes a gRPC
status with a one-line message, never UNKNOWN with a traceback.

- `statuses`: the async context manager every handler runs in; it maps the coordinator's
  exceptions to statuses (`InvalidFieldError` -> INVALID_ARGUMENT, `AlreadyExistsError` ->
  ALREADY_EXISTS, `OverloadedError` -> RESOURCE_EXHAUSTED with the ``retry-after-s``
  trailer, Redis unreachable -> UNAVAILABLE, anything unexpected -> INTERNAL with an
  incident id only, logged here with its traceback under that id). A client that left
  before its answer gets nothing and is no bug: gRPC refuses the send (ExecuteBatchError),
  and the handler ends as cancelled with a debug line.
- `add_services`: registers a servicer (hexgen_coordinator.service's
  `add_coordinator_services` registers the CoordinatorService and WorkerService with it)
  with request deserializers that answer undecodable bytes with INVALID_ARGUMENT (grpc's
  generated ``add_*_to_server`` decodes with ``FromString``, whose DecodeError grpc reports
  as UNKNOWN and logs with a traceback), and a request larger than its method takes
  (`request_limits`) with INVALID_ARGUMENT before it is parsed.

Bytes are bounded before they are read: each door's gRPC receive limit is the largest its
methods take (`door_limit`), so gRPC refuses anything larger from the message's length
prefix (RESOURCE_EXHAUSTED, "Received message larger than max") without reading it; a
request within it but beyond its own method's limit is refused unparsed; API keys are
checked from the metadata before the body is read (`hexgen_service.auth`); and the memory
of what was read is given back to the system (`hexgen_service.heap`, run by the server).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from hexgen_coordinator.config import CoordinatorConfig
from hexgen_coordinator.redis_retry import REDIS_UNAVAILABLE
from hexgen_service.errors import (
    RETRY_AFTER_KEY,
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidFieldError,
    OverloadedError,
    UnavailableError,
)

__all__ = [
    "add_services",
    "door_limit",
    "request_limits",
    "statuses",
]

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext

_REDIS_DOWN: tuple[type[Exception], ...] = (UnavailableError, *REDIS_UNAVAILABLE)


def _one_line(text: str) -> str:
    return " ".join(text.split())


_EXECUTE_BATCH_ERROR: type[Exception] | None = getattr(
    importlib.import_module("grpc._cython.cygrpc"), "ExecuteBatchError", None
)
_CLIENT_GONE: tuple[type[Exception], ...] = (
    (_EXECUTE_BATCH_ERROR,) if _EXECUTE_BATCH_ERROR is not None else ()
)
"""What gRPC raises on a send (a response, a status) to an RPC that is already over: the
client cancelled, its deadline passed or its connection closed while the handler still ran
(work shielded from cancellation, as the coordinator's Redis writes are). Not `UsageError`:
that is also what misuse of the API raises, which is a bug to log; a second send after a
refused one, which raised it, no longer happens (the handler ends at the first)."""


async def _abort(
    context: Context[Any, Any], code: grpc.StatusCode, details: str, **kw: Any
) -> None:
    try:
        await context.abort(code, details, **kw)
    except _CLIENT_GONE as exc:
        raise _gone(exc, code.name) from exc


def _gone(exc: Exception, what: str) -> asyncio.CancelledError:
    """The RPC is over, so nothing can reach its client: the handler ends as cancelled (gRPC
    ends a cancelled handler quietly), with a debug line instead of an error."""
    log.debug("the client left before its answer (%s): %s", what, _one_line(str(exc)))
    return asyncio.CancelledError()


@contextlib.asynccontextmanager
async def statuses(context: Context[Any, Any], field_prefix: str = "") -> AsyncIterator[None]:
    """Run a handler's body; turn what it raises into the matching status (see the module
    docstring). `field_prefix` is put before a field path (``query.`` in RunQuery). A
    client that left first gets nothing: the handler ends as cancelled, logged at debug
    level, not as a bug."""
    try:
        yield
    except InvalidFieldError as exc:
        await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, _one_line(field_prefix + str(exc)))
    except AlreadyExistsError as exc:
        await _abort(context, grpc.StatusCode.ALREADY_EXISTS, _one_line(field_prefix + str(exc)))
    except FailedPreconditionError as exc:
        await _abort(context, grpc.StatusCode.FAILED_PRECONDITION, _one_line(str(exc)))
    except OverloadedError as exc:
        await _abort(
            context,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            _one_line(str(exc)),
            trailing_metadata=((RETRY_AFTER_KEY, f"{exc.retry_after_s:.3f}"),),
        )
    except _REDIS_DOWN as exc:
        await _abort(
            context, grpc.StatusCode.UNAVAILABLE, _one_line(f"redis unavailable: {exc}, retry")
        )
    except (grpc.aio.AbortError, GeneratorExit):
        raise
    except _CLIENT_GONE as exc:  # a response written after the client left
        raise _gone(exc, "a response") from exc
    except Exception:
        # The client learns that it was a bug, and which log line has it; not the bug's text
        # (it can hold other tenants' data, paths, or what an attacker is probing for).
        incident = uuid.uuid4().hex[:12]
        log.exception("internal error %s", incident)
        await _abort(
            context,
            grpc.StatusCode.INTERNAL,
            f"internal error {incident}: a bug of the coordinator, logged there under that id",
        )


# ------------------------------------------------------------------ request sizes

SMALL_REQUEST_BYTES = 64 << 10
"""What a request without prompts takes (ids, a stage name, an alpha)."""
_ENVELOPE_BYTES = 64 << 10
"""Room beside the prompts for everything else in a request that carries them."""


def request_limits(config: CoordinatorConfig) -> dict[str, int]:
    """The largest request (serialized bytes) each method takes, by method name; a method
    not named takes `SMALL_REQUEST_BYTES`. Sized to the coordinator's own input limits: a
    submission to ``--max-request-bytes``, a call given to a session to its prompt and its
    chat messages and its options (``--max-prompt-bytes`` each), an expected workflow to
    its shape."""
    call = 3 * config.max_prompt_bytes + _ENVELOPE_BYTES
    return {
        "SubmitQuery": config.max_request_bytes,
        "RunQuery": config.max_request_bytes,
        "RunCall": call,
        "OpenWorkflow": 1 << 20,
        # a worker's reports: a finished call's text (--max-output-tokens of it)
        "Connect": config.max_request_bytes,
    }


def door_limit(config: CoordinatorConfig, *, clients: bool = True, workers: bool = True) -> int:
    """The receive limit of a door serving the clients' and/or the workers' methods: the
    largest any of them takes, plus gRPC's framing."""
    limits = request_limits(config)
    names = (["SubmitQuery", "RunQuery", "RunCall", "OpenWorkflow"] if clients else []) + (
        ["Connect"] if workers else []
    )
    return max(limits[n] for n in names) + 1024


# ------------------------------------------------------------------ safe deserializers


class _Undecodable:
    """What a safe deserializer returns for bytes it does not turn into a message: bytes that
    are no message of its type, or more than its method takes (never parsed)."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _safe(
    deserialize: Callable[[bytes], Any] | None, method: str, limit: int
) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def safe(data: bytes) -> Any:
        if len(data) > limit:
            return _Undecodable(
                f"{len(data)} bytes, more than {method} takes ({limit} bytes); not read"
            )
        try:
            return deserialize(data)
        except (DecodeError, ValueError, TypeError) as exc:
            return _Undecodable(
                f"undecodable message ({_one_line(str(exc)) or type(exc).__name__})"
            )

    return safe


async def _reject(context: Context[Any, Any], request: _Undecodable) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: {request.error}")


async def _checked(requests: AsyncIterator[Any], context: Context[Any, Any]) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, _Undecodable):
            await _reject(context, request)
        yield request


def _wrap(
    handler: grpc.RpcMethodHandler[Any, Any], method: str, limit: int
) -> grpc.RpcMethodHandler[Any, Any]:
    """The same handler, whose undecodable requests, and those over `limit` bytes, end in
    INVALID_ARGUMENT."""
    deserializer = _safe(handler.request_deserializer, method, limit)
    serializer = handler.response_serializer
    if handler.unary_unary is not None:
        inner_uu: Any = handler.unary_unary

        async def unary_unary(request: Any, context: Context[Any, Any]) -> Any:
            if isinstance(request, _Undecodable):
                await _reject(context, request)
            return await inner_uu(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, deserializer, serializer)
    if handler.unary_stream is not None:
        inner_us: Any = handler.unary_stream

        async def unary_stream(request: Any, context: Context[Any, Any]) -> AsyncIterator[Any]:
            if isinstance(request, _Undecodable):
                await _reject(context, request)
            async for response in inner_us(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(unary_stream, deserializer, serializer)
    if handler.stream_unary is not None:
        inner_su: Any = handler.stream_unary

        async def stream_unary(requests: AsyncIterator[Any], context: Context[Any, Any]) -> Any:
            return await inner_su(_checked(requests, context), context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, deserializer, serializer)
    inner_ss: Any = handler.stream_stream
    assert inner_ss is not None

    async def stream_stream(
        requests: AsyncIterator[Any], context: Context[Any, Any]
    ) -> AsyncIterator[Any]:
        async for response in inner_ss(_checked(requests, context), context):
            yield response

    return grpc.stream_stream_rpc_method_handler(stream_stream, deserializer, serializer)


class _Capture:
    """Stands in for the server in a generated ``add_*_to_server``: keeps its handlers."""

    def __init__(self) -> None:
        self.services: dict[str, dict[str, grpc.RpcMethodHandler[Any, Any]]] = {}

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        self.services[service] = handlers

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass  # the same handlers come through add_registered_method_handlers


def add_services(
    server: grpc.aio.Server,
    add_to_server: Callable[[Any, Any], None],
    servicer: object,
    limits: Mapping[str, int] | None = None,
) -> None:
    """``add_to_server(servicer, server)`` (a generated ``add_*_to_server``), with request
    deserializers that answer undecodable bytes with INVALID_ARGUMENT, and a request larger
    than its method's limit in `limits` (by method name; `SMALL_REQUEST_BYTES` for one not
    named) with INVALID_ARGUMENT before parsing it."""
    capture = _Capture()
    add_to_server(servicer, capture)
    if not capture.services:
        raise RuntimeError(f"{add_to_server.__name__} registered no service")
    limits = limits or {}
    for service, handlers in capture.services.items():
        wrapped = {
            name: _wrap(handler, name, limits.get(name, SMALL_REQUEST_BYTES))
            for name, handler in handlers.items()
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, wrapped),))
        register = getattr(server, "add_registered_method_handlers", None)
        if register is not None:
            register(service, wrapped)
