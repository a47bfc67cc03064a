"""One trace across the Go client, the coordinator and a worker, all real processes.

An OTLP/gRPC trace receiver runs in this process (a gRPC server implementing the
collector's ``TraceService``); `hexgen-flow up` runs with ``OTEL_EXPORTER_OTLP_ENDPOINT``
pointing at it, so its coordinator and worker export their spans there. The Go program
``clients/go/example/traced`` (built offline in GOPATH mode by ``clients/go/gopath.sh``,
the environment ``clients/go/test.sh`` uses) starts a span with the OpenTelemetry Go SDK,
submits and watches a query through the wrapper with that span's context (the wrapper
injects its W3C traceparent), and writes its spans to a file. The spans the receiver gets
from the coordinator (``query``, ``stage``, and a call's ``{operation} {model}``, e.g.
``text_completion llama-3.1-70b``) and the worker must carry the client
span's trace id, and the coordinator's root-most spans must be the client span's children.

Skipped when Go (or the Debian Go packages the build needs) is not installed; CI installs
Go only for ``make test-clients``, whose ``scripts/test_clients.py`` runs this file after
the Go client's tests with ``HEXGEN_CLIENT_TRACES_REQUIRED=1``, which turns the skip into a
failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from up_runner import running_up

ROOT = Path(__file__).resolve().parents[1]
GOPATH_SH = ROOT / "clients" / "go" / "gopath.sh"
REQUIRED = "HEXGEN_CLIENT_TRACES_REQUIRED"
CLIENT_SPAN = "client.run_workflow"  # example/traced's span
EXPORT_WAIT_S = 30.0


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector that keeps every span it is sent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[Span] = []
        self.exports = 0

    def Export(  # noqa: N802 - the generated servicer's method name
        self,
        request: trace_service_pb2.ExportTraceServiceRequest,
        context: grpc.ServicerContext,
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        received: list[Span] = []
        for resource_spans in request.resource_spans:
            service = next(
                (
                    attribute.value.string_value
                    for attribute in resource_spans.resource.attributes
                    if attribute.key == "service.name"
                ),
                "",
            )
            for scope_spans in resource_spans.scope_spans:
                received += [
                    Span(
                        service,
                        span.name,
                        span.trace_id.hex(),
                        span.span_id.hex(),
                        span.parent_span_id.hex(),
                    )
                    for span in scope_spans.spans
                ]
        with self._lock:
            self._spans += received
            self.exports += 1
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [span for span in self._spans if span.trace_id == trace_id]

    def services(self) -> set[str]:
        with self._lock:
            return {span.service for span in self._spans}


def _skip(reason: str) -> NoReturn:
    if os.environ.get(REQUIRED):
        pytest.fail(f"{reason} ({REQUIRED} is set)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Go program example/traced, built as clients/go/test.sh builds the client."""
    if shutil.which("go") is None:
        _skip(
            "go is not installed (make test-clients installs it, with the Debian packages "
            "clients/go/README.md lists, and runs this test)"
        )
    binary = tmp_path_factory.mktemp("go") / "traced"
    done = subprocess.run(
        ["bash", str(GOPATH_SH), "go", "build", "-o", str(binary), "./example/traced"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode == 2 and done.stderr.startswith("gopath.sh:"):
        _skip(done.stderr.strip())  # a Debian Go package is missing
    assert done.returncode == 0, f"building example/traced failed:\n{done.stderr}"
    return binary


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, int]]:
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


def _is_call(span: Span) -> bool:
    """A coordinator's span of a call: named ``{gen_ai.operation.name} {model}``."""
    return span.name.split(" ", 1)[0] in ("chat", "text_completion")


def client_span(path: Path) -> Span:
    """The Go client's span, from the stdouttrace exporter's file (one JSON object a line)."""
    for line in path.read_text().splitlines():
        stub = json.loads(line)
        if stub["Name"] == CLIENT_SPAN:
            parent = stub["Parent"]["SpanID"]
            return Span(
                "hexgen-go-client",
                stub["Name"],
                stub["SpanContext"]["TraceID"],
                stub["SpanContext"]["SpanID"],
                "" if parent == "0" * 16 else parent,
            )
    raise AssertionError(f"no {CLIENT_SPAN} span in {path}: {path.read_text()!r}")


