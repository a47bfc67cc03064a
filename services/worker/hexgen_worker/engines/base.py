"""The engine interface a worker drives, and what the real engines share.

An engine executes admitted calls. It implements the core's `AdmissionEngine` protocol
(`fits`, `admit`), so the worker's `InstanceScheduler` admits calls from the local queue
into it exactly as the simulator does, plus `cancel`, `load` and an asynchronous stream
of `CallStarted` / `CallTokens` / `CallFinished` events (`next_event`).

Engines are driven from one asyncio event loop and are not thread-safe. `admit` never
blocks: an engine starts a background task or only updates its model, and reports the
outcome as events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from hexgen_flow.errors import ConfigError
from hexgen_flow.runtime import CallTicket
from hexgen_flow.workload import LLMCall
from hexgen_service.clock import ClusterClock
from hexgen_worker.events import CallFinished, CallStarted, EngineEvent, ToolCall

__all__ = [
    "NO_OPTIONS",
    "UNSUPPORTED_OPTION",
    "CallOptions",
    "CallRequest",
    "CapacityLedger",
    "ChatMessage",
    "Engine",
    "EngineLoad",
    "EngineUnavailableError",
    "Generated",
    "RequestEngine",
    "RunningRequest",
    "ToolCall",
    "UnsupportedOptionError",
    "fit_to_context",
    "synthetic_prompt",
    "translate_time",
]


log = logging.getLogger(__name__)


class EngineUnavailableError(ConfigError):
    """The engine cannot run here (a missing optional package, a bad model path)."""


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What an engine holds right now."""

    running: int
    """Admitted calls not yet finished."""
    kv_used_tokens: int
    """KV-cache tokens reserved by them (input + output tokens each)."""


class ChatMessage(NamedTuple):
    """One message of a chat request (the dispatch's ``messages``)."""

    role: str
    """Who speaks: "system", "developer", "user", "assistant" or "tool"."""
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    """An assistant message's tool calls."""
    tool_call_id: str = ""
    """A tool message's answer to this tool call."""
    name: str = ""

    def openai(self) -> dict[str, Any]:
        """The message in OpenAI's shape (what a chat template or a server takes)."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.openai() for call in self.tool_calls]
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        if self.name:
            message["name"] = self.name
        return message


class UnsupportedOptionError(ValueError):
    """An engine cannot honour a call's option: the call fails with
    ``unsupported option <field>: <why>`` (`UNSUPPORTED_OPTION`), which the gateway answers
    as a 400 naming the request's field."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{UNSUPPORTED_OPTION}{field}: {why}")
        self.field = field


UNSUPPORTED_OPTION = "unsupported option "
"""How a call's error starts when its engine cannot honour an option (then the field)."""


