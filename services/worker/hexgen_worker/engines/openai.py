"""An engine that forwards calls to any OpenAI-compatible server (e.g. ``vllm serve``).

Each admitted call becomes one streaming request, ``POST {url}/v1/completions`` (or
``/v1/chat/completions``: below) with ``stream: true``, ``max_tokens`` = the call's output
tokens and ``stream_options.include_usage`` so that the last chunk carries the generated
token count. Every streamed text chunk is reported as a `CallTokens` event.

Prompt: a call dispatched with chat messages (the gateway's ``/v1/chat/completions``, a
session's RunCall with ``messages``) goes to the server's ``/v1/chat/completions`` with
those messages, so that the server applies the model's chat template, whatever ``api``
says. Otherwise the dispatch's prompt when it has one, else `synthetic_prompt` (about
input_tokens common one-token English words), goes to ``/v1/completions``, or with
``api="chat"`` to ``/v1/chat/completions`` as one user message.

Options: a call's options (temperature, top_p, stop, seed, presence and frequency
penalties, tools, tool_choice, parallel_tool_calls, response_format) go in the body
verbatim, by their OpenAI names: the server honours them or refuses the request (the call
then fails with the server's error). A call with tools goes to ``/v1/chat/completions``.
The answer's ``finish_reason``, streamed ``tool_calls`` (joined by index) and usage
(prompt and completion tokens) are reported as the server gives them.

``ignore_eos`` (a vLLM extension, on by default) makes the server generate exactly
max_tokens, so a call costs what the workflow declared; it is not sent with a call that
has stop sequences, tools or a JSON response_format (such a call must be able to stop
early). ``send_priority`` passes the local
queue's order as vLLM's ``priority`` (lower is sooner; the server must run with
``--scheduling-policy priority``).

Capacity: at most ``max_concurrency`` requests in flight (default the worker's max batch)
and their input + output tokens within the declared KV-cache size; the local queue decides
the order, the server batches what it is sent. Needs ``httpx`` (the ``openai`` extra),
imported when the engine starts.
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Sequence
from typing import Any, Literal

from hexgen_flow.runtime import CallTicket
from hexgen_worker.engines.base import (
    NO_OPTIONS,
    CallOptions,
    CallRequest,
    ChatMessage,
    EngineUnavailableError,
    Generated,
    RequestEngine,
    fit_to_context,
    synthetic_prompt,
)
from hexgen_worker.events import CallTokens, ToolCall

__all__ = ["OpenAIEngine", "OpenAIServerError", "api_base"]

log = logging.getLogger(__name__)

OpenAIApi = Literal["completions", "chat"]

# Context kept free for what the server adds to a prompt when calls are shrunk to fit.
_SPECIAL_TOKENS = 8
_CHAT_TEMPLATE_TOKENS = 64


class OpenAIServerError(RuntimeError):
    """The server answered a call with an error (the call is reported as failed)."""


def api_base(url: str) -> str:
    """``http://host:8000`` or ``http://host:8000/v1`` -> ``http://host:8000/v1``."""
    base = url.rstrip("/")
    return base if base.endswith("/v1") else f"{base}/v1"


def _import_httpx() -> Any:
    try:
        return importlib.import_module("httpx")
    except ImportError:
        raise EngineUnavailableError(
            "the openai engine needs httpx: pip install 'hexgen-flow[openai]'"
        ) from None


