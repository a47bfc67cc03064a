"""A workflow is one trace, whatever its client sends, with the GenAI conventions' spans.

`hexgen-flow up` (coordinator, a simulated A100 worker, the gateway) runs as real processes
exporting to a real OTLP/gRPC receiver in this process (`otlp_receiver`). The official
`openai` SDK gives a workflow six calls through the gateway, with the ``X-Hexgen-*`` headers
and no ``traceparent`` (an httpx hook records what it sends), except one call whose
``traceparent`` is of another trace. Every span of the workflow (the gateway's request
spans, the coordinator's query, stage and call spans, the worker's spans of the calls) must
then be in one trace whose root is the first request's span; the call spans are named and
attributed by OpenTelemetry's GenAI semantic conventions, attribute by attribute against
what the answers said; no span of a request has the name of another of the same request.
After the coordinator is SIGKILLed and restarted by `up`, the workflow's later requests and
calls are still in its trace (its root's traceparent is stored with it in Redis).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from hexgen_client.client import CoordinatorClient
from hexgen_client.errors import CoordinatorError
from otlp_receiver import ReceivedSpan, Receiver, otlp_receiver
from up_runner import Up, running_up

pytestmark = pytest.mark.skipif(
    subprocess.run(["which", "redis-server"], capture_output=True, check=False).returncode != 0,
    reason="redis-server is not installed (apt install redis-server)",
)

MODEL = "llama-3.1-70b"  # the default catalogue's A100
GATEWAY = "hexgen-gateway"
COORDINATOR = "hexgen-coordinator"
WORKER = "hexgen-worker"
OTHER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
OTHER_PARENT = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Up, Receiver]]:
    env = pytest.MonkeyPatch()
    with otlp_receiver() as (receiver, port):
        # `up` and its services inherit these: every service exports to the receiver, and
        # the batch span processor flushes every half second (its default is five).
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "500")
        for name in ("OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG", "OTEL_SDK_DISABLED"):
            env.delenv(name, raising=False)
        try:
            with running_up(
                tmp_path_factory.mktemp("traces"),
                "--cluster", "A100",
                "--time-scale", "50",
                "--no-tuner",
                "--admission", "off",
            ) as up:  # fmt: skip
                yield up, receiver
        finally:
            env.undo()


def gateway_url(up: Up) -> str:
    return up.banner["gateway"].split(" ", 1)[0]


class Session:
    """The openai SDK on the gateway, naming `workflow` on every request; `sent` is the
    ``traceparent`` header of each request it sent (None: none)."""

    def __init__(self, up: Up, workflow: str) -> None:
        self.workflow = workflow
        self.url = gateway_url(up)
        self.sent: list[str | None] = []

        def record(request: Any) -> None:  # the SDK's httpx's Request
            if request.url.path.endswith("completions"):
                self.sent.append(request.headers.get("traceparent"))

        self.sdk = openai.OpenAI(
            base_url=self.url,
            api_key="unused",
            max_retries=0,
            timeout=60,
            default_headers={"X-Hexgen-Workflow": workflow},
            http_client=openai.DefaultHttpxClient(event_hooks={"request": [record]}),
        )
        self.calls: list[dict[str, Any]] = []
        """Per call: its id, operation, what it asked and what the answer said."""

    def chat(self, stage: str, max_tokens: int, headers: dict[str, str] | None = None,
             **options: Any) -> None:  # fmt: skip
        raw = self.sdk.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"step {stage}: which tables?"}],
            max_tokens=max_tokens,
            extra_headers={"X-Hexgen-Stage": stage, **(headers or {})},
            **options,
        )
        answer = raw.parse()
        assert answer.usage is not None
        self.calls.append(
            {
                "call_id": raw.headers["X-Hexgen-Call"],
                "operation": "chat",
                "route": "/v1/chat/completions",
                "max_tokens": max_tokens,
                "options": options,
                "finish_reason": answer.choices[0].finish_reason,
                "prompt_tokens": answer.usage.prompt_tokens,
                "completion_tokens": answer.usage.completion_tokens,
                "model": answer.model,
            }
        )

    def complete(self, stage: str, max_tokens: int) -> None:
        raw = self.sdk.completions.with_raw_response.create(
            model=MODEL,
            prompt=f"-- step {stage}\nSELECT",
            max_tokens=max_tokens,
            extra_headers={"X-Hexgen-Stage": stage},
        )
        answer = raw.parse()
        assert answer.usage is not None
        self.calls.append(
            {
                "call_id": raw.headers["X-Hexgen-Call"],
                "operation": "text_completion",
                "route": "/v1/completions",
                "max_tokens": max_tokens,
                "options": {},
                "finish_reason": answer.choices[0].finish_reason,
                "prompt_tokens": answer.usage.prompt_tokens,
                "completion_tokens": answer.usage.completion_tokens,
                "model": answer.model,
            }
        )

    def close(self) -> None:
        closed = httpx.post(f"{self.url}/workflows/{self.workflow}/close", timeout=30)
        assert closed.status_code == 200, closed.text


def of_workflow(spans: list[ReceivedSpan], workflow: str) -> list[ReceivedSpan]:
    """The spans that name `workflow` (the gateway's, the coordinator's, the worker's)."""
    keys = ("hexgen.workflow", "query.id", "hexgen.workflow.id", "hexgen.query_id")
    return [s for s in spans if any(s.attributes.get(k) == workflow for k in keys)]


def by_call(spans: list[ReceivedSpan], service: str, call_id: str) -> list[ReceivedSpan]:
    key = "call.id" if service == COORDINATOR else "hexgen.call_id"
    return [s for s in spans if s.service == service and s.attributes.get(key) == call_id]


def complete(spans: list[ReceivedSpan], session: Session) -> bool:
    """Every call's three spans and the workflow's query span are in."""
    if not any(
        s.name == "query" and s.attributes.get("query.id") == session.workflow for s in spans
    ):
        return False
    return all(
        by_call(spans, service, call["call_id"])
        for call in session.calls
        for service in (GATEWAY, COORDINATOR, WORKER)
    )


def test_a_session_without_traceparent_is_one_trace_of_genai_spans(
    traced: tuple[Up, Receiver],
) -> None:
    up, receiver = traced
    session = Session(up, f"traced-{uuid.uuid4().hex[:10]}")
    session.chat("plan", 8, temperature=0.25, seed=7, top_p=0.5)
    session.complete("draft", 6)
    session.chat("draft", 5, stop=["\n\n"])
    # A client span of another trace: the request stays in the workflow's, linked to it.
    other = {"traceparent": f"00-{OTHER_TRACE}-{OTHER_PARENT}-01"}
    session.chat("check", 7, headers=other)
    session.chat("check", 4)
    session.chat("answer", 9)
    session.close()
    assert session.sent == [None, None, None, other["traceparent"], None, None]

    spans = receiver.wait_for("complete trace", lambda got: complete(got, session))
    time.sleep(1.0)  # the spans that end with the workflow's last events, exported late
    spans = receiver.spans()
    mine = of_workflow(spans, session.workflow)
    assert {s.service for s in mine} == {GATEWAY, COORDINATOR, WORKER}

    # One trace: every span of the workflow, of every request, in it.
    traces = {s.trace_id for s in mine}
    assert len(traces) == 1, sorted((s.trace_id, s.service, s.name) for s in mine)
    (trace_id,) = traces
    assert trace_id != OTHER_TRACE
    in_trace = [s for s in spans if s.trace_id == trace_id]
    ids = {s.span_id: s for s in in_trace}
    # Its one root is the first request's span; every other span's parent is in the trace.
    roots = [s for s in in_trace if s.parent_id not in ids]
    first = by_call(spans, GATEWAY, session.calls[0]["call_id"])
    assert roots == first and roots[0].parent_id == "", roots
    query = next(s for s in in_trace if s.name == "query")
    assert query.attributes["gen_ai.conversation.id"] == session.workflow
    # One gateway span per request, whatever made it (no framework's HTTP span beside it).
    http = [s for s in spans if s.service == GATEWAY and s.name.startswith("POST /v1/")]
    assert len(http) == len(session.calls), [(s.trace_id, s.name) for s in http]

    for number, call in enumerate(session.calls):
        call_id, operation = call["call_id"], call["operation"]
        (request,) = by_call(spans, GATEWAY, call_id)
        (model_call,) = by_call(spans, COORDINATOR, call_id)
        (work,) = by_call(spans, WORKER, call_id)
        # Names and kinds: the request (HTTP), the call to a model, the engine's execution.
        assert (request.name, request.kind) == (f"POST {call['route']}", "SERVER")
        assert (model_call.name, model_call.kind) == (f"{operation} {MODEL}", "CLIENT")
        assert (work.name, work.kind) == (f"simulated {operation} {MODEL}", "INTERNAL")
        assert work.parent_id == model_call.span_id
        if number:  # a later request: a child of the workflow's root span
            assert request.parent_id == query.span_id, (number, request)
        # No span of the request has another's name (no second HTTP span of the request, no
        # client and server span pair of one RPC): the request, its parent, children and
        # grandchildren, its call and the engine's.
        parent = [ids[request.parent_id]] if request.parent_id in ids else []
        children = [s for s in in_trace if s.parent_id == request.span_id]
        grandchildren = [s for s in in_trace if s.parent_id in {c.span_id for c in children}]
        family = (*parent, request, *children, *grandchildren, model_call, work)
        names = [s.name for s in family]
        assert len(names) == len(set(names)), (number, names)
        assert any(c.name.endswith("/RunCall") for c in children), children

        # The GenAI attributes, by name, against what the answer said.
        for span in (request, model_call, work):
            a = span.attributes
            where = (number, span.service, span.name)
            assert a["gen_ai.operation.name"] == operation, where
            assert a["gen_ai.request.model"] == MODEL, where
            assert a["gen_ai.request.max_tokens"] == call["max_tokens"], where
            assert a["gen_ai.response.model"] == call["model"] == MODEL, where
            assert a["gen_ai.response.finish_reasons"] == [call["finish_reason"]], where
            assert a["gen_ai.usage.input_tokens"] == call["prompt_tokens"], where
            assert a["gen_ai.usage.output_tokens"] == call["completion_tokens"], where
            assert a["gen_ai.conversation.id"] == session.workflow, where
            assert a["gen_ai.output.type"] == "text", where
            options = call["options"]
            for name in ("temperature", "top_p", "seed"):
                assert a.get(f"gen_ai.request.{name}") == options.get(name), (where, name)
            assert a.get("gen_ai.request.stop_sequences") == options.get("stop"), where
        assert request.attributes["gen_ai.provider.name"] == "hexgen_flow"
        assert model_call.attributes["gen_ai.provider.name"] == "hexgen_flow"
        assert work.attributes["gen_ai.provider.name"] == "simulated"
        # The usage is the engine's: what it generated, not the budget (simulated: the
        # budget is what it generates for a placeholder; a chat answer may stop sooner).
        assert 0 < call["completion_tokens"] <= call["max_tokens"]

    # The request whose client span was of another trace links to it.
    (linked,) = by_call(spans, GATEWAY, session.calls[3]["call_id"])
    assert [(link.trace_id, link.span_id) for link in linked.links] == [(OTHER_TRACE, OTHER_PARENT)]


def test_the_workflow_keeps_its_trace_across_a_coordinator_restart(
    traced: tuple[Up, Receiver],
) -> None:
    # Last of the module: the shared mesh's coordinator is killed and restarted by `up`.
    up, receiver = traced
    session = Session(up, f"restarted-{uuid.uuid4().hex[:10]}")
    session.chat("plan", 6)
    session.chat("draft", 5)
    before = len(session.calls)
    receiver.wait_for("the first calls' spans", lambda got: complete_calls(got, session))
    os.kill(up.service_pid("hexgen_coordinator"), signal.SIGKILL)
    up.wait_stderr(r"coordinator exited with code -9; restarting")
    asyncio.run(_wait_back(up, session.workflow))
    session.chat("check", 4)
    session.complete("answer", 6)
    session.close()

    spans = receiver.wait_for("the later calls' spans", lambda got: complete_calls(got, session))
    spans = receiver.wait_for(
        "the resumed query's span",
        lambda got: any(
            s.name == "query (resumed)" and s.attributes.get("query.id") == session.workflow
            for s in got
        ),
    )
    mine = of_workflow(spans, session.workflow)
    traces = {s.trace_id for s in mine}
    assert len(traces) == 1, sorted((s.trace_id, s.service, s.name) for s in mine)
    resumed = [s for s in mine if s.name == "query (resumed)"]
    assert resumed and all(s.parent_id for s in resumed)  # a child of the stored root
    later = [c["call_id"] for c in session.calls[before:]]
    for call_id in later:
        for service in (GATEWAY, COORDINATOR, WORKER):
            assert by_call(spans, service, call_id), (service, call_id)


def complete_calls(spans: list[ReceivedSpan], session: Session) -> bool:
    return all(
        by_call(spans, service, call["call_id"])
        for call in session.calls
        for service in (GATEWAY, COORDINATOR, WORKER)
    )


async def _wait_back(up: Up, workflow: str) -> None:
    """Until the restarted coordinator answers for `workflow`."""
    deadline = time.monotonic() + 30
    async with CoordinatorClient(up.coordinator) as client:
        while True:
            try:
                await client.get(workflow)
                return
            except CoordinatorError:
                assert time.monotonic() < deadline, "the coordinator did not come back"
                await asyncio.sleep(0.2)