@dataclass(frozen=True, slots=True)
class CallOptions:
    """How to generate, as the client asked (`hexgen_api` ``CallOptions``, the JSON fields
    parsed); None / empty: the engine's default."""

    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    tools: tuple[dict[str, Any], ...] = ()
    """OpenAI's ``tools`` (``{"type": "function", "function": {...}}`` each)."""
    tool_choice: str | dict[str, Any] | None = None
    """``"auto"``, ``"none"``, ``"required"`` or ``{"type": "function", "function":
    {"name": ...}}``; None: not given."""
    response_format: dict[str, Any] | None = None
    """``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {...}}``;
    None: text."""
    parallel_tool_calls: bool | None = None

    def sampling(self) -> dict[str, Any]:
        """The sampling options given, by their OpenAI (and vLLM) names."""
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
        }
        out: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
        if self.stop:
            out["stop"] = list(self.stop)
        return out

    def openai(self) -> dict[str, Any]:
        """Every option given, by its OpenAI request field: what an OpenAI-compatible
        server is sent verbatim."""
        out = self.sampling()
        if self.tools:
            out["tools"] = list(self.tools)
        if self.tool_choice is not None:
            out["tool_choice"] = self.tool_choice
        if self.response_format is not None:
            out["response_format"] = self.response_format
        if self.parallel_tool_calls is not None:
            out["parallel_tool_calls"] = self.parallel_tool_calls
        return out

    def may_stop_early(self) -> bool:
        """Whether the call must be let stop before its max tokens (``ignore_eos`` would
        break it): it has stop sequences, tools, or a JSON response_format."""
        return bool(self.stop) or self.wants_tools() or self.json_schema() is not None

    def wants_tools(self) -> bool:
        """Whether the model may call a tool (tools given, and tool_choice not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    def json_schema(self) -> dict[str, Any] | None:
        """The JSON Schema a ``json_schema`` response_format asks for (``{}``: any JSON
        object, for ``json_object``); None for text."""
        rf = self.response_format
        if rf is None or rf.get("type") in (None, "text"):
            return None
        if rf.get("type") == "json_object":
            return {"type": "object"}
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        return schema if isinstance(schema, dict) else {"type": "object"}


NO_OPTIONS = CallOptions()


@dataclass(frozen=True, slots=True)
class Generated:
    """What an engine made of a call."""

    text: str
    tokens: int
    """Tokens generated."""
    finish_reason: str = ""
    """"stop", "length" or "tool_calls"; empty: the engine does not say."""
    tool_calls: tuple[ToolCall, ...] = ()
    prompt_tokens: int = 0
    """The prompt's tokens as the engine counted them (0: it does not say)."""
    first_token_s: float | None = None
    """When the first generated text or token arrived (the engine's cluster clock); None:
    the engine does not say, or nothing was generated."""


@dataclass(frozen=True, slots=True)
class CallRequest:
    """What a call was dispatched with besides its ticket: the text to generate from."""

    prompt: str | None = None
    """The prompt (a chat request's plain rendering); None when it came without one."""
    messages: tuple[ChatMessage, ...] = ()
    """A chat request's messages; empty for a plain prompt. An engine that has the model's
    chat template applies it to these; one that has none generates from `prompt`."""
    options: CallOptions = NO_OPTIONS
    """How to generate: the engine honours each option or fails the call naming it
    (`UnsupportedOptionError`)."""


class Engine(ABC):
    """One serving engine behind a worker's local queue."""

    kind: ClassVar[str]
    """Name on the command line (``--engine``)."""

    def __init__(self) -> None:
        self._events: asyncio.Queue[EngineEvent] = asyncio.Queue()
        self._clock: ClusterClock | None = None
        self.prompts: dict[str, str] = {}
        """Prompts of queued calls that came with one, by call id: the worker fills it at
        dispatch, `take_request` empties it at admission, the worker drops cancelled ones."""
        self.messages: dict[str, tuple[ChatMessage, ...]] = {}
        """Chat messages of queued calls that came with some, by call id (beside their
        rendering in `prompts`); filled and emptied as `prompts` is."""
        self.options: dict[str, CallOptions] = {}
        """Options of queued calls that came with some, by call id; filled and emptied as
        `prompts` is."""

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Load the model or open connections; called once, before the first `admit`."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Abandon the running calls (without reporting them) and release resources."""

    @property
    def clock(self) -> ClusterClock:
        """The cluster clock every reported time is read from (set by the worker)."""
        if self._clock is None:
            raise RuntimeError("the engine has no cluster clock yet (set_clock before admit)")
        return self._clock

    def set_clock(self, clock: ClusterClock) -> None:
        """Adopt the cluster clock of the coordinator's welcome."""
        old, self._clock = self._clock, clock
        if old is not None and old != clock:
            self._clock_changed(old, clock)

    def _clock_changed(self, old: ClusterClock, new: ClusterClock) -> None:  # noqa: B027
        """Hook for engines that keep times of their own across a clock change."""

    # ------------------------------------------------------------------ admission

    @abstractmethod
    def fits(self, ticket: CallTicket) -> bool:
        """Whether the engine can start `ticket` now."""

    @abstractmethod
    def admit(self, ticket: CallTicket, now: float) -> None:
        """Start `ticket` at cluster time `now` (the caller checked `fits`)."""

    @abstractmethod
    def cancel(self, call_id: str) -> bool:
        """Abort a running call; nothing more is reported for it. False if not running."""

    @abstractmethod
    def load(self) -> EngineLoad:
        """Running calls and reserved KV-cache tokens."""

    def take_request(self, ticket: CallTicket) -> CallRequest:
        """The prompt, chat messages and options dispatched with `ticket` (forgotten
        here)."""
        call_id = ticket.call_id
        return CallRequest(
            self.prompts.pop(call_id, None),
            self.messages.pop(call_id, ()),
            self.options.pop(call_id, NO_OPTIONS),
        )

    def take_prompt(self, ticket: CallTicket) -> str | None:
        """The prompt dispatched with `ticket`, or None when it came without one (its chat
        messages, if any, are forgotten too)."""
        return self.take_request(ticket).prompt

    # ------------------------------------------------------------------ events

    def emit(self, event: EngineEvent) -> None:
        """Report an event (engines call this; the worker consumes `next_event`)."""
        self._events.put_nowait(event)

    async def next_event(self) -> EngineEvent:
        """The next event, in the order the engine emitted them."""
        return await self._events.get()

    def pending_events(self) -> int:
        """Events emitted and not yet consumed."""
        return self._events.qsize()


