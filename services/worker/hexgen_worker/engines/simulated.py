"""The simulated engine: the simulator's engine model, run in real time. No model runs.

`SimulatedEngine` wraps one of the core's engine models (`hexgen_flow.sim.engines`, the very
models the trace-driven simulator uses; ``--engine-model`` picks it: ``prefill-first`` by
default, or ``vllm-v1``) for this worker's (model, GPU type, KV-cache size, max batch). A
background task sleeps on the cluster clock until the model's next event (a step or a
prefill backlog ending, a call finishing), wakes early whenever a call is admitted, moves
the model there and reports the calls that finished. Finish times are the model's own event
times, so a call takes the modelled latency to the float, and a mesh at time scale k replays
a trace k times faster than real time with the simulator's timings.

It is a simulation and says so: its engine kind is ENGINE_KIND_SIMULATED, its log lines
name it, and the text of every call is a placeholder such as
``[simulated A100] 678 tokens``, except for the Text-to-SQL agent's prompts, which get the
synthetic responder's heuristic text (`hexgen_worker.engines.responder`: no model either),
cut to the call's output tokens, and reported with its own token count (characters / 4,
at most the call's output tokens), and calls with tools or a JSON response_format, which get
a labelled synthetic tool call or JSON that validates against the schema
(`hexgen_worker.engines.structured`). The timing stays the model's, for the declared
tokens. The finish reason is what happened: ``length`` for the placeholder (it is the
declared tokens, as ``ignore_eos`` generates them) or an answer cut to them, ``stop`` for
an answer that fit, ``tool_calls`` for a tool call. Sampling options (temperature, seed,
stop, ...) change nothing in a simulation and are accepted.

A cancelled call is aborted in the model (its KV and batch slot are freed at once); nothing
is reported for it, and a `CapacityReleased` event tells the worker to admit again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from hexgen_flow.cluster import InstanceSpec
from hexgen_flow.runtime import CallTicket
from hexgen_flow.sim.engines import (
    DEFAULT_ENGINE_MODEL,
    EngineModel,
    create_engine_model,
    prefix_caching_of,
)
from hexgen_service.clock import ClusterClock
from hexgen_worker.engines.base import CallRequest, Engine, EngineLoad, translate_time
from hexgen_worker.engines.responder import respond
from hexgen_worker.engines.structured import structured_answer
from hexgen_worker.events import CallFinished, CallStarted, CapacityReleased, ToolCall

__all__ = ["SimulatedEngine", "simulated_text"]

log = logging.getLogger(__name__)

_INF = float("inf")
_CHARS_PER_TOKEN = 4
"""Characters per token of the synthetic text (the gateway's estimate too)."""
_SAME_TIME_EVENTS = 64
"""Events at one model time `_advance_to` handles before handing over (a model that keeps
answering the same time without progress would otherwise spin)."""


def simulated_text(gpu: str, output_tokens: int) -> str:
    """The placeholder output of a simulated call."""
    return f"[simulated {gpu}] {output_tokens} tokens"


_Answer = tuple[str, tuple[ToolCall, ...], tuple[str, ...]]
"""A synthetic answer: text, tool calls, the call's stop sequences."""


def _synthetic_answer(request: CallRequest) -> _Answer | None:
    """The synthetic answer to a call with tools or a JSON response_format
    (`hexgen_worker.engines.structured`), or the responder's text for an agent prompt;
    None otherwise, or when the responder fails (a responder bug must not fail the call:
    the placeholder is reported instead)."""
    try:
        structured = structured_answer(request.options, request.messages, request.prompt)
        if structured is not None:
            return (*structured, request.options.stop)
        text = respond(request.prompt) if request.prompt is not None else None
    except Exception:
        log.exception("simulated engine: the synthetic responder failed")
        return None
    return (text, (), request.options.stop) if text is not None else None


class SimulatedEngine(Engine):
    """An engine model in real time on the cluster clock (a simulation)."""

    kind = "simulated"

    def __init__(
        self,
        spec: InstanceSpec,
        engine_model: str = DEFAULT_ENGINE_MODEL,
        *,
        prefix_caching: bool | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        """The instance modelled: GPU type, model, KV-cache tokens, max batch."""
        self.engine_model = engine_model
        """The engine model's name (`hexgen_flow.sim.engines.ENGINE_MODELS`)."""
        self.prefix_caching = prefix_caching_of(engine_model, prefix_caching)
        """Whether the engine model caches prefixes (None given: the engine model's default)."""
        self._model: EngineModel = self._new_model()
        self._offset = 0.0
        """Model time minus cluster time (non-zero only after the cluster clock changed)."""
        self._last = -_INF
        """Latest model time used: the model never moves backwards."""
        self._running: dict[str, CallTicket] = {}
        self._started_s: dict[str, float] = {}
        self._answers: dict[str, _Answer] = {}
        """Synthetic answers (text, tool calls) of running calls that have one (agent
        prompts, tools, JSON schemas)."""
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        log.info(
            "simulated engine (a simulation, no model runs): %s on %s, %d KV-cache tokens, "
            "max batch %d, engine model %s%s",
            self.spec.model,
            self.spec.gpu,
            self.spec.kv_cache_tokens,
            self.spec.max_batch,
            self.engine_model,
            " with prefix caching" if self.prefix_caching else "",
        )
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="simulated-engine")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._running:
            log.info("simulated engine: abandoning %d running calls", len(self._running))

    # ------------------------------------------------------------------ admission

    def fits(self, ticket: CallTicket) -> bool:
        return self._model.fits(ticket)

    def admit(self, ticket: CallTicket, now: float) -> None:
        if self._model.running == 0 and self._offset != 0.0:
            # idle after a clock change: start a fresh model on the new clock
            self._model = self._new_model()
            self._offset = 0.0
            self._last = -_INF
        answer = _synthetic_answer(self.take_request(ticket))
        if answer is not None:
            self._answers[ticket.call_id] = answer
        # Events before now only: a step that would start now is planned by the run loop,
        # after every call of this instant was admitted (as the simulator does).
        model_now = self._advance_to(now + self._offset, before=True)
        self._model.admit(ticket, model_now)
        call_id = ticket.call_id
        self._running[call_id] = ticket
        self._started_s[call_id] = now
        self.emit(CallStarted(call_id, now))
        self._wake.set()

    def cancel(self, call_id: str) -> bool:
        ticket = self._running.pop(call_id, None)
        if ticket is None:
            return False
        self._started_s.pop(call_id, None)
        self._answers.pop(call_id, None)
        self._model.abort(ticket, self._advance_to(self._model_now()))
        self.emit(CapacityReleased(call_id))
        self._wake.set()
        return True

    def load(self) -> EngineLoad:
        return EngineLoad(self._model.running, self._model.kv_used)

    def next_event_s(self) -> float:
        """Cluster time of the model's next event (inf when idle)."""
        return self._model.next_event_s() - self._offset

    # ------------------------------------------------------------------ the model's clock

    def _new_model(self) -> EngineModel:
        return create_engine_model(self.engine_model, self.spec, prefix_caching=self.prefix_caching)

    def _clock_changed(self, old: ClusterClock, new: ClusterClock) -> None:
        unix = time.time()
        old_now = (unix - old.epoch_unix_s) * old.time_scale
        new_now = (unix - new.epoch_unix_s) * new.time_scale
        self._offset += old_now - new_now  # the model's time runs on without a jump
        self._started_s = {c: translate_time(t, old, new) for c, t in self._started_s.items()}
        log.warning("simulated engine: the cluster clock changed; model time carries on")
        self._wake.set()

    def _model_now(self) -> float:
        return self.clock.now() + self._offset

    def _advance_to(self, model_now: float, *, before: bool = False) -> float:
        """Process every model event up to `model_now` (`before`: only those before it), at
        its own time; return the time."""
        model_now = max(model_now, self._last)
        model = self._model
        previous = -_INF
        same = 0
        while True:
            t = model.peek_event_s()
            if t > model_now or (before and t >= model_now):
                break
            t = model.next_event_s()  # (a vllm-v1 model plans its next step here)
            if t > model_now:
                break
            same = same + 1 if t <= previous else 0
            if same >= _SAME_TIME_EVENTS:
                break  # no progress at t: the caller moves the model on
            previous = max(previous, t)
            for ticket in model.advance(max(t, self._last)):
                self._report(ticket, max(t, self._last))
            self._last = max(self._last, t)
        self._last = model_now
        return model_now

    def _report(self, ticket: CallTicket, model_time: float) -> None:
        call_id = ticket.call_id
        self._running.pop(call_id, None)
        started_s = self._started_s.pop(call_id, model_time - self._offset)
        tokens = ticket.output_tokens  # as asked (the queue may plan with a belief)
        answer = self._answers.pop(call_id, None)
        tool_calls: tuple[ToolCall, ...] = ()
        if answer is None:  # ignore_eos: exactly the declared tokens, then the limit
            text, reason = simulated_text(self.spec.gpu, tokens), "length"
        elif answer[1]:  # tool calls: their arguments are the output
            tool_calls, text, reason = answer[1], "", "tool_calls"
            size = sum(len(c.arguments) for c in tool_calls)
            tokens = min(tokens, max(1, -(-size // _CHARS_PER_TOKEN)))
        else:  # as a real engine stops at max_tokens: never more than the call's tokens
            text = answer[0][: tokens * _CHARS_PER_TOKEN]
            reason = "stop" if len(text) == len(answer[0]) else "length"
            cut = min((i for s in answer[2] if (i := text.find(s)) >= 0), default=-1)
            if cut >= 0:  # a stop sequence: generation ends before it
                text, reason = text[:cut], "stop"
            tokens = min(tokens, max(1, -(-len(text) // _CHARS_PER_TOKEN)))
        self.emit(
            CallFinished(
                call_id=call_id,
                output_tokens=tokens,
                text=text,
                started_s=started_s,
                finished_s=model_time - self._offset,
                cached_tokens=ticket.cached_tokens,
                finish_reason=reason,
                tool_calls=tool_calls,
                first_token_s=(
                    0.0  # the model does not say
                    if ticket.first_token_s is None
                    else ticket.first_token_s - self._offset
                ),
            )
        )

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            if self._clock is None:  # nothing is admitted before the welcome sets the clock
                await self._wake.wait()
                continue
            now = self._advance_to(self._model_now())
            t = self._model.next_event_s()
            if t == _INF:
                await self._wake.wait()
                continue
            delay = self.clock.wall_delay(t - now)
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
                continue
            # An event at or before `now` that the model did not resolve at its own time
            # (float rounding): let the model catch up with `now`.
            for ticket in self._model.advance(now):
                self._report(ticket, now)
            await asyncio.sleep(0)