class OpenAIEngine(RequestEngine):
    """Calls streamed to an OpenAI-compatible HTTP server."""

    kind = "openai"

    def __init__(
        self,
        *,
        url: str,
        model: str = "",
        max_concurrency: int = 256,
        kv_cache_tokens: int = 0,
        api: OpenAIApi = "completions",
        ignore_eos: bool = True,
        send_priority: bool = False,
        request_timeout_s: float = 600.0,
        max_context_tokens: int = 0,
    ) -> None:
        super().__init__(max_concurrency, kv_cache_tokens)
        if api not in ("completions", "chat"):
            raise EngineUnavailableError(f"openai api must be 'completions' or 'chat', got {api!r}")
        self.base_url = api_base(url)
        self.model = model
        self.api: OpenAIApi = api
        self.ignore_eos = ignore_eos
        self.send_priority = send_priority
        self.request_timeout_s = request_timeout_s
        self.max_context_tokens = max_context_tokens
        self._client: Any = None  # httpx.AsyncClient: httpx is an optional dependency

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        httpx = _import_httpx()
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(self.request_timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        if not self.model:
            self.model = await self._served_model()
        log.info(
            "openai engine: %s at %s (%s API, at most %d requests in flight)",
            self.model,
            self.base_url,
            self.api,
            self._ledger.max_concurrency,
        )

    async def _served_model(self) -> str:
        """The first model the server lists (used when no model name was given)."""
        try:
            response = await self._client.get("/models", timeout=10.0)
            response.raise_for_status()
            return str(response.json()["data"][0]["id"])
        except Exception as exc:
            raise EngineUnavailableError(
                f"openai engine: cannot list the models of {self.base_url} "
                f"({type(exc).__name__}: {exc}); give --openai-model"
            ) from None

    async def close(self) -> None:
        await self.cancel_all()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # ------------------------------------------------------------------ one call

    def request_body(
        self,
        ticket: CallTicket,
        prompt: str | None,
        priority: int,
        messages: Sequence[ChatMessage] = (),
        options: CallOptions = NO_OPTIONS,
    ) -> dict[str, Any]:
        """The JSON body of the call's streaming request (`is_chat` tells its endpoint):
        the call's options verbatim, by their OpenAI names."""
        call = ticket.asked()  # the declared cap, not what the queue planned with
        chat = self.is_chat(messages, options)
        input_tokens, max_tokens = fit_to_context(
            call.input_tokens,
            call.output_tokens,
            self.max_context_tokens,
            reserve=_CHAT_TEMPLATE_TOKENS if chat else _SPECIAL_TOKENS,
        )
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if messages:
            body["messages"] = [m.openai() for m in messages]
        else:
            text = prompt if prompt else synthetic_prompt(input_tokens)
            if chat:
                body["messages"] = [{"role": "user", "content": text}]
            else:
                body["prompt"] = text
        if self.ignore_eos and not options.may_stop_early():
            # (a call that may stop early, on a stop sequence or a tool call, is let stop)
            body["ignore_eos"] = True
        if self.send_priority:
            body["priority"] = priority
        body.update(options.openai())
        return body

    def is_chat(
        self, messages: Sequence[ChatMessage] = (), options: CallOptions = NO_OPTIONS
    ) -> bool:
        """Whether a call with these messages and options goes to ``/chat/completions``
        (tools are a chat endpoint's)."""
        return bool(messages) or self.api == "chat" or bool(options.tools)

    async def generate(self, ticket: CallTicket, request: CallRequest, priority: int) -> Generated:
        body = self.request_body(
            ticket, request.prompt, priority, request.messages, request.options
        )
        return await self._stream(
            ticket, body, chat=self.is_chat(request.messages, request.options)
        )

    async def _stream(self, ticket: CallTicket, body: dict[str, Any], *, chat: bool) -> Generated:
        """Run one streaming request: its text, generated tokens, finish reason, tool
        calls (their streamed pieces joined, by index), prompt tokens and when the first
        chunk carrying generated text or a tool call's piece arrived."""
        path = "/chat/completions" if chat else "/completions"
        parts: list[str] = []
        chunks = 0
        usage_tokens: int | None = None
        prompt_tokens = 0
        finish_reason = ""
        first_token_s: float | None = None
        calls: dict[int, list[str]] = {}  # index -> [id, name, arguments]
        async with self._client.stream("POST", path, json=body) as response:
            if response.status_code >= 400:
                detail = (await response.aread()).decode("utf-8", "replace").strip()
                raise OpenAIServerError(f"HTTP {response.status_code}: {detail[:500]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    continue
                if chunk.get("error"):
                    raise OpenAIServerError(str(chunk["error"]))
                for choice in chunk.get("choices") or ():
                    piece = _piece(choice, chat=chat)
                    if first_token_s is None and (piece or _has_tool_pieces(choice)):
                        first_token_s = self.clock.now()
                    if piece:
                        parts.append(piece)
                        chunks += 1
                        self.emit(CallTokens(ticket.call_id, piece))
                    if isinstance(choice, dict):
                        _tool_pieces(choice, calls)
                        if isinstance(choice.get("finish_reason"), str):
                            finish_reason = choice["finish_reason"]
                usage = chunk.get("usage")
                if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                    usage_tokens = usage["completion_tokens"]
                if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
                    prompt_tokens = usage["prompt_tokens"]
                details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
                if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                    ticket.cached_tokens = details["cached_tokens"]  # when the server says
        return Generated(
            "".join(parts),
            usage_tokens if usage_tokens is not None else chunks,
            finish_reason,
            tuple(ToolCall(*calls[i]) for i in sorted(calls)),
            prompt_tokens,
            first_token_s,
        )


def _has_tool_pieces(choice: Any) -> bool:
    """Whether a streamed chat choice carries ``delta.tool_calls`` pieces."""
    delta = choice.get("delta") if isinstance(choice, dict) else None
    pieces = delta.get("tool_calls") if isinstance(delta, dict) else None
    return isinstance(pieces, list) and bool(pieces)


def _tool_pieces(choice: dict[str, Any], calls: dict[int, list[str]]) -> None:
    """Add a streamed chat choice's ``delta.tool_calls`` pieces to `calls` (index -> id,
    name, arguments so far): the id and name come once, the arguments in pieces."""
    delta = choice.get("delta")
    pieces = delta.get("tool_calls") if isinstance(delta, dict) else None
    for n, piece in enumerate(pieces if isinstance(pieces, list) else ()):
        if not isinstance(piece, dict):
            continue
        index = piece.get("index", n)
        call = calls.setdefault(index if isinstance(index, int) else n, ["", "", ""])
        if isinstance(piece.get("id"), str) and piece["id"]:
            call[0] = piece["id"]
        function = piece.get("function")
        if isinstance(function, dict):
            if isinstance(function.get("name"), str) and function["name"]:
                call[1] = function["name"]
            if isinstance(function.get("arguments"), str):
                call[2] += function["arguments"]


def _piece(choice: Any, *, chat: bool) -> str:
    """The text of one streamed choice: ``delta.content`` of a chat chunk, ``text`` of a
    completion chunk."""
    if not isinstance(choice, dict):
        return ""
    if chat:
        delta = choice.get("delta")
        piece = delta.get("content") if isinstance(delta, dict) else None
    else:
        piece = choice.get("text")
    return piece if isinstance(piece, str) else ""
