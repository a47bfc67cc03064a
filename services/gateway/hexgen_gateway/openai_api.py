"""OpenAI's request and response shapes: the request's checks (400 naming the field), the
chat messages rendered into one prompt, and the bodies and stream chunks.

The messages travel as they are (roles, tool calls, tool answers): an engine with the
model's chat template applies it. Their plain rendering, for engines without one, is one
``role: content`` line per message, then ``assistant:``.

Options pass through, never dropped: ``temperature``, ``top_p``, ``stop``, ``seed``,
``presence_penalty``, ``frequency_penalty``, ``tools``, ``tool_choice``,
``parallel_tool_calls`` and ``response_format`` are checked here (400 naming the field)
and travel with the call (`hexgen_api` ``CallOptions``) to the worker's engine, which
honours each one or fails the call naming it (a 400 naming the request's field, see
`hexgen_gateway.mapping`). Options no engine here honours (``logprobs``, ``logit_bias``,
the legacy ``functions``) are refused with a 400 rather than ignored; fields that change
nothing in the answer (``user``, ``metadata``, ``store``, ...) are accepted.

Roles are OpenAI's: ``system``, ``developer``, ``user``, ``assistant``, ``tool``; any other
is a 400 naming ``messages[i].role``. ``model``, when given, is a non-empty string.

A body is read as JSON by `parse_body`, which a hostile body cannot make fail any other way
than 400: nesting too deep to parse, or an integer of more digits than Python converts, is
the body's fault (``invalid_json``), not the gateway's. Every string of a body must be
UTF-8 text (JSON may spell a lone UTF-16 surrogate, ``"\\ud800"``, which no engine could
be sent): 400 naming where it is. Numbers are checked against what the coordinator accepts
(`MAX_TOKENS_PER_CALL`) before any RPC.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hexgen_api.v1 import workflow_pb2
from hexgen_gateway.errors import bad_request
from hexgen_gateway.mapping import CallRequest
from hexgen_service.convert import MAX_TOKENS_PER_CALL

__all__ = [
    "ROLES",
    "ParsedRequest",
    "chunk",
    "completion_body",
    "parse_body",
    "parse_chat",
    "parse_completion",
    "parse_options",
    "render_chat",
    "shown",
    "tool_calls_json",
    "usage",
]

_INT_DIGITS = 4000
"""Longer JSON integers are read as floats (inf past 1e308): Python refuses to convert an
integer of more than 4300 digits, and no field of a request needs one."""
_SHOWN_CHARS = 60
"""How much of a refused value an error message repeats."""


def parse_body(raw: bytes) -> object:
    """The JSON of a request's body; `OpenAIError` 400 (``invalid_json``) when it is none."""
    try:
        return json.loads(raw, parse_int=_json_int)
    except RecursionError:
        raise bad_request(
            "the body is nested too deeply to be read", None, "invalid_json"
        ) from None
    except (ValueError, UnicodeDecodeError):  # JSONDecodeError is a ValueError
        raise bad_request("the body is not valid JSON", None, "invalid_json") from None


def _json_int(digits: str) -> int | float:
    return int(digits) if len(digits) <= _INT_DIGITS else float(digits)


def shown(value: object) -> str:
    """`value` as an error message repeats it: short, and never walked (a nested list or
    object is named by its type only)."""
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**_SHOWN_CHARS:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else f"{text[:_SHOWN_CHARS]}... ({len(text)} chars)"


def check_text(body: object) -> None:
    """400 naming the first string of `body` (a value, at any depth) that is not UTF-8 text
    (a lone surrogate), e.g. ``messages[0].content``. Iterative: parsed JSON nests only as
    deep as `parse_body` could read, but a recursive walk could still exhaust the stack."""
    pending: list[tuple[object, str]] = [(body, "")]
    while pending:
        value, where = pending.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise bad_request(
                        f"{where or 'the body'} is not valid UTF-8 text: a lone surrogate "
                        f"(U+{ord(value[exc.start]):04X}) at character {exc.start}",
                        where or None,
                    ) from None
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                if isinstance(item, str | list | dict):
                    pending.append((item, f"{where}.{key}" if where else str(key)))
        elif isinstance(value, list):
            for i in range(len(value) - 1, -1, -1):
                item = value[i]
                if isinstance(item, str | list | dict):
                    pending.append((item, f"{where}[{i}]"))


