"""A real OTLP/gRPC trace receiver for tests: a gRPC server implementing the collector's
``TraceService`` in this process, keeping every span it is sent with its service, kind,
parent, attributes and links. Services export to it when ``OTEL_EXPORTER_OTLP_ENDPOINT``
points at ``http://127.0.0.1:{port}``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

KINDS = {
    trace_pb2.Span.SPAN_KIND_INTERNAL: "INTERNAL",
    trace_pb2.Span.SPAN_KIND_SERVER: "SERVER",
    trace_pb2.Span.SPAN_KIND_CLIENT: "CLIENT",
    trace_pb2.Span.SPAN_KIND_PRODUCER: "PRODUCER",
    trace_pb2.Span.SPAN_KIND_CONSUMER: "CONSUMER",
}


@dataclass(frozen=True)
class Link:
    trace_id: str
    span_id: str
    attributes: dict[str, Any]


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    attributes: dict[str, Any] = field(default_factory=dict)
    links: tuple[Link, ...] = ()


def value_of(value: common_pb2.AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [value_of(v) for v in value.array_value.values]
    if which is None:
        return None
    return getattr(value, which)


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: value_of(pair.value) for pair in pairs}


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector that keeps every span it is sent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self.exports = 0

    def Export(  # noqa: N802 - the generated servicer's method name
        self,
        request: trace_service_pb2.ExportTraceServiceRequest,
        context: grpc.ServicerContext,
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        received: list[ReceivedSpan] = []
        for resource_spans in request.resource_spans:
            service = str(_attributes(resource_spans.resource.attributes).get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                received += [
                    ReceivedSpan(
                        service,
                        span.name,
                        KINDS.get(span.kind, "UNSPECIFIED"),
                        span.trace_id.hex(),
                        span.span_id.hex(),
                        span.parent_span_id.hex(),
                        _attributes(span.attributes),
                        tuple(
                            Link(
                                link.trace_id.hex(),
                                link.span_id.hex(),
                                _attributes(link.attributes),
                            )
                            for link in span.links
                        ),
                    )
                    for span in scope_spans.spans
                ]
        with self._lock:
            self._spans += received
            self.exports += 1
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(
        self, what: str, done: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 30.0
    ) -> list[ReceivedSpan]:
        """The spans received once `done` holds for them (AssertionError after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans()
            if done(spans):
                return spans
            assert time.monotonic() < deadline, (
                f"no {what} after {timeout_s:g} s: {self.exports} exports, "
                f"{len(spans)} spans: {sorted({(s.service, s.name) for s in spans})}"
            )
            time.sleep(0.2)


@contextmanager
def otlp_receiver() -> Iterator[tuple[Receiver, int]]:
    """A receiver listening on a free local port: (receiver, port)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
        servicer, server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, port
    finally:
        server.stop(grace=None)
