"""A call's options (sampling, stop, seed, tools, tool_choice, response_format) at each
engine, and what the engines report back (finish reason, tool calls, usage):

- the `openai` engine sends them verbatim to a real HTTP server and joins the tool calls it
  streams back;
- the `vllm` engine plans them into SamplingParams and structured output, and names the
  option it cannot honour (`UnsupportedOptionError`), which the gateway answers as a 400
  naming the request's field (through a stand-in coordinator on real gRPC);
- the simulated engine's synthetic JSON validates against the schemas tools and structured
  output use (Pydantic's included).
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from collections.abc import AsyncIterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import httpx
import jsonschema
import pytest
from pydantic import BaseModel

from hexgen_api.v1 import coordinator_pb2, worker_pb2, workflow_pb2
from hexgen_coordinator.worker_messages import Run
from hexgen_coordinator.worker_wire import encode_command
from hexgen_launch.processes import free_port
from hexgen_service.convert import dispatch_to_ticket
from hexgen_service.server import GrpcServer
from hexgen_worker.convert import dispatch_messages, dispatch_options
from hexgen_worker.engines import OpenAIEngine
from hexgen_worker.engines.base import CallOptions, UnsupportedOptionError
from hexgen_worker.engines.structured import structured_answer, synthetic_value
from hexgen_worker.engines.vllm import VllmEngine, _VllmApi
from hexgen_worker.events import CallFinished
from test_worker_chat import Received, Worker, ticket

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


class ToolCallServer:
    """An OpenAI-compatible server that streams a tool call in pieces (as vLLM and OpenAI
    do: the id and name first, the arguments in fragments) and records each request."""

    def __init__(self) -> None:
        self.received: list[Received] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.received.append(Received(self.path, body))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                call = {"index": 0, "id": "call_1", "type": "function"}
                for delta in (
                    {"role": "assistant"},
                    {"tool_calls": [{**call, "function": {"name": "get_weather"}}]},
                    {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
                    {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]},
                ):
                    self._event({"choices": [{"index": 0, "delta": delta}]})
                self._event({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
                usage = {"prompt_tokens": 31, "completion_tokens": 9}
                self._event({"choices": [], "usage": usage})
                self.wfile.write(b"data: [DONE]\n\n")
                self.close_connection = True

            def _event(self, data: dict[str, Any]) -> None:
                self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
                self.wfile.flush()

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> ToolCallServer:
        import threading

        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def options_pb() -> workflow_pb2.CallOptions:
    return workflow_pb2.CallOptions(
        temperature=0.0,  # given: sent, though it is proto3's default value
        top_p=0.5,
        stop=["\n\n"],
        seed=11,
        tools_json=json.dumps([WEATHER]),
        tool_choice_json='"auto"',
        response_format_json='{"type": "json_object"}',
        parallel_tool_calls=False,
    )


def test_the_openai_engine_sends_the_options_verbatim_and_joins_streamed_tool_calls() -> None:
    with ToolCallServer() as server:
        worker = Worker(OpenAIEngine(url=server.url, model="smol"))
        call = ticket("tools", 0)
        chat = [workflow_pb2.ChatMessage(role="user", content="weather in Oslo?")]
        pb = encode_command(Run.of(call, "", "", chat, options_pb())).dispatch

        async def body() -> CallFinished:
            worker.state.dispatch(
                dispatch_to_ticket(pb),
                messages=dispatch_messages(pb),
                options=dispatch_options(pb),
            )
            return await worker.finish("tools")

        done = worker.run(body)
    assert done.error == ""
    assert done.finish_reason == "tool_calls"
    assert [(c.id, c.name, c.arguments) for c in done.tool_calls] == [
        ("call_1", "get_weather", '{"city": "Oslo"}')
    ]
    assert (done.prompt_tokens, done.output_tokens) == (31, 9)
    # no text at all: the first tool-call piece is the first token
    assert done.started_s < done.first_token_s <= done.finished_s
    [request] = server.received
    assert request.path == "/v1/chat/completions"
    sent = request.body
    assert sent["temperature"] == 0.0 and sent["top_p"] == 0.5 and sent["seed"] == 11
    assert sent["stop"] == ["\n\n"] and sent["tools"] == [WEATHER]
    assert sent["tool_choice"] == "auto" and sent["parallel_tool_calls"] is False
    assert sent["response_format"] == {"type": "json_object"}
    assert "ignore_eos" not in sent  # a call that may stop early is let stop


def test_a_dispatch_without_options_has_none_and_bad_json_names_the_field() -> None:
    assert dispatch_options(worker_pb2.DispatchCall(call_id="q/0.0")) == CallOptions()
    bad = worker_pb2.DispatchCall(options=workflow_pb2.CallOptions(tools_json="{nope"))
    with pytest.raises(ValueError, match=r"options\.tools_json"):
        dispatch_options(bad)


class _Structured:
    """A stand-in for vLLM's structured-output params class: records its schema."""

    def __init__(self, json: dict[str, Any]) -> None:
        self.json = json