ROLES = ("system", "developer", "user", "assistant", "tool")
"""The chat roles a request may use."""
_REFUSED = {
    "logprobs": "log probabilities are not returned by this gateway",
    "top_logprobs": "log probabilities are not returned by this gateway",
    "logit_bias": "logit_bias is not supported by the mesh's engines",
    "functions": "the legacy functions field is not supported: use tools",
    "function_call": "the legacy function_call field is not supported: use tool_choice",
    "best_of": "best_of is not supported (one completion per request)",
    "echo": "echo is not supported",
    "suffix": "suffix is not supported",
}
"""Fields that would change the answer and that no engine of the mesh honours: refused
(400) when given a value other than their default, never ignored."""
_DEFAULTS: dict[str, tuple[object, ...]] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "functions": (None, []),
    "function_call": (None,),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
}
_MAX_STOP = 4


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A checked request: its call, the model asked for, whether to stream."""

    call: CallRequest
    model: str | None
    stream: bool
    include_usage: bool
    chat: bool

    @property
    def object_prefix(self) -> str:
        return "chatcmpl" if self.chat else "cmpl"


def render_chat(messages: list[dict[str, Any]]) -> str:
    """The messages as one prompt: ``role: content`` lines (an assistant's tool calls as
    ``name(arguments)``), then ``assistant:``."""
    lines = []
    for m in messages:
        calls = " ".join(
            f"[tool call {c['function']['name']}({c['function']['arguments']})]"
            for c in m.get("tool_calls", ())
        )
        text = " ".join(part for part in (m["content"], calls) if part)
        lines.append(f"{m['role']}: {text}")
    return "\n".join([*lines, "assistant:"])


def _tool_calls(value: object, index: int) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, checked (400 naming the part)."""
    where = f"messages[{index}].tool_calls"
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request("tool_calls must be a list", where)
    calls: list[dict[str, Any]] = []
    for j, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise bad_request(
                'a tool call must be {"id", "type": "function", "function": {...}}',
                f"{where}[{j}]",
            )
        name, arguments, ident = function.get("name"), function.get("arguments"), call.get("id")
        if not isinstance(name, str) or not name:
            raise bad_request("a tool call needs a function name", f"{where}[{j}].function.name")
        if not isinstance(arguments, str):
            raise bad_request(
                "a tool call's arguments must be a JSON string",
                f"{where}[{j}].function.arguments",
            )
        if not isinstance(ident, str) or not ident:
            raise bad_request("a tool call needs an id", f"{where}[{j}].id")
        calls.append({"id": ident, "function": {"name": name, "arguments": arguments}})
    return calls


def _message(message: object, i: int) -> dict[str, Any]:
    """One message, checked: role, content, and the tool fields of its role."""
    if not isinstance(message, dict):
        raise bad_request("a message must be an object", f"messages[{i}]")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise bad_request("a message needs a role", f"messages[{i}].role")
    if role not in ROLES:
        raise bad_request(
            f"unknown role {shown(role)}: a role is one of {', '.join(ROLES)}",
            f"messages[{i}].role",
        )
    out: dict[str, Any] = {"role": role, "content": _message_text(message.get("content"), i)}
    if role == "assistant":
        out["tool_calls"] = _tool_calls(message.get("tool_calls"), i)
    if role == "tool":
        ident = message.get("tool_call_id")
        if not isinstance(ident, str) or not ident:
            raise bad_request(
                "a tool message needs the tool_call_id it answers", f"messages[{i}].tool_call_id"
            )
        out["tool_call_id"] = ident
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise bad_request("name must be a string", f"messages[{i}].name")
        out["name"] = name
    return out


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not low <= value <= high
    ):
        raise bad_request(
            f"{name} must be a number from {low:g} to {high:g}, got {shown(value)}", name
        )
    return float(value)


