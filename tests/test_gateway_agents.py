"""Agent frameworks through the gateway, for real: `hexgen-flow up` (coordinator, simulated
workers, gateway in their own processes, real Redis) driven by the official `openai` SDK and
by LangChain's `ChatOpenAI` (``bind_tools``, ``with_structured_output``, streaming). The
options a request carries (tools, tool_choice, response_format, sampling) travel to the
worker's engine; the simulated engine's synthetic responder answers tool calls and JSON
schemas, and the finish reason and usage in the answer are what the engine did.

Also the OpenAI surface those frameworks touch: ``/v1/models/{id}``, the checks of roles,
model and headers (400s naming the client's field), the idle timeout of workflows nobody
closes, and the gateway's ``/metrics``."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from langchain_core.messages import AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from openai.types.chat import ChatCompletionMessageFunctionToolCall
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field, SecretStr

from hexgen_client.client import CoordinatorClient
from test_gateway import MODEL, _gateway, base_url, needs_redis_server, sdk
from up_runner import Up, running_up

pytestmark = needs_redis_server

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 2},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}
SEARCH: Any = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["query"],
        },
    },
}
ORDER_SCHEMA: Any = {
    "type": "object",
    "properties": {
        "customer": {"type": "string", "maxLength": 12},
        "total": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
        "items": {
            "type": "array",
            "minItems": 2,
            "items": {"$ref": "#/$defs/item"},
        },
        "status": {"anyOf": [{"type": "null"}, {"enum": ["open", "shipped"]}]},
    },
    "required": ["customer", "total", "items", "status"],
    "additionalProperties": False,
    "$defs": {
        "item": {
            "type": "object",
            "properties": {"sku": {"type": "string"}, "quantity": {"type": "integer"}},
            "required": ["sku", "quantity"],
            "additionalProperties": False,
        }
    },
}


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    with running_up(
        tmp_path_factory.mktemp("agents"),
        "--cluster", "A100",
        "--time-scale", "50",
        "--no-tuner",
        "--admission", "reject",
        "--gateway-listen", "127.0.0.1:0",
    ) as running:  # fmt: skip
        yield running


def chat_model(up: Up, **kwargs: Any) -> ChatOpenAI:
    return ChatOpenAI(
        model=MODEL,
        base_url=base_url(up),
        api_key=SecretStr("unused"),
        max_retries=0,
        timeout=60,
        **kwargs,
    )


# ------------------------------------------------------------------ the openai SDK


def test_tools_come_back_as_a_tool_call_that_validates_and_the_loop_ends(up: Up) -> None:
    client = sdk(up)
    messages: list[Any] = [{"role": "user", "content": "Is it raining in Paris?"}]
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[SEARCH, WEATHER], max_tokens=64
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls or []
    assert isinstance(call, ChatCompletionMessageFunctionToolCall)
    assert call.type == "function" and call.id.startswith("call_synthetic_")
    assert call.function.name == "search"  # the first tool: the message names none
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SEARCH["function"]["parameters"])
    assert arguments["query"].startswith("synthetic")  # labelled
    assert choice.message.content is None
    assert answer.usage is not None
    assert 0 < answer.usage.completion_tokens < 64  # what the engine made, not the budget

    # A tool named in the message is the one called; tool_choice can force one.
    named = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "call get_weather for Oslo"}],
        tools=[SEARCH, WEATHER],
        max_tokens=64,
    )
    [weather] = named.choices[0].message.tool_calls or []
    assert isinstance(weather, ChatCompletionMessageFunctionToolCall)
    assert weather.function.name == "get_weather"
    jsonschema.validate(json.loads(weather.function.arguments), WEATHER["function"]["parameters"])
    forced = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[SEARCH, WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=64,
    )
    assert [
        c.function.name
        for c in forced.choices[0].message.tool_calls or []
        if isinstance(c, ChatCompletionMessageFunctionToolCall)
    ] == ["get_weather"]
    # The tool's answer goes back: the model answers in text, the loop ends.
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "light rain, 12 C"},
    ]
    final = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[SEARCH, WEATHER], max_tokens=16
    )
    assert final.choices[0].finish_reason == "length"  # the placeholder: all 16 tokens
    assert not final.choices[0].message.tool_calls
    assert (final.choices[0].message.content or "").startswith("[simulated ")
    # tool_choice "none": no tool call either.
    none = client.chat.completions.create(
        model=MODEL, messages=messages[:1], tools=[WEATHER], tool_choice="none", max_tokens=8
    )
    assert none.choices[0].finish_reason == "length" and not none.choices[0].message.tool_calls


def test_a_json_schema_answer_validates_and_streams(up: Up) -> None:
    client = sdk(up)
    response_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "order", "schema": ORDER_SCHEMA, "strict": True},
    }
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Summarise order 7."}],
        response_format=response_format,
        temperature=0.2,
        top_p=0.9,
        seed=7,
        max_tokens=400,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    order = json.loads(choice.message.content or "")
    jsonschema.validate(order, ORDER_SCHEMA)
    assert order["customer"].startswith("synthetic")
    assert answer.usage is not None and answer.usage.completion_tokens < 400

    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Summarise order 8."}],
        response_format={"type": "json_object"},
        max_tokens=400,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and 0 < chunks[-1].usage.completion_tokens < 400

    # Cut at max_tokens: the JSON is cut too, and the answer says so (as OpenAI's does).
    short = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Summarise order 9."}],
        response_format=response_format,
        max_tokens=3,
    )
    assert short.choices[0].finish_reason == "length"
    assert short.usage is not None and short.usage.completion_tokens == 3


def test_streamed_tool_calls(up: Up) -> None:
    stream = sdk(up).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "weather?"}],
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=64,
        stream=True,
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    [call] = [t for d in deltas for t in d.tool_calls or []]
    assert call.index == 0 and call.function is not None
    assert call.function.name == "get_weather"
    jsonschema.validate(
        json.loads(call.function.arguments or ""), WEATHER["function"]["parameters"]
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


# ------------------------------------------------------------------ LangChain


@tool
def get_weather(city: str, days: int) -> str:
    """The weather in a city for the next days."""
    return f"sunny in {city} for {days} days"


class Order(BaseModel):
    """An order's summary."""

    customer: str = Field(description="who ordered")
    total: float
    shipped: bool
    tags: list[str]


