"""OpenTelemetry traces of a workflow: one trace per query, spanning both processes' roles.

The coordinator and a worker run in this process (real gRPC server on a free port, real
Redis, the simulated engine), so the SDK's in-memory exporter sees every span both make:
a `query` span, a call span per call (``{operation} {model}``, kind CLIENT) as its child,
and the worker's span of each call as a child of the coordinator's, joined through the
`traceparent` of the dispatch message.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from hexgen_api.v1 import coordinator_pb2
from hexgen_client.client import CoordinatorClient
from hexgen_flow.workload import LLMCall, Query, Workflow
from hexgen_service.telemetry import (
    context_from_traceparent,
    setup_tracing,
    traceparent_of,
    tracer_provider,
)
from in_process_mesh import in_process_mesh


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    setup_tracing("hexgen-test")  # the process's provider (set once per process)
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


def test_a_traceparent_carries_the_span_across(spans: InMemorySpanExporter) -> None:
    tracer = trace.get_tracer("test")
    parent = tracer.start_span("parent")
    context = context_from_traceparent(traceparent_of(parent))
    child = tracer.start_span("child", context=context)
    assert child.get_span_context().trace_id == parent.get_span_context().trace_id
    assert isinstance(child, ReadableSpan) and child.parent is not None
    assert child.parent.span_id == parent.get_span_context().span_id
    assert context_from_traceparent("") is None


def test_the_traceparent_is_the_one_the_w3c_propagator_writes(
    spans: InMemorySpanExporter,
) -> None:
    """`traceparent_of` formats the header itself (it runs on every dispatch): the same
    string as OpenTelemetry's propagator, for a recorded span, a dropped one (not sampled)
    and an invalid one (none)."""
    propagator = TraceContextTextMapPropagator()
    dropped = tracer_provider("hexgen-test").get_tracer("test").start_span("dropped")
    recorded = trace.get_tracer("test").start_span("recorded")
    for span in (recorded, dropped, trace.INVALID_SPAN):
        carrier: dict[str, str] = {}
        propagator.inject(carrier, context=trace.set_span_in_context(span))
        assert traceparent_of(span) == carrier.get("traceparent", "")
    sampled = [int(traceparent_of(span)[-2:], 16) & 0x01 for span in (recorded, dropped)]
    assert sampled == [1, 0]


def test_spans_are_recorded_only_once_something_exports_them() -> None:
    """Without a span processor nothing is recorded, yet ids stay valid (log lines and the
    traceparent carry them); once one is added, the configured sampler decides."""
    provider = tracer_provider("hexgen-test")  # what setup_tracing installs
    tracer = provider.get_tracer("test")
    dropped = tracer.start_span("before")
    assert not dropped.is_recording()
    assert dropped.get_span_context().is_valid
    assert traceparent_of(dropped).startswith("00-")
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    kept = tracer.start_span("after")
    assert kept.is_recording()
    kept.end()
    assert [s.name for s in exporter.get_finished_spans()] == ["after"]


@pytest.fixture
async def mesh() -> AsyncIterator[str]:
    async with in_process_mesh(("A100", "L40S"), "trace-test", time_scale=200.0) as (_, address):
        yield address


async def test_a_query_is_one_trace_across_coordinator_and_worker(
    spans: InMemorySpanExporter, mesh: str
) -> None:
    small = LLMCall("information_retriever", 308, 5)
    query = Query(
        f"traced-{uuid.uuid4().hex[:6]}",
        Workflow.chain([(small,), (small, LLMCall("evaluate", 961, 22)), (small,)]),
    )
    async with CoordinatorClient(mesh) as client:
        events = [e async for e in client.run(query)]
    assert events[-1].kind == coordinator_pb2.QUERY_EVENT_KIND_SUCCEEDED
    await asyncio.sleep(0.2)  # the worker ends its spans when its finish is reported

    finished = spans.get_finished_spans()
    (root,) = [s for s in finished if s.name == "query" and _attr(s, "query.id") == query.query_id]
    trace_id = _context(root).trace_id
    mine = [s for s in finished if _context(s).trace_id == trace_id]
    coordinator_calls = {_attr(s, "call.id"): s for s in mine if _attr(s, "call.id") and s.parent}
    assert set(coordinator_calls) == {
        f"{query.query_id}/{k}.{i}" for k, n in enumerate((1, 2, 1)) for i in range(n)
    }
    # One span per stage, child of the query's; each call's span is its stage's child.
    stages = {_attr(s, "hexgen.stage.index"): s for s in mine if s.name == "stage"}
    assert set(stages) == {0, 1, 2}
    assert all(_parent(s) == _context(root).span_id for s in stages.values())
    for call_id, span in coordinator_calls.items():
        stage = int(str(call_id).rsplit("/", 1)[1].split(".")[0])
        assert _parent(span) == _context(stages[stage]).span_id, call_id
        assert span.name == "text_completion llama-3.1-70b", span.name
        assert span.kind == trace.SpanKind.CLIENT
        assert _attr(span, "gen_ai.operation.name") == "text_completion"
        assert _attr(span, "gen_ai.provider.name") == "hexgen_flow"
        assert _attr(span, "gen_ai.response.model") == "llama-3.1-70b"
        assert _attr(span, "gen_ai.request.model") == "llama-3.1-70b"
        assert _attr(span, "gen_ai.usage.input_tokens") in (308, 961)
        assert isinstance(_attr(span, "gen_ai.usage.output_tokens"), int)
        assert _attr(span, "hexgen.workflow.id") == query.query_id
        assert isinstance(_attr(span, "hexgen.deadline_s"), float)
    first, last = stages[0], stages[2]
    assert _attr(first, "hexgen.stage.finished_s") <= _attr(last, "hexgen.stage.released_s")  # type: ignore[operator]
    call_span_ids = {_context(s).span_id for s in coordinator_calls.values()}
    worker_spans = [s for s in mine if s.parent is not None and s.parent.span_id in call_span_ids]
    assert len(worker_spans) == 4  # the worker's span of each call, child of the dispatch
    assert all(_attr(s, "hexgen.queue_wait_s") is not None for s in worker_spans)


def _attr(span: ReadableSpan, name: str) -> object:
    return (span.attributes or {}).get(name)


def _context(span: ReadableSpan) -> trace.SpanContext:
    context = span.context
    assert isinstance(context, trace.SpanContext)
    return context


def _parent(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None
