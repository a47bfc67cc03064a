"""OpenTelemetry's GenAI semantic conventions, as the gateway, the coordinator and the
workers spell them on their spans of a call (https://opentelemetry.io/docs/specs/semconv/gen-ai/).

One call of a workflow makes three spans with GenAI attributes, each named for what it is:

- the gateway's request (kind SERVER, named by the HTTP route, ``POST /v1/chat/completions``):
  what the client asked and what it got;
- the coordinator's call (kind CLIENT, ``{gen_ai.operation.name} {gen_ai.request.model}``,
  e.g. ``chat llama-3.1-70b``): the inference span, a call to a model on an instance of
  the mesh (a redispatch starts a new one);
- the worker's execution of it on its engine (``{engine} {operation} {model}``, e.g.
  ``vllm chat SmolLM2-135M``; kind CLIENT for an engine that calls a model server, INTERNAL
  for a model in the worker's own process): queue wait and generation.

Their attributes: ``gen_ai.operation.name`` (``chat`` for a request with messages, else
``text_completion``), ``gen_ai.provider.name`` (``hexgen_flow`` for the mesh as the gateway
and coordinator see it; the engine's kind, ``vllm``, ``openai`` or ``simulated``, on a
worker), ``gen_ai.request.model``, ``gen_ai.request.max_tokens`` and the sampling options
given (``temperature``, ``top_p``, ``seed``, ``stop_sequences``, ``presence_penalty``,
``frequency_penalty``), ``gen_ai.output.type`` (``json`` for a JSON response format),
``gen_ai.conversation.id`` (the workflow's id); once the call finished,
``gen_ai.response.model``, ``gen_ai.response.finish_reasons`` and the usage the engine
reported (``gen_ai.usage.input_tokens``, ``gen_ai.usage.output_tokens``; the declared
sizes stand in where the engine does not count).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from hexgen_api.v1 import workflow_pb2

__all__ = [
    "CHAT",
    "PROVIDER",
    "TEXT_COMPLETION",
    "operation_of",
    "proto_sampling",
    "request_attributes",
    "response_attributes",
    "span_name",
]

PROVIDER: Final = "hexgen_flow"
"""``gen_ai.provider.name`` of the mesh (the gateway's and the coordinator's spans)."""
CHAT: Final = "chat"
TEXT_COMPLETION: Final = "text_completion"

_SAMPLING: Final = {
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "seed": "gen_ai.request.seed",
    "presence_penalty": "gen_ai.request.presence_penalty",
    "frequency_penalty": "gen_ai.request.frequency_penalty",
    "stop": "gen_ai.request.stop_sequences",
}
"""OpenAI's (and vLLM's) name of a sampling option -> its GenAI attribute."""

Attributes = dict[str, str | bool | int | float | list[str]]


def operation_of(chat: bool) -> str:
    """``gen_ai.operation.name`` of a call: ``chat`` when it has messages."""
    return CHAT if chat else TEXT_COMPLETION


def span_name(operation: str, model: str) -> str:
    """``{gen_ai.operation.name} {gen_ai.request.model}`` (the operation alone without a
    model)."""
    return f"{operation} {model}" if model else operation


def proto_sampling(options: workflow_pb2.CallOptions | None) -> tuple[dict[str, Any], bool]:
    """The sampling options `options` gives, by their OpenAI names, and whether it asks for
    JSON output (a ``json_object`` or ``json_schema`` response format)."""
    if options is None:
        return {}, False
    given: dict[str, Any] = {
        name: getattr(options, name)
        for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty")
        if options.HasField(name)
    }
    if options.stop:
        given["stop"] = list(options.stop)
    json_output = False
    if options.response_format_json:
        try:
            kind = json.loads(options.response_format_json).get("type")
        except (ValueError, AttributeError):
            kind = None
        json_output = kind in ("json_object", "json_schema")
    return given, json_output


def request_attributes(
    *,
    operation: str,
    provider: str,
    model: str,
    max_tokens: int,
    sampling: Mapping[str, Any] | None = None,
    json_output: bool = False,
    conversation_id: str = "",
) -> Attributes:
    """The request's GenAI attributes (given at the span's start, as the conventions ask)."""
    out: Attributes = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": provider,
        "gen_ai.output.type": "json" if json_output else "text",
    }
    if model:
        out["gen_ai.request.model"] = model
    if max_tokens > 0:
        out["gen_ai.request.max_tokens"] = max_tokens
    for name, value in (sampling or {}).items():
        attribute = _SAMPLING.get(name)
        if attribute is not None and value is not None:
            out[attribute] = [str(v) for v in value] if name == "stop" else value
    if conversation_id:
        out["gen_ai.conversation.id"] = conversation_id
    return out


def response_attributes(
    *, model: str, finish_reason: str, input_tokens: int, output_tokens: int
) -> Attributes:
    """The response's GenAI attributes: the model that answered, why it stopped, the tokens
    read and generated (counts of 0, unknown, are left out)."""
    out: Attributes = {}
    if model:
        out["gen_ai.response.model"] = model
    if finish_reason:
        out["gen_ai.response.finish_reasons"] = [finish_reason]
    if input_tokens > 0:
        out["gen_ai.usage.input_tokens"] = input_tokens
    if output_tokens >= 0:
        out["gen_ai.usage.output_tokens"] = output_tokens
    return out