def test_one_trace_across_the_go_client_the_coordinator_and_a_worker(
    traced: Path,
    receiver: tuple[Receiver, int],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    collector, port = receiver
    # `up` and its services inherit these: every service exports to the receiver, and the
    # batch span processor flushes every half second (its default is five).
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "500")
    for name in ("OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    spans_file = tmp_path / "client-spans.json"
    query_id = f"py-traced-{uuid.uuid4().hex[:12]}"
    options = ("--cluster", "A100", "--no-tuner", "--no-gateway", "--time-scale", "50")
    with running_up(tmp_path, *options, "--admission", "off") as up:
        done = subprocess.run(
            [str(traced), "-addr", up.coordinator, "-spans", str(spans_file),
             "-id", query_id, "-timeout", "90s"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, f"example/traced failed:\n{done.stdout}\n{done.stderr}"
        client = client_span(spans_file)
        assert done.stdout.split()[-1] == client.trace_id  # its last line: the trace id
        assert client.parent_id == "", "the client's span is the trace's root"

        def complete() -> bool:
            spans = collector.spans(client.trace_id)
            coordinator = [span for span in spans if span.service == "hexgen-coordinator"]
            names = {span.name for span in coordinator}
            worker = [span for span in spans if span.service == "hexgen-worker"]
            calls = [span for span in coordinator if _is_call(span)]
            return {"query", "stage"} <= names and len(calls) > 0 and len(worker) > 0

        deadline = time.monotonic() + EXPORT_WAIT_S
        while not complete():
            assert time.monotonic() < deadline, (
                f"no complete trace {client.trace_id} after {EXPORT_WAIT_S:g} s: "
                f"{collector.exports} exports from {sorted(collector.services())}, "
                f"in the trace: {collector.spans(client.trace_id)}"
            )
            time.sleep(0.25)
        time.sleep(1.0)  # the spans ending with the query's last events, exported late

    spans = collector.spans(client.trace_id)
    coordinator = [span for span in spans if span.service == "hexgen-coordinator"]
    worker = [span for span in spans if span.service == "hexgen-worker"]
    ids = {span.span_id: span for span in [*spans, client]}

    # Two stages of one call each: a stage span and a call span apiece, one query span.
    names = [span.name for span in coordinator]
    assert names.count("query") == 1 and names.count("stage") == 2, names
    assert sum(_is_call(span) for span in coordinator) >= 2, names
    query = next(span for span in coordinator if span.name == "query")
    for span in coordinator:
        if span.name == "stage":
            assert span.parent_id == query.span_id, span
        if _is_call(span):
            assert ids[span.parent_id].name == "stage", span

    # The worker's span of each call is a child of the coordinator's call span (through
    # the traceparent of the dispatch message).
    calls = {span.span_id for span in coordinator if _is_call(span)}
    worker_calls = [span for span in worker if span.parent_id in calls]
    assert len(worker_calls) >= 2, worker

    # The coordinator's root-most spans (their parent is none of the mesh's spans) are the
    # client span's children: its RPC spans of SubmitQuery and WatchQuery, under which the
    # query span starts.
    mesh = {span.span_id for span in [*coordinator, *worker]}
    rootmost = [span for span in coordinator if span.parent_id not in mesh]
    assert rootmost, coordinator
    assert all(span.parent_id == client.span_id for span in rootmost), (rootmost, client)
    rpcs = {span.name.rsplit("/", 1)[-1] for span in rootmost}
    assert {"SubmitQuery", "WatchQuery"} <= rpcs, rootmost
    ancestor = query
    while ancestor.parent_id in ids and ancestor is not client:
        ancestor = ids[ancestor.parent_id]
    assert ancestor == client, f"the query span's root is {ancestor}, not the client's span"
