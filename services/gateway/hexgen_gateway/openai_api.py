"""OpenAI's request and response shapes: the request's checks (400 naming the field), the
chat messages rendered into one prompt, and the bodies and stream chunks.

The chat template is deliberately simple: one ``role: content`` line per message, then
``assistant:``. The model's own chat template (from its tokenizer) is a later step.

Sampling options (temperature, top_p, stop, seed, ...) are accepted and ignored: the
coordinator's calls carry a prompt and a token budget only.

A body is read as JSON by `parse_body`, which a hostile body cannot make fail any other way
than 400: nesting too deep to parse, or an integer of more digits than Python converts, is
the body's fault (``invalid_json``), not the gateway's. Every string of a body must be
UTF-8 text (JSON may spell a lone UTF-16 surrogate, ``"\\ud800"``, which no engine could
be sent): 400 naming where it is. Numbers are checked against what the coordinator accepts
(`MAX_TOKENS_PER_CALL`) before any RPC.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from hexgen_gateway.errors import bad_request
from hexgen_gateway.mapping import CallRequest
from hexgen_service.convert import MAX_TOKENS_PER_CALL

__all__ = [
    "ParsedRequest",
    "chunk",
    "completion_body",
    "parse_body",
    "parse_chat",
    "parse_completion",
    "render_chat",
    "shown",
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
    """The messages as one prompt: ``role: content`` lines, then ``assistant:``."""
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join([*lines, "assistant:"])


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
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", "model")
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
    rendered: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request("a message must be an object", f"messages[{i}]")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise bad_request("a message needs a role", f"messages[{i}].role")
        rendered.append({"role": role, "content": _message_text(message.get("content"), i)})
    max_tokens, model, stream, include_usage = _common(body, default_max_tokens)
    call = CallRequest(
        render_chat(rendered),
        max_tokens,
        "messages",
        tuple((m["role"], m["content"]) for m in rendered),
    )
    return ParsedRequest(call, model, stream, include_usage, chat=True)


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
    return ParsedRequest(
        CallRequest(prompt, max_tokens, "prompt"), model, stream, include_usage, False
    )


def new_id(request: ParsedRequest) -> str:
    return f"{request.object_prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    request: ParsedRequest, ident: str, model: str, text: str, use: dict[str, int]
) -> dict[str, Any]:
    """The whole answer (no stream)."""
    created = int(time.time())
    if request.chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": "stop",
        }
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}
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
    finish: bool = False,
    use: dict[str, int] | None = None,
) -> dict[str, Any]:
    """One stream chunk: a piece of text, the first (role) or last (finish_reason) chunk,
    or (`use` given) the usage chunk, whose choices are empty."""
    choices: list[dict[str, Any]] = []
    if use is None:
        reason = "stop" if finish else None
        if request.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
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
