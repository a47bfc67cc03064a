"""OpenTelemetry tracing for the services.

`setup_tracing` installs a tracer provider that exports over OTLP/gRPC when
``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (the docker-compose cluster points it at the
collector), and records nothing otherwise: while no span processor is installed, spans
are sampled out (`_WhileExported`). They keep valid ids (log lines carry their trace id,
``traceparent`` still travels), but nobody pays for attributes and events that no one
would read; on the coordinator that was a few per cent of its CPU per completion. (So give
every service the endpoint, as docker-compose does and `hexgen-flow up` passes it on from
its environment: a worker that exports under a coordinator that does not sees unsampled
parents, and the default parent-based sampler records nothing under them.)

The gRPC interceptors trace every RPC; the coordinator adds a span per workflow, stage and
call, and passes the call's context to the worker as a W3C ``traceparent`` string inside
the dispatch message. A workflow is one trace: its root span's traceparent is stored with
it (`hexgen_service.redis_schema.F.TRACE`) and given in QueryInfo and RunCall's first
answer, and the gateway parents each later request of the workflow to it, whatever
``traceparent`` the client sends (`hexgen_gateway.app`). The spans of a call follow
OpenTelemetry's GenAI conventions (`hexgen_service.genai`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, SynchronousMultiSpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = [
    "LOG_FORMAT",
    "client_interceptors",
    "context_from_traceparent",
    "propagating_interceptors",
    "server_interceptors",
    "setup_logging",
    "setup_tracing",
    "traceparent_of",
    "tracer_provider",
]

_PROPAGATOR = TraceContextTextMapPropagator()
_TRACEPARENT = "traceparent"
_configured = False


class _Processors(SynchronousMultiSpanProcessor):
    """The provider's span processors, knowing whether there is any."""

    exporting = False

    def add_span_processor(self, span_processor: SpanProcessor) -> None:
        super().add_span_processor(span_processor)
        self.exporting = True


class _WhileExported(Sampler):
    """The configured sampler (``OTEL_TRACES_SAMPLER``; parent-based always-on by default)
    once a span processor is installed; until then every span is dropped (not recorded)."""

    def __init__(self, processors: _Processors, sampler: Sampler) -> None:
        self._processors = processors
        self._sampler = sampler

    def should_sample(self, *args: Any, **kwargs: Any) -> SamplingResult:
        if not self._processors.exporting:
            return SamplingResult(Decision.DROP)
        return self._sampler.should_sample(*args, **kwargs)

    def get_description(self) -> str:
        return f"WhileExported{{{self._sampler.get_description()}}}"


def tracer_provider(service_name: str) -> TracerProvider:
    """A tracer provider for `service_name` that records spans only once a span processor
    is added to it (then the sampler ``OTEL_TRACES_SAMPLER`` names decides)."""
    configured = TracerProvider(shutdown_on_exit=False).sampler  # from the environment
    processors = _Processors()  # type: ignore[no-untyped-call]  # untyped SDK __init__
    return TracerProvider(
        sampler=_WhileExported(processors, configured),
        resource=Resource.create({"service.name": service_name}),
        active_span_processor=processors,
    )


def setup_tracing(service_name: str) -> trace.Tracer:
    """Configure tracing for this process once; return the service's tracer."""
    global _configured  # noqa: PLW0603 - one provider per process, set up at start
    if not _configured:
        provider = tracer_provider(service_name)
        if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # noqa: PLC0415
                OTLPSpanExporter,
            )

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
        _configured = True
    return trace.get_tracer(service_name)


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [trace %(trace_id)s] %(message)s"
"""Every service's log line: the trace id of the span current when it was logged ("-" for
none), so a line leads to its workflow's trace."""


class _TraceIds(logging.Filter):
    """Puts the current span's trace id on every record (``%(trace_id)s``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = trace.get_current_span().get_span_context()
        record.trace_id = format(context.trace_id, "032x") if context.is_valid else "-"
        return True


class _DetachNoise(logging.Filter):
    """Drops OpenTelemetry's "Failed to detach context" error when a streaming RPC ends
    early (a client cancels a watch, a gateway client goes away). The gRPC server
    instrumentation keeps its span current across the handler's yields; grpc closes the
    generator from another context, so resetting the context fails. It is harmless (the
    span still ends), an upstream bug (open-telemetry/opentelemetry-python-contrib#2357),
    and logged at ERROR with a traceback on every cancelled stream."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() != "Failed to detach context" or record.exc_info is None:
            return True
        exc = record.exc_info[1]
        return not (isinstance(exc, ValueError) and "different Context" in str(exc))


def setup_logging(level: str | int) -> None:
    """Log lines with their trace ids (`LOG_FORMAT`) at `level`, without the upstream
    detach noise; sampling of traces follows the SDK's ``OTEL_TRACES_SAMPLER`` and
    ``OTEL_TRACES_SAMPLER_ARG`` (e.g. ``parentbased_traceidratio`` and ``0.1``)."""
    logging.basicConfig(level=level, format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_TraceIds())
    logging.getLogger("opentelemetry.context").addFilter(_DetachNoise())


def server_interceptors() -> list[Any]:
    from opentelemetry.instrumentation.grpc import aio_server_interceptor  # noqa: PLC0415

    return [aio_server_interceptor()]  # type: ignore[no-untyped-call]  # untyped library


def client_interceptors() -> list[Any]:
    from opentelemetry.instrumentation.grpc import aio_client_interceptors  # noqa: PLC0415

    return list(aio_client_interceptors())  # type: ignore[no-untyped-call]  # untyped library


class _UnaryPropagating(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_traceparent(details), request)


class _StreamPropagating(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_traceparent(details), request)


def _with_traceparent(details: Any) -> Any:
    """`details` with the current span's W3C ``traceparent`` in its metadata."""
    traceparent = traceparent_of(trace.get_current_span())
    if not traceparent:
        return details
    metadata = [(k, v) for k, v in (details.metadata or ()) if k != _TRACEPARENT]
    metadata.append((_TRACEPARENT, traceparent))
    return details._replace(metadata=metadata)


def propagating_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors that carry the current span's context to the server (its W3C
    ``traceparent`` in the RPC's metadata) without a span of their own: for a caller whose
    own span already stands for the RPC (the gateway's request span), so that the trace does
    not hold a client span and a server span of the same name for every RPC."""
    return [_UnaryPropagating(), _StreamPropagating()]


def traceparent_of(span: trace.Span) -> str:
    """The W3C traceparent header value of `span` ("" for an invalid span), as the
    propagator writes it; formatted here, as it is on every dispatch, without the
    propagator's context and carrier round."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"


def context_from_traceparent(traceparent: str) -> Context | None:
    if not traceparent:
        return None
    return _PROPAGATOR.extract({"traceparent": traceparent})