def test_langchain_bind_tools_structured_output_and_streaming(up: Up) -> None:
    llm = chat_model(up, max_tokens=128)
    # bind_tools: the tool call comes back parsed, with arguments of the tool's schema.
    agent = llm.bind_tools([get_weather])
    question = HumanMessage("What is the weather in Lyon this week?")
    reply = agent.invoke([question])
    [call] = reply.tool_calls
    assert call["name"] == "get_weather"
    assert isinstance(call["args"]["city"], str) and isinstance(call["args"]["days"], int)
    assert reply.response_metadata["finish_reason"] == "tool_calls"
    # The tool runs, its answer goes back, the model answers in text.
    result = get_weather.invoke(call)
    assert isinstance(result, ToolMessage)
    done = agent.invoke([question, reply, result])
    assert not done.tool_calls and str(done.content).startswith("[simulated ")

    # with_structured_output: a parsed Pydantic object (response_format json_schema).
    order = llm.with_structured_output(Order).invoke("Summarise the last order.")
    assert isinstance(order, Order) and order.customer.startswith("synthetic")
    assert order.tags and all(t.startswith("synthetic") for t in order.tags)

    # Streaming: text chunks, and tool-call chunks that add up to the call.
    streamed = "".join(str(c.content) for c in llm.stream("Say something."))
    assert streamed.startswith("[simulated ")
    total: AIMessageChunk | None = None
    for piece in agent.stream([question]):
        assert isinstance(piece, AIMessageChunk)
        total = piece if total is None else total + piece
    assert total is not None
    assert [c["name"] for c in total.tool_calls] == ["get_weather"]


# ------------------------------------------------------------------ the OpenAI surface


def test_a_model_by_id(up: Up) -> None:
    client = sdk(up)
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4o")
    assert err.value.code == "model_not_found"