def _tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_request("tools must be a list", "tools")
    names: set[str] = set()
    for j, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function":
            raise bad_request(
                'a tool must be {"type": "function", "function": {"name", "parameters"}}',
                f"tools[{j}]",
            )
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("a function needs a name", f"tools[{j}].function.name")
        if name in names:
            raise bad_request(f"two tools are named {shown(name)}", f"tools[{j}].function.name")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(
                "parameters must be a JSON Schema object", f"tools[{j}].function.parameters"
            )
    return tools


def _tool_choice(body: dict[str, Any], tools: list[dict[str, Any]]) -> object:
    choice = body.get("tool_choice")
    if choice is None:
        return None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request(
                'tool_choice must be "none", "auto", "required" or a function, '
                f"got {shown(choice)}",
                "tool_choice",
            )
        if choice == "required" and not tools:
            raise bad_request('tool_choice "required" needs tools', "tool_choice")
        return choice
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise bad_request(
            'tool_choice must be a string or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in {t["function"]["name"] for t in tools}:
        raise bad_request(
            f"tool_choice names {shown(name)}, which is not one of the tools", "tool_choice"
        )
    return choice


def _response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    value = body.get("response_format")
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise bad_request(
            'response_format must be {"type": "text"}, {"type": "json_object"} or '
            '{"type": "json_schema", "json_schema": {...}}',
            "response_format",
        )
    assert isinstance(value, dict)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise bad_request(
                "json_schema must be an object with a name and a schema",
                "response_format.json_schema",
            )
        schema = spec.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise bad_request(
                "the schema must be a JSON Schema object", "response_format.json_schema.schema"
            )
    return value


def parse_options(body: dict[str, Any], *, chat: bool) -> workflow_pb2.CallOptions | None:
    """The request's generation options, checked (400 naming the field); None without
    any. Fields no engine honours are refused, not ignored (`_REFUSED`)."""
    for name, why in _REFUSED.items():
        if body.get(name) not in _DEFAULTS[name]:
            raise bad_request(why, name, "unsupported_parameter")
    options = workflow_pb2.CallOptions()
    given = False
    for name, low, high in (
        ("temperature", 0.0, 2.0),
        ("top_p", 0.0, 1.0),
        ("presence_penalty", -2.0, 2.0),
        ("frequency_penalty", -2.0, 2.0),
    ):
        value = _number(body, name, low, high)
        if value is not None:
            setattr(options, name, value)
            given = True
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if (
            not isinstance(stop, list)
            or not all(isinstance(s, str) and s for s in stop)
            or len(stop) > _MAX_STOP
        ):
            raise bad_request(
                f"stop must be a string or a list of at most {_MAX_STOP} non-empty strings",
                "stop",
            )
        options.stop.extend(stop)
        given = given or bool(stop)
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**63:
            raise bad_request(f"seed must be a 64-bit integer, got {shown(seed)}", "seed")
        options.seed = seed
        given = True
    tools = _tools(body)
    choice = _tool_choice(body, tools)
    response_format = _response_format(body)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if not chat:
        for name, chat_only in (
            ("tools", tools),
            ("tool_choice", choice),
            ("parallel_tool_calls", parallel),
        ):
            if chat_only:
                raise bad_request(f"{name} is a chat completions field", name)
    if tools:
        options.tools_json = _json(tools)
    if choice is not None:
        options.tool_choice_json = _json(choice)
    if response_format is not None and response_format.get("type") != "text":
        options.response_format_json = _json(response_format)
    if parallel is not None:
        options.parallel_tool_calls = parallel
    given = given or bool(tools) or choice is not None or bool(options.response_format_json)
    return options if given or parallel is not None else None


def _json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _message_text(content: object, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise bad_request(
                    "only text content parts are supported", f"messages[{index}].content[{j}]"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request("a text part needs a string 'text'", f"messages[{index}].content")
            parts.append(text)
        return "".join(parts)
    raise bad_request("content must be a string or a list of parts", f"messages[{index}].content")


def _common(body: dict[str, Any], default_max_tokens: int) -> tuple[int, str | None, bool, bool]:
    """max_tokens, model, stream, include_usage: checked."""
    names = ("max_completion_tokens", "max_tokens")
    max_tokens: object = default_max_tokens
    param = "max_tokens"
    for name in names:
        if body.get(name) is not None:
            max_tokens, param = body[name], name
            break
    if (
        isinstance(max_tokens, bool)
        or not isinstance(max_tokens, int)
        or not 1 <= max_tokens <= MAX_TOKENS_PER_CALL
    ):
        raise bad_request(
            f"{param} must be an integer from 1 to {MAX_TOKENS_PER_CALL}, got {shown(max_tokens)}",
            param,
        )
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model.strip()):
        raise bad_request(f"model must be a non-empty string, got {shown(model)}", "model")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("stream must be a boolean", "stream")
    n = body.get("n", 1)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int | float) or n != 1):
        raise bad_request(f"only n=1 is supported, got {shown(n)}", "n")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    include_usage = bool(options.get("include_usage", False))
    return max_tokens, model or None, stream, include_usage


