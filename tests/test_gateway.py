"""The OpenAI-compatible gateway, for real: `hexgen-flow up` with its gateway, driven by the
official `openai` SDK (``base_url=http://.../v1``) and by plain HTTP, against simulated
workers. A workflow is told by headers only; errors come back in OpenAI's shape."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from hexgen_api.v1 import coordinator_pb2
from hexgen_client.client import CoordinatorClient
from hexgen_flow.admission import AdmissionModel
from hexgen_flow.cluster import parse_cluster
from hexgen_flow.workload import LLMCall, Workflow
from hexgen_launch.processes import free_port
from hexgen_service.server import GrpcServer
from up_runner import Up, running_up, wait_for

needs_redis_server = pytest.mark.skipif(
    subprocess.run(["which", "redis-server"], capture_output=True, check=False).returncode != 0,
    reason="redis-server is not installed (apt install redis-server)",
)

pytestmark = needs_redis_server

MODEL = "llama-3.1-70b"  # every instance of the default catalogue's A100 and A6000
# A call that runs for seconds even at --time-scale 50 (70B decode, ~30 ms a token).
LONG_TOKENS = 2048


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    tmp = tmp_path_factory.mktemp("gateway")
    with running_up(
        tmp,
        "--cluster", "A100,A6000",
        "--time-scale", "50",
        "--no-tuner",
        "--admission", "reject",
        "--gateway-listen", "127.0.0.1:0",
    ) as running:  # fmt: skip
        yield running


def base_url(up: Up) -> str:
    url, note = up.banner["gateway"].split(" ", 1)
    assert note == "(OpenAI-compatible)" and url.startswith("http://127.0.0.1:")
    return url


def sdk(up: Up) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url(up), api_key="unused", max_retries=0, timeout=60)


def estimate(text: str) -> int:
    return max(1, math.ceil(len(text) / 4))


def test_health_and_models(up: Up) -> None:
    root = base_url(up).removesuffix("/v1")
    health = httpx.get(f"{root}/health", timeout=10)
    assert health.status_code == 200
    assert health.json()["status"] == "ok" and health.json()["connected"] == 2
    assert [m.id for m in sdk(up).models.list()] == [MODEL]


async def test_a_three_stage_workflow_by_headers_only(up: Up) -> None:
    client = sdk(up)
    workflow = f"wf-{uuid.uuid4().hex[:8]}"

    def headers(stage: str) -> dict[str, str]:
        return {"X-Hexgen-Workflow": workflow, "X-Hexgen-Stage": stage}

    # Stage 1: chat, not streamed; the answer's headers name the query and its deadline.
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "You write SQL."},
        {"role": "user", "content": "Which customers ordered twice?"},
    ]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=32, extra_headers=headers("Keyword Extraction")
    )
    assert raw.headers["X-Hexgen-Workflow"] == workflow
    assert raw.headers["X-Hexgen-Query"] == workflow
    assert raw.headers["X-Hexgen-Call"] == f"{workflow}/0.0"
    assert float(raw.headers["X-Hexgen-Deadline-S"]) > 0
    answer = raw.parse()
    assert answer.object == "chat.completion" and answer.model == MODEL
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content.startswith("[simulated ")  # type: ignore[union-attr]
    prompt = "system: You write SQL.\nuser: Which customers ordered twice?\nassistant:"
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == estimate(prompt)
    assert answer.usage.completion_tokens == 32  # the simulated engine's placeholder
    assert answer.usage.total_tokens == estimate(prompt) + 32

    # Stage 2: two candidates at once (a fan-out), streamed, with usage in the last chunk.
    # A stage whose given calls all finished takes no more (the next call of its name is
    # the next round), so each fan-out opens a long call first and gives the short one
    # while the long one runs: the pair is one stage however slow this machine is.
    def candidate(n: int, max_tokens: int) -> Iterator[None]:
        stream = client.chat.completions.create(
            messages=[{"role": "user", "content": f"candidate {n}"}],
            model=MODEL,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers=headers("generate_candidate"),
        )
        yield  # the call is given (its response began)
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text.startswith("[simulated ") and text.endswith(f" {max_tokens} tokens")
        assert chunks[0].choices[0].delta.role == "assistant"
        # The placeholder is max_tokens long: generation ended at the limit.
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == max_tokens

    # Stage 3: two revisions at once, as completions, streamed (the long one) and not.
    def long_revision() -> Iterator[None]:
        pieces = client.completions.create(
            model=MODEL,
            prompt="SELECT",
            max_tokens=LONG_TOKENS,
            stream=True,
            extra_headers=headers("revision"),
        )
        yield
        assert "".join(c.choices[0].text for c in pieces).endswith(f" {LONG_TOKENS} tokens")

    def short_revision() -> None:
        done = client.completions.create(
            model=MODEL, prompt="SELECT", max_tokens=8, extra_headers=headers("revision")
        )
        assert done.object == "text_completion" and done.choices[0].text.endswith(" 8 tokens")
        assert done.usage is not None and done.usage.prompt_tokens == 2

    def overlapped(long: Iterator[None], short: Callable[[], None]) -> None:
        next(long)  # given, and running for seconds
        with ThreadPoolExecutor(1) as pool:
            given = pool.submit(short)
            for _ in long:  # drain the long one while the short one runs
                pass
            given.result()

    def short_candidate() -> None:
        for _ in candidate(2, 16):
            pass

    overlapped(candidate(1, LONG_TOKENS), short_candidate)
    overlapped(long_revision(), short_revision)

    # One workflow: its stages as the headers named them, in order, each with its calls.
    async with CoordinatorClient(up.coordinator) as coordinator:
        running = await coordinator.get(workflow)
        assert running.query.state == 1 and running.query.session_open  # RUNNING until closed
        closed = httpx.post(f"{base_url(up)}/workflows/{workflow}/close", timeout=30)
        assert closed.status_code == 200, closed.text
        assert closed.json()["state"] == "succeeded"
        got = await coordinator.get(workflow)
    assert got.query.state == 2 and got.query.calls_total == 5  # SUCCEEDED
    assert [(st.name, st.calls_total, st.calls_done) for st in got.stages] == [
        ("Keyword Extraction", 1, 1),
        ("generate_candidate", 2, 2),
        ("revision", 2, 2),
    ]
    # Every stage got a deadline from the time the workflow had left, within its deadline.
    assert all(0 < st.deadline_s <= got.query.deadline_s for st in got.stages)
    tokens = {e.call_id: e.text for e in got.events if e.kind == 6}  # CALL_FINISHED
    assert tokens[f"{workflow}/0.0"].endswith(" 32 tokens")
    assert tokens[f"{workflow}/1.1"].endswith(" 16 tokens")
    assert tokens[f"{workflow}/2.1"].endswith(" 8 tokens")
    # `hexgen-flow get` shows the three stages with the deadlines they were given.
    shown = subprocess.run(
        [sys.executable, "-m", "hexgen_cli", "get", workflow, "--coordinator", up.coordinator],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert "a workflow session (closed)" in shown
    for stage in got.stages:
        line = next(row for row in shown.splitlines() if stage.name in row and "/" in row)
        assert f"{stage.deadline_s:.2f}" in line, (stage.name, shown)
    # A call for a workflow that ended is refused: 409, naming why.
    late = httpx.post(
        f"{base_url(up)}/completions",
        json={"prompt": "x", "max_tokens": 4},
        headers=headers("revision"),
        timeout=30,
    )
    assert late.status_code == 409, late.text
    assert late.json()["error"]["code"] == "workflow_ended"
    assert "has succeeded" in late.json()["error"]["message"]


def test_a_request_without_headers_is_a_workflow_of_its_own(up: Up) -> None:
    raw = sdk(up).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}]
    )
    workflow = raw.headers["X-Hexgen-Workflow"]
    assert workflow.startswith("gw-")
    assert raw.headers["X-Hexgen-Call"] == f"{workflow}/0.0"
    usage = raw.parse().usage
    assert usage is not None and usage.completion_tokens == 256  # the default max_tokens

    async def state() -> int:
        async with CoordinatorClient(up.coordinator) as coordinator:
            return int((await coordinator.get(workflow)).query.state)

    assert asyncio.run(state()) == 2  # SUCCEEDED: closed as soon as its call was given


async def test_a_stream_the_client_leaves_cancels_its_own_workflow(up: Up) -> None:
    # No X-Hexgen-Workflow: the request is its workflow, nobody else wants it.
    async with (
        httpx.AsyncClient(base_url=base_url(up), timeout=60) as http,
        http.stream(
            "POST",
            "/completions",
            json={"prompt": "x", "max_tokens": 4000, "stream": True},
        ) as stream,
    ):
        query_id = stream.headers["X-Hexgen-Query"]
        async for line in stream.aiter_lines():
            assert line.startswith("data: {")  # the first chunk; then the client leaves
            break
    async with CoordinatorClient(up.coordinator) as coordinator:
        for _ in range(100):
            state = (await coordinator.get(query_id)).query.state
            if state != 1:  # RUNNING
                break
            await asyncio.sleep(0.1)
    assert state == 3  # CANCELLED


def test_bad_input_is_400_naming_the_field(up: Up) -> None:
    url = base_url(up)
    cases = [
        ({"model": MODEL}, {}, "messages"),
        ({"model": MODEL, "messages": []}, {}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, {}, "max_tokens"),
        ({"messages": [{"content": "x"}]}, {}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": "x"}]},
            {"X-Hexgen-Slo-S": "soon"},
            "X-Hexgen-Slo-S",
        ),
        # Refused by the coordinator (ids are at most 256 bytes), its field mapped.
        (
            {"messages": [{"role": "user", "content": "x"}]},
            {"X-Hexgen-Workflow": "w" * 300},
            "X-Hexgen-Workflow",
        ),
    ]
    for body, headers, param in cases:
        answer = httpx.post(f"{url}/chat/completions", json=body, headers=headers, timeout=30)
        assert answer.status_code == 400, (body, answer.text)
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param, (body, error)
    answer = httpx.post(f"{url}/completions", json={"prompt": ""}, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as err:
        sdk(up).chat.completions.create(model=MODEL, messages=[], max_tokens=4)
    assert err.value.param == "messages"


def test_an_unknown_model_is_404(up: Up) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        sdk(up).chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert err.value.code == "model_not_found"


def test_an_slo_admission_refuses_is_429_with_retry_after(up: Up) -> None:
    url = base_url(up)
    # A chat call of about 5 input tokens and the default 256 output tokens needs about 7 s
    # even alone on this cluster; an SLO below that is refused for good (400: no wait can
    # help), and one just above it only while a backlog of long calls runs (429).
    model = AdmissionModel(parse_cluster("A100,A6000"))
    least = model.predict(Workflow.chain([(LLMCall("chat", 5, 256),)]), 0.0, [True] * 2).least_s
    tight = f"{1.05 * least:.3f}"
    with httpx.Client(timeout=120) as http, ThreadPoolExecutor(8) as pool:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        never = http.post(f"{url}/chat/completions", json=chat, headers={"X-Hexgen-Slo-S": "0.001"})
        assert never.status_code == 400, never.text
        assert never.json()["error"]["param"] == "X-Hexgen-Slo-S"
        assert "no wait can help" in never.json()["error"]["message"]
        load = [
            pool.submit(
                http.post,
                f"{url}/completions",
                json={"prompt": "x" * 4000, "max_tokens": 4000},
                headers={"X-Hexgen-Workflow": f"load-{n}"},
            )
            for n in range(8)
        ]
        wait_for("the load to be admitted", lambda: _running(up) >= 8, timeout_s=30)
        answer = http.post(
            f"{url}/chat/completions",
            json=chat,
            headers={"X-Hexgen-Slo-S": tight, "X-Hexgen-Workflow": "tight"},
        )
        assert answer.status_code == 429, answer.text
        assert int(answer.headers["Retry-After"]) >= 1
        assert float(answer.headers["retry-after-ms"]) >= 1000  # hints are at least 1 s
        error = answer.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
        with pytest.raises(openai.RateLimitError):
            sdk(up).with_options(max_retries=0).completions.create(
                model=MODEL, prompt="x", extra_headers={"X-Hexgen-Slo-S": tight}
            )
        assert all(f.result().status_code == 200 for f in load)


def _running(up: Up) -> int:
    async def ask() -> int:
        async with CoordinatorClient(up.coordinator) as coordinator:
            return int((await coordinator.status()).queries_running)

    return asyncio.run(ask())


def test_a_second_gateway_continues_the_workflow_the_first_opened(up: Up, tmp_path: Path) -> None:
    # As after a restart, or behind a load balancer: the workflow lives in the coordinator.
    workflow = f"again-{uuid.uuid4().hex[:8]}"

    def ask(url: str, stage: str, max_tokens: int) -> httpx.Response:
        body = {"prompt": "x", "max_tokens": max_tokens}
        headers = {"X-Hexgen-Workflow": workflow, "X-Hexgen-Stage": stage}
        answer = httpx.post(f"{url}/completions", json=body, headers=headers, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"].endswith(f" {max_tokens} tokens")
        return answer

    assert ask(base_url(up), "s", 4).headers["X-Hexgen-Call"] == f"{workflow}/0.0"
    with _gateway(tmp_path, up.coordinator) as listen:
        # It opens the workflow with other content (another first stage): the coordinator
        # has it already, and the call joins it as a new stage.
        assert ask(f"http://{listen}/v1", "t", 5).headers["X-Hexgen-Call"] == f"{workflow}/1.0"
        closed = httpx.post(f"http://{listen}/v1/workflows/{workflow}/close", timeout=30)
        assert closed.status_code == 200 and closed.json()["calls_done"] == 2, closed.text
        unknown = httpx.post(f"http://{listen}/v1/workflows/nope-{workflow}/close", timeout=30)
        assert unknown.status_code == 404, unknown.text


@contextmanager
def _gateway(tmp_path: Path, coordinator: str, *options: str) -> Iterator[str]:
    """`python -m hexgen_gateway` on a free port in front of `coordinator` (with
    `options`), listening."""
    listen = f"127.0.0.1:{free_port()}"
    log = (tmp_path / "gateway.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hexgen_gateway", "--listen", listen,
         "--coordinator", coordinator, "--log-level", "WARNING", *options],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:

        def answers() -> bool:
            try:
                httpx.get(f"http://{listen}/health", timeout=5)
            except httpx.TransportError:
                return False
            return True

        wait_for("the gateway to listen", answers, timeout_s=30)
        yield listen
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def test_without_a_coordinator_health_and_requests_are_503(tmp_path: Path) -> None:
    with _gateway(tmp_path, f"127.0.0.1:{free_port()}") as listen:
        health = httpx.get(f"http://{listen}/health", timeout=10)
        assert health.status_code == 503
        assert health.json()["error"]["type"] == "service_unavailable"
        answer = httpx.post(f"http://{listen}/v1/completions", json={"prompt": "x"}, timeout=30)
        assert answer.status_code == 503, answer.text
        assert "cannot reach the coordinator" in answer.json()["error"]["message"]


# ------------------------------------------- against a stand-in coordinator (real gRPC)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


class _StandInCoordinator:
    """OpenWorkflow and RunCall of a coordinator whose calls answer real text (not the
    simulated placeholder), recording the metadata each RPC arrived with."""

    def __init__(self) -> None:
        self.metadata: dict[str, dict[str, str]] = {}
        self.calls = 0

    def register(self, server: grpc.aio.Server) -> None:
        open_workflow = grpc.unary_unary_rpc_method_handler(
            self.open_workflow,
            request_deserializer=coordinator_pb2.OpenWorkflowRequest.FromString,
            response_serializer=coordinator_pb2.OpenWorkflowResponse.SerializeToString,
        )
        run_call = grpc.unary_stream_rpc_method_handler(
            self.run_call,
            request_deserializer=coordinator_pb2.RunCallRequest.FromString,
            response_serializer=coordinator_pb2.RunCallResponse.SerializeToString,
        )
        handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            "OpenWorkflow": open_workflow,
            "RunCall": run_call,
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("hexgen_flow.v1.CoordinatorService", handlers),)
        )

    def _record(self, name: str, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self.metadata[name] = {k: str(v) for k, v in context.invocation_metadata() or ()}

    async def open_workflow(
        self, request: coordinator_pb2.OpenWorkflowRequest, context: Any
    ) -> coordinator_pb2.OpenWorkflowResponse:
        self._record("OpenWorkflow", context)
        info = coordinator_pb2.QueryInfo(query_id=request.workflow_id, deadline_s=30.0)
        return coordinator_pb2.OpenWorkflowResponse(workflow=info, created=True)

    async def run_call(
        self, request: coordinator_pb2.RunCallRequest, context: Any
    ) -> AsyncIterator[coordinator_pb2.RunCallResponse]:
        self._record("RunCall", context)
        call_id = f"{request.workflow_id}/0.{self.calls}"
        self.calls += 1
        kinds = coordinator_pb2
        for kind, text in (
            (kinds.QUERY_EVENT_KIND_CALL_SUBMITTED, ""),
            (kinds.QUERY_EVENT_KIND_CALL_TOKENS, "SELECT "),
            (kinds.QUERY_EVENT_KIND_CALL_FINISHED, "SELECT name FROM t"),
        ):
            event = coordinator_pb2.QueryEvent(
                query_id=request.workflow_id, kind=kind, text=text, call_id=call_id
            )
            first = kind == kinds.QUERY_EVENT_KIND_CALL_SUBMITTED
            yield coordinator_pb2.RunCallResponse(
                event=event, call_id=call_id if first else "", deadline_s=12.5 if first else 0
            )


@pytest.fixture
async def stand_in(tmp_path: Path) -> AsyncIterator[tuple[_StandInCoordinator, str]]:
    coordinator = _StandInCoordinator()
    address = f"127.0.0.1:{free_port()}"
    server = GrpcServer(
        address, coordinator.register, ["hexgen_flow.v1.CoordinatorService"], grace_s=0.1
    )
    await server.start()
    listen = f"127.0.0.1:{free_port()}"
    log = (tmp_path / "gateway.log").open("w")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hexgen_gateway", "--listen", listen, "--coordinator", address,
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        async with httpx.AsyncClient() as http:
            for _ in range(300):
                try:
                    await http.get(f"http://{listen}/v1/models", timeout=2)
                    break
                except httpx.TransportError:
                    await asyncio.sleep(0.1)
        yield coordinator, listen
    finally:
        proc.terminate()
        await proc.wait()
        log.close()
        await server.stop()


async def test_the_traceparent_travels_to_the_coordinator_and_text_is_streamed(
    stand_in: tuple[_StandInCoordinator, str],
) -> None:
    coordinator, listen = stand_in
    traceparent = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
    async with httpx.AsyncClient(base_url=f"http://{listen}/v1", timeout=30) as http:
        answer = await http.post(
            "/completions",
            json={"prompt": "Which names?", "max_tokens": 50},
            headers={"traceparent": traceparent, "X-Hexgen-Workflow": "w", "X-Hexgen-Stage": "s"},
        )
        assert answer.status_code == 200, answer.text
        assert answer.headers["X-Hexgen-Query"] == "w"
        assert answer.headers["X-Hexgen-Call"] == "w/0.0"
        assert answer.headers["X-Hexgen-Deadline-S"] == "12.500"  # the call's stage's
        body = answer.json()
        assert body["choices"][0]["text"] == "SELECT name FROM t"
        # Real text: its tokens are estimated (18 characters / 4), not the declared 50.
        assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
        for rpc in ("OpenWorkflow", "RunCall"):
            sent = coordinator.metadata[rpc]["traceparent"]
            assert sent.split("-")[1] == TRACE_ID, (rpc, sent)  # the caller's trace
            assert sent.split("-")[2] != "00f067aa0ba902b7"  # the gateway's own span

        async with http.stream(
            "POST",
            "/chat/completions",
            json={"messages": [{"role": "user", "content": "q"}], "stream": True},
            headers={"X-Hexgen-Workflow": "w", "X-Hexgen-Stage": "s"},
        ) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            assert stream.headers["X-Hexgen-Call"] == "w/0.1"
            lines = [line async for line in stream.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    assert deltas == ["", "SELECT ", "name FROM t", ""]  # the tokens, then the rest
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