class CapacityLedger:
    """Admission bookkeeping for an engine that runs its own scheduler (vLLM, a server).

    A call is admitted while fewer than `max_concurrency` run and its input + output
    tokens fit in what is left of `kv_cache_tokens` (the capacity the worker declared to
    the coordinator; 0 disables the KV check). The real engine may still queue it
    internally; this ledger only keeps the worker's queue in charge of the order.
    """

    __slots__ = ("kv_cache_tokens", "kv_used", "max_concurrency", "running")

    def __init__(self, max_concurrency: int, kv_cache_tokens: int) -> None:
        if max_concurrency < 1:
            raise ConfigError(f"max concurrency must be >= 1, got {max_concurrency}")
        self.max_concurrency = max_concurrency
        self.kv_cache_tokens = kv_cache_tokens
        self.running = 0
        self.kv_used = 0

    def fits(self, call: LLMCall) -> bool:
        if self.running >= self.max_concurrency:
            return False
        if self.kv_cache_tokens <= 0:
            return True
        return self.kv_used + call.input_tokens + call.output_tokens <= self.kv_cache_tokens

    def reserve(self, call: LLMCall) -> None:
        self.running += 1
        self.kv_used += call.input_tokens + call.output_tokens

    def release(self, call: LLMCall) -> None:
        self.running -= 1
        self.kv_used -= call.input_tokens + call.output_tokens

    def load(self) -> EngineLoad:
        return EngineLoad(self.running, self.kv_used)


# Common English words that Llama-3, GPT-2 and SmolLM2 byte-pair vocabularies each encode,
# with their leading space, as one token.
_FILLER_WORDS = (
    "the", "data", "table", "query", "column", "value", "and", "of", "to", "in",
    "for", "with", "from", "where", "select", "name", "each", "row", "is", "a",
    "by", "on", "as", "or", "all", "one", "new", "list", "order", "year",
)  # fmt: skip


@dataclass(slots=True)
class RunningRequest:
    """A call a `RequestEngine` is serving."""

    ticket: CallTicket
    started_s: float
    task: asyncio.Task[None] | None = None


