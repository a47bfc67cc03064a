"""What a worker reports about its calls, as plain values.

Engines emit these; the worker's state keeps the `CallFinished` ones in its outbox until
the coordinator acknowledges them; `hexgen_worker.convert` turns them into protobuf
messages at the edge. All times are seconds on the cluster clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = [
    "CallFinished",
    "CallReport",
    "CallStarted",
    "CallTokens",
    "CapacityReleased",
    "EngineEvent",
    "Heartbeat",
    "ToolCall",
]


@dataclass(frozen=True, slots=True)
class CallStarted:
    """The engine started executing a call."""

    call_id: str
    started_s: float
    """When the engine started it (cluster clock)."""


@dataclass(frozen=True, slots=True)
class CallTokens:
    """A chunk of generated text, in generation order."""

    call_id: str
    text: str


class ToolCall(NamedTuple):
    """One function call a model asked for (OpenAI's ``tool_calls[i]``)."""

    id: str
    name: str
    arguments: str
    """The arguments: a JSON object as text, as the model wrote it."""

    def openai(self) -> dict[str, Any]:
        """The call in OpenAI's shape."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True, slots=True)
class CallFinished:
    """A call ended, with its output or an error."""

    call_id: str
    output_tokens: int
    """Tokens generated (the declared count for the simulated engine)."""
    text: str
    """The generated text (a labelled placeholder for the simulated engine)."""
    started_s: float
    """When the engine started it (cluster clock)."""
    finished_s: float
    """When it ended (cluster clock)."""
    error: str = ""
    """Non-empty when the engine failed the call; the coordinator retries it elsewhere."""
    attempt: int = 0
    """The dispatch attempt this result answers (the worker's state sets it)."""
    cached_tokens: int = 0
    """Prompt tokens the engine found in its prefix cache (0: none, or it does not say)."""
    finish_reason: str = ""
    """Why generation ended: "stop", "length" or "tool_calls" (empty: not said)."""
    tool_calls: tuple[ToolCall, ...] = ()
    """The tools the model called."""
    prompt_tokens: int = 0
    """The prompt's tokens as the engine counted them (0: it does not say)."""
    first_token_s: float = 0.0
    """When the engine produced the first output token (cluster clock); 0: not given (an
    engine that does not say, or a call that failed before it)."""


@dataclass(frozen=True, slots=True)
class CapacityReleased:
    """A cancelled call gave its resources back after `Engine.cancel` returned (the
    simulated engine's model holds them until the call's modelled end): admit again.
    Never sent to the coordinator."""

    call_id: str


CallReport = CallStarted | CallTokens | CallFinished
"""What the worker reports to the coordinator about a call."""

EngineEvent = CallReport | CapacityReleased
"""What an engine reports about a call it admitted."""


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """The worker's load, sent every heartbeat interval."""

    running: int
    """Calls the engine is executing."""
    queued: int
    """Calls waiting in the local queue."""
    kv_used_tokens: int
    """KV-cache tokens reserved by the running calls."""
    others_in_flight: int = 0
    """Calls held here (queued or running) that the OTHER coordinators dispatched: what a
    worker shared by coordinator shards tells each of them (0 with one coordinator)."""
    others_outstanding_s: float = 0.0
    """Their estimated single-request seconds on this instance (cluster seconds)."""
    others_tokens: int = 0
    """Their input + output tokens."""
    others_weight: float = 0.0
    """Their tail weights (as their coordinators charged them), summed."""
    others_weighted_outstanding_s: float = 0.0
    """Their weight x estimated seconds, summed."""
