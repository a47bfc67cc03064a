"""OpenTelemetry tracing for the services.

`setup_tracing` installs a tracer provider that exports over OTLP/gRPC when
``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (the docker-compose cluster points it at the
collector), and records nothing otherwise. The gRPC interceptors trace every RPC; the
coordinator adds a span per workflow, stage and call, and passes the call's context to the
worker as a W3C ``traceparent`` string inside the dispatch message.
"""

from __future__ import annotations

import os
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = [
    "client_interceptors",
    "context_from_traceparent",
    "server_interceptors",
    "setup_tracing",
    "traceparent_of",
]

_PROPAGATOR = TraceContextTextMapPropagator()
_configured = False


def setup_tracing(service_name: str) -> trace.Tracer:
    """Configure tracing for this process once; return the service's tracer."""
    global _configured  # noqa: PLW0603 - one provider per process, set up at start
    if not _configured:
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # noqa: PLC0415
                OTLPSpanExporter,
            )

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
        _configured = True
    return trace.get_tracer(service_name)


def server_interceptors() -> list[Any]:
    from opentelemetry.instrumentation.grpc import aio_server_interceptor  # noqa: PLC0415

    return [aio_server_interceptor()]  # type: ignore[no-untyped-call]  # untyped library


def client_interceptors() -> list[Any]:
    from opentelemetry.instrumentation.grpc import aio_client_interceptors  # noqa: PLC0415

    return list(aio_client_interceptors())  # type: ignore[no-untyped-call]  # untyped library


def traceparent_of(span: trace.Span) -> str:
    """The W3C traceparent header value of `span`."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def context_from_traceparent(traceparent: str) -> Context | None:
    if not traceparent:
        return None
    return _PROPAGATOR.extract({"traceparent": traceparent})