def test_requests_are_checked_and_errors_name_the_clients_fields(up: Up) -> None:
    url = base_url(up)
    user = [{"role": "user", "content": "x"}]
    cases: list[tuple[dict[str, Any], dict[str, str], str]] = [
        ({"messages": [{"role": "wizard", "content": "x"}]}, {}, "messages[0].role"),
        ({"model": "", "messages": user}, {}, "model"),
        ({"messages": user}, {"X-Hexgen-Stage": ""}, "X-Hexgen-Stage"),
        ({"messages": user}, {"X-Hexgen-Workflow": ""}, "X-Hexgen-Workflow"),
        ({"messages": user}, {"X-Hexgen-Idle-S": "-1"}, "X-Hexgen-Idle-S"),
        ({"messages": user, "temperature": 3}, {}, "temperature"),
        ({"messages": user, "stop": [1]}, {}, "stop"),
        ({"messages": user, "tools": [{"type": "function"}]}, {}, "tools[0]"),
        ({"messages": user, "tool_choice": "required"}, {}, "tool_choice"),
        ({"messages": user, "response_format": {"type": "xml"}}, {}, "response_format"),
        ({"messages": user, "logprobs": True}, {}, "logprobs"),
        ({"messages": [{"role": "tool", "content": "x"}]}, {}, "messages[0].tool_call_id"),
        # Too large for the cluster: the coordinator's field is the expected workflow's
        # output_tokens; the answer names the request's.
        ({"messages": user, "max_tokens": 9_000_000}, {}, "max_tokens"),
    ]
    for body, headers, param in cases:
        answer = httpx.post(f"{url}/chat/completions", json=body, headers=headers, timeout=30)
        assert answer.status_code == 400, (body, answer.text)
        error = answer.json()["error"]
        assert error["param"] == param, (body, error)
        assert "expected." not in error["message"] and "calls[" not in error["message"], error
    answer = httpx.post(f"{url}/completions", json={"prompt": "x", "tools": [WEATHER]}, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "tools"


def test_a_workflow_nobody_closes_ends_after_its_idle_time(up: Up, tmp_path: Path) -> None:
    async def state(workflow: str) -> int:
        async with CoordinatorClient(up.coordinator) as coordinator:
            return int((await coordinator.get(workflow)).query.state)

    def ends(workflow: str, within_s: float) -> bool:
        end = time.monotonic() + within_s
        while time.monotonic() < end:
            if asyncio.run(state(workflow)) != 1:  # no longer RUNNING
                return True
            time.sleep(0.25)
        return False

    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    # The request's own idle time (X-Hexgen-Idle-S, on the workflow's first request).
    workflow = f"idle-{uuid.uuid4().hex[:8]}"
    headers = {"X-Hexgen-Workflow": workflow, "X-Hexgen-Idle-S": "1"}
    answer = httpx.post(f"{base_url(up)}/chat/completions", json=chat, headers=headers, timeout=30)
    assert answer.status_code == 200, answer.text
    assert ends(workflow, 10), "the workflow is still running past its idle time"
    # The gateway's (--session-idle-s), for workflows whose requests say nothing.
    with _gateway(tmp_path, up.coordinator, "--session-idle-s", "1") as listen:
        quiet = f"quiet-{uuid.uuid4().hex[:8]}"
        answer = httpx.post(
            f"http://{listen}/v1/chat/completions",
            json=chat,
            headers={"X-Hexgen-Workflow": quiet},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        assert ends(quiet, 10), "the workflow is still running past the gateway's idle time"


def test_the_gateway_metrics(up: Up) -> None:
    root = base_url(up).removesuffix("/v1")
    client = sdk(up)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "m"}])
    httpx.post(f"{root}/v1/chat/completions", json={"messages": []}, timeout=30)
    httpx.get(f"{root}/v1/models/{MODEL}", timeout=30)
    httpx.get(f"{root}/no/such/path", timeout=30)
    text = httpx.get(f"{root}/metrics", timeout=30).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return samples.get((name, tuple(sorted(labels.items()))), 0.0)

    requests = "hexgen_flow_gateway_requests_total"
    chat = "/v1/chat/completions"
    assert value(requests, route=chat, method="POST", status="200") >= 1
    assert value(requests, route=chat, method="POST", status="400") >= 1
    assert value(requests, route="/v1/models/{model_id:path}", method="GET", status="200") >= 1
    assert value(requests, route="other", method="GET", status="404") >= 1
    assert value("hexgen_flow_gateway_request_seconds_count", route=chat) >= 2
    assert value("hexgen_flow_gateway_finish_reasons_total", reason="length") >= 1
    assert value("hexgen_flow_gateway_tokens_total", kind="completion") >= 256