class RequestEngine(Engine):
    """An engine that serves every admitted call as a request of its own to a real model
    server (vLLM in process, or over HTTP), one asyncio task per call.

    Capacity is a `CapacityLedger`; the order of admission, which follows the local queue,
    is passed on as each request's priority (lower is sooner). Subclasses implement
    `generate`; a cancelled call is aborted and reported by nobody.
    """

    def __init__(self, max_concurrency: int, kv_cache_tokens: int) -> None:
        super().__init__()
        self._ledger = CapacityLedger(max_concurrency, kv_cache_tokens)
        self._running: dict[str, RunningRequest] = {}
        self._admissions = 0

    @abstractmethod
    async def generate(self, ticket: CallTicket, request: CallRequest, priority: int) -> Generated:
        """Run the call (emitting `CallTokens` as text arrives): its text, output tokens,
        finish reason and tool calls."""

    def fits(self, ticket: CallTicket) -> bool:
        return self._ledger.fits(ticket.asked())

    def admit(self, ticket: CallTicket, now: float) -> None:
        self._ledger.reserve(ticket.asked())
        priority = self._admissions  # the local queue's order: lower is sooner
        self._admissions += 1
        running = RunningRequest(ticket, now)
        self._running[ticket.call_id] = running
        request = self.take_request(ticket)
        running.task = asyncio.create_task(
            self._serve(running, request, priority), name=f"{self.kind}-{ticket.call_id}"
        )
        self.emit(CallStarted(ticket.call_id, now))

    def cancel(self, call_id: str) -> bool:
        running = self._running.pop(call_id, None)
        if running is None:
            return False
        self._ledger.release(running.ticket.asked())  # free now: the queue may admit at once
        if running.task is not None:
            running.task.cancel()  # the server aborts a request whose stream is closed
        return True

    def load(self) -> EngineLoad:
        return self._ledger.load()

    async def cancel_all(self) -> None:
        """Abandon every call in flight (engine shutdown)."""
        running = list(self._running.values())
        self._running.clear()
        for call in running:
            if call.task is not None:
                call.task.cancel()
        for call in running:
            if call.task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await call.task

    async def _serve(self, running: RunningRequest, request: CallRequest, priority: int) -> None:
        ticket = running.ticket
        result, error = Generated("", 0), ""
        try:
            result = await self.generate(ticket, request, priority)
        except asyncio.CancelledError:
            raise  # cancel() or close(): nothing is reported
        except Exception as exc:
            error = f"{self.kind} engine: {type(exc).__name__}: {exc}"
            log.warning("call %s failed: %s", ticket.call_id, error)
        if self._running.pop(ticket.call_id, None) is None:
            return  # cancelled while the last chunk arrived
        self._ledger.release(ticket.asked())
        self.emit(
            CallFinished(
                call_id=ticket.call_id,
                output_tokens=result.tokens,
                text=result.text,
                started_s=running.started_s,
                finished_s=self.clock.now(),
                error=error,
                cached_tokens=ticket.cached_tokens,
                finish_reason=result.finish_reason,
                tool_calls=result.tool_calls,
                prompt_tokens=result.prompt_tokens,
                first_token_s=result.first_token_s or 0.0,  # 0: not given
            )
        )


def synthetic_prompt(input_tokens: int) -> str:
    """A stand-in prompt of roughly `input_tokens` tokens, for calls dispatched without one.

    It is `input_tokens` words cycling through a fixed list of common English words that
    byte-pair tokenizers (Llama 3, GPT-2, SmolLM2) encode as one token each with their
    leading space, so the tokenised length is `input_tokens` plus the tokenizer's special
    tokens. Deterministic: the same length always gives the same text.
    """
    n = max(int(input_tokens), 1)
    words = len(_FILLER_WORDS)
    return " ".join(_FILLER_WORDS[i % words] for i in range(n))


def fit_to_context(
    input_tokens: int, output_tokens: int, limit: int, reserve: int = 0
) -> tuple[int, int]:
    """Shrink (input, output) tokens so that they fit a context of `limit` tokens, of which
    `reserve` are kept for what the server adds (special tokens, a chat template).

    `limit <= 0` means no limit. Output tokens are kept first (decode dominates a call's
    time); the prompt takes what is left, at least one token.
    """
    if limit <= 0:
        return input_tokens, output_tokens
    limit = max(limit - reserve, 2)
    if input_tokens + output_tokens <= limit:
        return input_tokens, output_tokens
    output = max(min(output_tokens, limit - 1), 1)
    return max(limit - output, 1), output


def translate_time(t: float, old: ClusterClock, new: ClusterClock) -> float:
    """The reading of clock `new` at the instant when clock `old` read `t`."""
    return (old.wall_time(t) - new.epoch_unix_s) * new.time_scale
