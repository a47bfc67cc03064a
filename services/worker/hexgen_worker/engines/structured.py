"""The simulated engine's answers to tool calls and JSON schemas: SYNTHETIC OUTPUT, NOT A
MODEL, so that an agent framework's whole path (the OpenAI SDK's ``tools`` and
``response_format``, LangChain's ``bind_tools`` and ``with_structured_output``) runs on
simulated engines, in CI, without a model.

- A call with tools (and ``tool_choice`` not ``"none"``) gets one tool call, unless its
  last message is a tool's answer and ``tool_choice`` is ``"auto"`` (then the model "has
  what it needed" and answers in text, so that an agent loop ends). The tool is the one
  ``tool_choice`` names, else the first whose name the last user message mentions, else the
  first. Its id is ``call_synthetic_<hex>``; its arguments are a JSON object that validates
  against the tool's ``parameters`` schema (`synthetic_value`).
- A call with a ``json_schema`` response_format gets a JSON text that validates against the
  schema; with ``json_object``, a JSON object.

The label: every string the synthetic output holds starts with ``synthetic`` (within the
schema's length limits) and tool-call ids with ``call_synthetic_``. Deterministic: the
choices are drawn from a generator seeded by the request's SHA-256.

`synthetic_value` covers the JSON Schema that tools and structured output use in practice
(what Pydantic and the OpenAI SDKs write): ``type`` (one or a list), ``enum``, ``const``,
``anyOf`` / ``oneOf`` (the first branch), ``allOf`` (merged), ``$ref`` to ``#/$defs/...`` or
``#/definitions/...``, ``properties`` (every one is filled, so ``required`` and strict
mode's ``additionalProperties: false`` hold), ``minItems`` / ``maxItems``, ``minLength`` /
``maxLength``, ``minimum`` / ``maximum`` (exclusive too), ``multipleOf`` for integers and
the ``format``s date, date-time, time, email, uri and uuid. A ``pattern`` is not generated
from (a string of the other constraints is given).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

from hexgen_worker.engines.base import CallOptions, ChatMessage
from hexgen_worker.events import ToolCall

__all__ = ["LABEL", "StructuredAnswer", "structured_answer", "synthetic_value"]

LABEL = "synthetic"
"""How every string of the synthetic output starts."""
_MAX_DEPTH = 16
"""Nesting past which a recursive schema ($ref to itself) gets the smallest value."""

StructuredAnswer = tuple[str, tuple[ToolCall, ...]]
"""(text, tool calls): text for a JSON answer, tool calls (and no text) for a tool call."""


def structured_answer(
    options: CallOptions, messages: Sequence[ChatMessage], prompt: str | None
) -> StructuredAnswer | None:
    """The synthetic answer to a call with tools or a JSON response_format; None when the
    call asks for neither (or, with tools, answers in text: see the module docstring)."""
    seed = hashlib.sha256(
        json.dumps(
            [prompt or "", [m.openai() for m in messages], options.openai()],
            sort_keys=True,
            default=str,
        ).encode()
    ).digest()
    rng = random.Random(int.from_bytes(seed[:8], "big"))
    if options.wants_tools():
        tool = _pick_tool(options, messages)
        if tool is not None:
            function = tool.get("function") or {}
            parameters = function.get("parameters")
            schema = parameters if isinstance(parameters, dict) else {"type": "object"}
            arguments = synthetic_value(schema, rng)
            if not isinstance(arguments, dict):  # a tool's arguments are an object
                arguments = {}
            call = ToolCall(
                f"call_{LABEL}_{seed[8:20].hex()}",
                str(function.get("name", "")),
                json.dumps(arguments, ensure_ascii=False),
            )
            return "", (call,)
    wanted = options.json_schema()
    if wanted is not None:
        return json.dumps(synthetic_value(wanted, rng), ensure_ascii=False), ()
    return None


def _pick_tool(options: CallOptions, messages: Sequence[ChatMessage]) -> dict[str, Any] | None:
    tools = [t for t in options.tools if isinstance(t.get("function"), dict)]
    if not tools:
        return None
    choice = options.tool_choice
    if isinstance(choice, dict):
        wanted = (choice.get("function") or {}).get("name")
        return next((t for t in tools if t["function"].get("name") == wanted), tools[0])
    if choice in (None, "auto") and messages and messages[-1].role == "tool":
        return None  # the tool answered: the model answers in text
    last_user = next((m.content for m in reversed(messages) if m.role == "user"), "")
    named = [t for t in tools if str(t["function"].get("name", "")) in last_user]
    return named[0] if named else tools[0]


def synthetic_value(schema: Mapping[str, Any], rng: random.Random) -> Any:
    """A value that validates against `schema` (see the module docstring)."""
    return _value(schema, rng, schema, 0, "value")


def _resolve(schema: Mapping[str, Any], root: Mapping[str, Any]) -> Mapping[str, Any]:
    seen = 0
    while isinstance(schema.get("$ref"), str) and seen < _MAX_DEPTH:
        ref: str = schema["$ref"]
        target: Any = root
        if not ref.startswith("#"):
            return {}
        for raw in ref.lstrip("#").strip("/").split("/") if ref != "#" else []:
            part = raw.replace("~1", "/").replace("~0", "~")
            target = target.get(part, {}) if isinstance(target, Mapping) else {}
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        schema = {**target, **rest} if isinstance(target, Mapping) else rest
        seen += 1
    return schema


def _value(schema: Any, rng: random.Random, root: Mapping[str, Any], depth: int, name: str) -> Any:
    if schema is True or not isinstance(schema, Mapping):
        return f"{LABEL} {name}"
    schema = _resolve(schema, root)
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return rng.choice(enum)
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            # Not null where another branch is possible (Optional[X] gets an X).
            usable = [
                b for b in branches if not (isinstance(b, Mapping) and b.get("type") == "null")
            ]
            return _value((usable or branches)[0], rng, root, depth + 1, name)
    parts = schema.get("allOf")
    if isinstance(parts, list) and parts:
        merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
        for given in parts:
            if isinstance(given, Mapping):
                part = _resolve(given, root)
                merged["properties"] = {
                    **merged.get("properties", {}),
                    **part.get("properties", {}),
                }
                for k, v in part.items():
                    if k != "properties":
                        merged.setdefault(k, v)
        return _value(merged, rng, root, depth + 1, name)
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"] or kind
        kind = kinds[0] if kinds else None
    if kind is None:
        kind = "object" if "properties" in schema else "array" if "items" in schema else "string"
    if kind == "object":
        return _object(schema, rng, root, depth)
    if kind == "array":
        items = schema.get("items", {})
        low = int(schema.get("minItems", 0))
        high = int(schema.get("maxItems", max(low, 2)))
        count = min(max(low, 1), high) if depth < _MAX_DEPTH else low
        return [_value(items, rng, root, depth + 1, name) for _ in range(count)]
    if kind == "integer":
        return _integer(schema, rng)
    if kind == "number":
        return _number(schema, rng)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    return _string(schema, name)


def _object(
    schema: Mapping[str, Any], rng: random.Random, root: Mapping[str, Any], depth: int
) -> dict[str, Any]:
    properties = schema.get("properties")
    out: dict[str, Any] = {}
    if not isinstance(properties, Mapping):
        return out
    required = set(schema.get("required") or ())
    for key, sub in properties.items():
        if depth >= _MAX_DEPTH and key not in required:
            continue
        out[str(key)] = _value(sub, rng, root, depth + 1, str(key))
    return out


def _integer(schema: Mapping[str, Any], rng: random.Random) -> int:
    low, high = _bounds(schema)
    lo = math.ceil(low) if math.isfinite(low) else None
    hi = math.floor(high) if math.isfinite(high) else None
    if lo is not None and schema.get("exclusiveMinimum") is not None and lo <= low:
        lo += 1
    if hi is not None and schema.get("exclusiveMaximum") is not None and hi >= high:
        hi -= 1
    start = lo if lo is not None else (hi - 10 if hi is not None else 1)
    stop = hi if hi is not None else start + 99
    value = rng.randint(start, max(start, stop))
    step = schema.get("multipleOf")
    if isinstance(step, int) and step > 0:
        value = -(-value // step) * step
        if hi is not None and value > hi:
            value -= step
    return value


def _number(schema: Mapping[str, Any], rng: random.Random) -> float:
    low, high = _bounds(schema)
    lo = low if math.isfinite(low) else (high - 10.0 if math.isfinite(high) else 0.0)
    hi = high if math.isfinite(high) else lo + 100.0
    value = round(rng.uniform(lo, hi), 3)
    if value <= lo or value >= hi:  # keep clear of exclusive bounds
        value = (lo + hi) / 2
    return value


def _bounds(schema: Mapping[str, Any]) -> tuple[float, float]:
    low, high = -math.inf, math.inf
    for key in ("minimum", "exclusiveMinimum"):
        if isinstance(schema.get(key), int | float) and not isinstance(schema.get(key), bool):
            low = max(low, float(schema[key]))
    for key in ("maximum", "exclusiveMaximum"):
        if isinstance(schema.get(key), int | float) and not isinstance(schema.get(key), bool):
            high = min(high, float(schema[key]))
    return low, high


_FORMATS = {
    "date": "2024-01-01",
    "date-time": "2024-01-01T00:00:00Z",
    "time": "00:00:00Z",
    "email": "synthetic@example.com",
    "uri": "https://example.com/synthetic",
    "uuid": "00000000-0000-4000-8000-000000000000",
}


def _string(schema: Mapping[str, Any], name: str) -> str:
    known = _FORMATS.get(str(schema.get("format", "")))
    if known is not None:
        return known
    text = f"{LABEL} {name}"
    low = int(schema.get("minLength", 0))
    high = schema.get("maxLength")
    if len(text) < low:
        text += "x" * (low - len(text))
    if isinstance(high, int) and len(text) > high:
        text = text[:high]
    return text