def test_the_vllm_engine_plans_options_or_names_the_one_it_cannot_honour() -> None:
    engine = VllmEngine(model="m", engine_args={"enforce_eager": True})
    with_structured = _VllmApi(None, None, None, None, ("structured_outputs", _Structured))
    without = _VllmApi(None, None, None, None, None)
    tools = (WEATHER,)

    sampling = CallOptions(temperature=0.3, stop=("END",), seed=5)
    extra, _ = engine._plan(sampling, without)
    assert extra == {"temperature": 0.3, "stop": ["END"], "seed": 5}

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    json_format = CallOptions(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    )
    extra, _ = engine._plan(json_format, with_structured)
    assert extra["structured_outputs"].json == schema
    with pytest.raises(UnsupportedOptionError, match=r"^unsupported option response_format: "):
        engine._plan(json_format, without)

    named = CallOptions(
        tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    extra, plan = engine._plan(named, with_structured)
    assert extra["structured_outputs"].json == WEATHER["function"]["parameters"]  # type: ignore[index]
    assert plan.forced and plan.name == "get_weather"
    required = CallOptions(tools=tools, tool_choice="required")
    extra, plan = engine._plan(required, with_structured)
    assert extra["structured_outputs"].json["type"] == "array" and plan.name is None
    # "auto" needs a tool-call parser, which this engine was not given.
    with pytest.raises(UnsupportedOptionError, match=r"^unsupported option tool_choice: ") as err:
        engine._plan(CallOptions(tools=tools), with_structured)
    assert err.value.field == "tool_choice" and "tool_call_parser" in str(err.value)
    assert engine.tool_call_parser == "" and engine.engine_args == {"enforce_eager": True}
    assert VllmEngine(model="m", engine_args={"tool_call_parser": "hermes"}).engine_args == {}


class Invoice(BaseModel):
    number: int
    lines: list[dict[str, float]]
    paid: bool | None
    customer: Customer


class Customer(BaseModel):
    name: str
    tier: str = "gold"


Invoice.model_rebuild()

SCHEMAS: list[dict[str, Any]] = [
    Invoice.model_json_schema(),
    {"type": "array", "items": {"type": "string", "format": "date"}, "minItems": 3},
    {"type": ["null", "integer"], "minimum": 5, "exclusiveMaximum": 7, "multipleOf": 2},
    {"allOf": [{"properties": {"a": {"const": 1}}}, {"properties": {"b": {"type": "boolean"}}}]},
    {"type": "string", "minLength": 40, "maxLength": 41},
    {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    {"$ref": "#/$defs/node", "$defs": {"node": {
        "type": "object",
        "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["children"],
    }}},
]  # fmt: skip


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_synthetic_values_validate_against_their_schema(schema: dict[str, Any]) -> None:
    for seed in range(5):
        jsonschema.validate(synthetic_value(schema, random.Random(seed)), schema)


def test_structured_answers_are_deterministic_and_labelled() -> None:
    options = CallOptions(tools=(WEATHER,))
    first = structured_answer(options, (), "weather?")
    assert first == structured_answer(options, (), "weather?")
    assert first is not None and first[0] == ""
    [call] = first[1]
    assert call.id.startswith("call_synthetic_") and json.loads(call.arguments)["city"].startswith(
        "synthetic"
    )
    assert structured_answer(CallOptions(), (), "hello") is None  # nothing asked: no answer


# ------------------------------------------ an option the engine cannot honour: a 400


class _RefusingCoordinator:
    """OpenWorkflow and RunCall of a coordinator whose call fails as a worker's does when its
    engine cannot honour an option (the query's failure reason carries the worker's error)."""

    def register(self, server: grpc.aio.Server) -> None:
        handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            "OpenWorkflow": grpc.unary_unary_rpc_method_handler(
                self.open_workflow,
                request_deserializer=coordinator_pb2.OpenWorkflowRequest.FromString,
                response_serializer=coordinator_pb2.OpenWorkflowResponse.SerializeToString,
            ),
            "RunCall": grpc.unary_stream_rpc_method_handler(
                self.run_call,
                request_deserializer=coordinator_pb2.RunCallRequest.FromString,
                response_serializer=coordinator_pb2.RunCallResponse.SerializeToString,
            ),
            "CancelQuery": grpc.unary_unary_rpc_method_handler(
                self.cancel,
                request_deserializer=coordinator_pb2.CancelQueryRequest.FromString,
                response_serializer=coordinator_pb2.CancelQueryResponse.SerializeToString,
            ),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("hexgen_flow.v1.CoordinatorService", handlers),)
        )

    async def open_workflow(
        self, request: coordinator_pb2.OpenWorkflowRequest, context: Any
    ) -> coordinator_pb2.OpenWorkflowResponse:
        info = coordinator_pb2.QueryInfo(query_id=request.workflow_id, deadline_s=30.0)
        return coordinator_pb2.OpenWorkflowResponse(workflow=info, created=True)

    async def cancel(
        self, request: coordinator_pb2.CancelQueryRequest, context: Any
    ) -> coordinator_pb2.CancelQueryResponse:
        return coordinator_pb2.CancelQueryResponse()

    async def run_call(
        self, request: coordinator_pb2.RunCallRequest, context: Any
    ) -> AsyncIterator[coordinator_pb2.RunCallResponse]:
        assert request.call.options.tools_json  # the options came along
        call_id = f"{request.workflow_id}/0.0"
        k = coordinator_pb2
        yield k.RunCallResponse(
            call_id=call_id,
            deadline_s=10.0,
            event=k.QueryEvent(kind=k.QUERY_EVENT_KIND_CALL_SUBMITTED, call_id=call_id),
        )
        reason = (
            f"call {call_id} failed 3 times; last error: vllm engine: UnsupportedOptionError: "
            'unsupported option tool_choice: "auto" needs a tool-call parser'
        )
        yield k.RunCallResponse(event=k.QueryEvent(kind=k.QUERY_EVENT_KIND_FAILED, text=reason))