def parse_chat(body: object, default_max_tokens: int) -> ParsedRequest:
    """A ``/v1/chat/completions`` body, checked."""
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object", None)
    check_text(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages", "missing_required")
    rendered = [_message(message, i) for i, message in enumerate(messages)]
    max_tokens, model, stream, include_usage = _common(body, default_max_tokens)
    call = CallRequest(
        render_chat(rendered),
        max_tokens,
        "messages",
        tuple(_chat_message(m) for m in rendered),
        parse_options(body, chat=True),
    )
    return ParsedRequest(call, model, stream, include_usage, chat=True)


def _chat_message(message: dict[str, Any]) -> workflow_pb2.ChatMessage:
    return workflow_pb2.ChatMessage(
        role=message["role"],
        content=message["content"],
        tool_calls=[
            workflow_pb2.ToolCall(
                id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"]
            )
            for c in message.get("tool_calls", ())
        ],
        tool_call_id=message.get("tool_call_id", ""),
        name=message.get("name", ""),
    )


def parse_completion(body: object, default_max_tokens: int) -> ParsedRequest:
    """A ``/v1/completions`` body, checked (one string prompt)."""
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object", None)
    check_text(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise bad_request(
            "prompt must be a non-empty string (one prompt per request)",
            "prompt",
            "missing_required",
        )
    max_tokens, model, stream, include_usage = _common(body, default_max_tokens)
    call = CallRequest(prompt, max_tokens, "prompt", (), parse_options(body, chat=False))
    return ParsedRequest(call, model, stream, include_usage, False)


def new_id(request: ParsedRequest) -> str:
    return f"{request.object_prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def tool_calls_json(calls: Sequence[workflow_pb2.ToolCall]) -> list[dict[str, Any]]:
    """Tool calls in OpenAI's shape."""
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]


def completion_body(
    request: ParsedRequest,
    ident: str,
    model: str,
    text: str,
    use: dict[str, int],
    finish_reason: str = "stop",
    tool_calls: Sequence[workflow_pb2.ToolCall] = (),
) -> dict[str, Any]:
    """The whole answer (no stream): the text or the tool calls, and why generation
    ended as the engine says."""
    created = int(time.time())
    if request.chat:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message["content"] = text or None
            message["tool_calls"] = tool_calls_json(tool_calls)
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        kind = "text_completion"
    return {
        "id": ident,
        "object": kind,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": use,
    }


def chunk(
    request: ParsedRequest,
    ident: str,
    model: str,
    *,
    text: str | None = None,
    role: bool = False,
    finish: str | None = None,
    use: dict[str, int] | None = None,
    tool_calls: Sequence[workflow_pb2.ToolCall] = (),
) -> dict[str, Any]:
    """One stream chunk: a piece of text, tool calls, the first (role) or last (`finish`:
    its finish_reason) chunk, or (`use` given) the usage chunk, whose choices are empty."""
    choices: list[dict[str, Any]] = []
    if use is None:
        reason = finish
        if request.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = [
                    {"index": i, **c} for i, c in enumerate(tool_calls_json(tool_calls))
                ]
            choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]
        else:
            choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}]
    body: dict[str, Any] = {
        "id": ident,
        "object": "chat.completion.chunk" if request.chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if use is not None or request.include_usage:
        body["usage"] = use
    return body