@pytest.fixture
async def refusing(tmp_path: Path) -> AsyncIterator[str]:
    address = f"127.0.0.1:{free_port()}"
    server = GrpcServer(
        address,
        _RefusingCoordinator().register,
        ["hexgen_flow.v1.CoordinatorService"],
        grace_s=0.1,
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
                    await http.get(f"http://{listen}/metrics", timeout=2)
                    break
                except httpx.TransportError:
                    await asyncio.sleep(0.1)
        yield listen
    finally:
        proc.terminate()
        await proc.wait()
        log.close()
        await server.stop()


async def test_an_option_the_engine_cannot_honour_is_a_400_naming_it(refusing: str) -> None:
    chat = {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}
    async with httpx.AsyncClient(base_url=f"http://{refusing}/v1", timeout=30) as http:
        answer = await http.post("/chat/completions", json=chat)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == "tool_choice" and error["code"] == "unsupported_parameter"
        assert "needs a tool-call parser" in error["message"]
        streamed = await http.post("/chat/completions", json={**chat, "stream": True})
    # The status line of a stream is sent before the call runs: the error is its chunk.
    assert streamed.status_code == 200
    [error_chunk] = [
        json.loads(line.removeprefix("data: "))
        for line in streamed.text.splitlines()
        if line.startswith("data: {") and '"error"' in line
    ]
    assert error_chunk["error"]["param"] == "tool_choice"
