"""The worker protocol as the coordinator speaks it: what a worker reports, and what the
coordinator tells it, as small frozen values.

A worker's `Connect` stream carries protobuf (the worker API's messages); only the gRPC
servicer (`hexgen_coordinator.service`) and its translator (`hexgen_coordinator.worker_wire`)
see it. Everything else in the coordinator (`workers`, `completions`, `dispatch`, `events`,
`links`) works on these types, so that the parts that own the coordinator's state are
written, read and tested without the wire, and a change of the wire touches one module.

The types keep the wire's meanings, proto3's included: a worker cannot leave a scalar out,
so 0, "" and an empty list stand for "not given" wherever the field's docstring says so, and
the coordinator's code reads them that way (``msg.output_tokens or ticket.output_tokens``).
Turning those into None here would change what the coordinator does with a report from an
older worker, so they stay as the wire has them. `worker_wire`'s round trip is exact.

Messages in (worker -> coordinator): `Hello`, `Heartbeat`, `Started`, `Tokens`, `Finished`.
Commands out (coordinator -> worker), what `WorkerLink.outbox` carries: `Welcome`, `Run`,
`CancelRun`, `NewDeadline`, `Ack`.

A session's chat call keeps what it was given beside its prompt, its `Chat`, from the
RunCall that gave it until the call completes (`ActiveQuery.chats`); every `Run` of the call
carries it.

No protobuf here and no grpc. The one exception is typing only: a chat call's messages and
its generation options (`Chat`, `Run.messages`, `Run.options`) are the client API's own
messages (``workflow_pb2``), which the coordinator passes from the client's request to the
worker untouched; restating them here would copy every message of every chat call per
dispatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hexgen_flow.runtime import CallTicket

if TYPE_CHECKING:
    from hexgen_api.v1 import workflow_pb2

__all__ = [
    "Ack",
    "CancelRun",
    "Chat",
    "Command",
    "Finished",
    "Heartbeat",
    "Hello",
    "Message",
    "NewDeadline",
    "Run",
    "Started",
    "Tokens",
    "ToolCall",
    "Welcome",
]


# ------------------------------------------------------------------ worker -> coordinator


@dataclass(frozen=True, slots=True)
class Hello:
    """A worker's first message on every connection: who it is, which slot it wants, and
    what it still holds from before a reconnect.

    The servicer checks the wire's hello before it becomes one of these (an engine kind the
    enum does not name, a slot below -1: INVALID_ARGUMENT); `links.slot_for` checks the slot
    against the cluster."""

    worker_id: str
    """Stable across restarts of the same worker; never empty (the servicer refuses that)."""
    slot: int
    """The slot of the cluster to take; -1: the first free one of its GPU type."""
    gpu: str
    model: str
    """"": the worker does not say (any model of the slot)."""
    engine: str
    """The engine kind's name on the wire, e.g. ``"ENGINE_KIND_SIMULATED"`` (what the
    coordinator logs and shows; it schedules the same whatever the engine)."""
    kv_cache_tokens: int = 0
    max_batch: int = 0
    resident_call_ids: tuple[str, ...] = ()
    """Calls the worker still holds (queued or running) from before a reconnect."""
    unacked_call_ids: tuple[str, ...] = ()
    """Finished calls not yet acknowledged; their `Finished` reports follow the hello."""


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """The worker's load, now and then; its arrival alone keeps the link alive.

    The ``others_*`` fields are what OTHER coordinator shards have on a worker they share
    (docs/design.md): 0 for a worker linked to one coordinator, or one older than the
    fields, which the core reads as "nothing else there" (weights: "count those calls at
    this coordinator's mean weight")."""

    running: int = 0
    queued: int = 0
    kv_used_tokens: int = 0
    others_in_flight: int = 0
    others_outstanding_s: float = 0.0
    others_tokens: int = 0
    others_weight: float = 0.0
    others_weighted_outstanding_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Started:
    """The engine began the call (it no longer moves on a new deadline)."""

    call_id: str


@dataclass(frozen=True, slots=True)
class Tokens:
    """A chunk of a call's output, for the query's watchers (live only, never logged)."""

    call_id: str
    text: str


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call a model asked for (`Finished.tool_calls`); the client API's
    ``ToolCall`` field for field."""

    id: str
    name: str
    arguments: str
    """A JSON object as text, as the model wrote it: it may not parse."""


@dataclass(frozen=True, slots=True)
class Finished:
    """A call's result, or its failure: what every completion starts from.

    The coordinator reads the zeros as the wire defines them, which is why they stay
    zeros here rather than None: a worker cannot omit a proto3 scalar, and an older one
    does not fill the newer fields."""

    call_id: str
    output_tokens: int = 0
    """Tokens generated; 0: the engine does not say, and the coordinator records the
    declared count (``msg.output_tokens or ticket.output_tokens``); only a count > 0
    replaces the ticket's (what learned output lengths learn from)."""
    text: str = ""
    started_s: float = 0.0
    """When the engine began, on the cluster clock; 0: not given. The engine's own service
    time is ``finished_s - started_s`` only when ``finished_s > started_s > 0``."""
    finished_s: float = 0.0
    """When it ended, on the cluster clock; 0: not given, the coordinator's now instead
    (``msg.finished_s or now``)."""
    error: str = ""
    """Non-empty: the engine failed the call (retried elsewhere up to the attempt limit)."""
    attempt: int = 0
    """The dispatch's `Run.attempt` this answers; 0: a worker that does not echo it. It is
    compared, and given to Redis, only while the ticket counts attempts
    (``msg.attempt if ticket.attempt else 0``); a result of an older attempt is dropped."""
    cached_tokens: int = 0
    """Prompt tokens found in the engine's prefix cache; 0: none, or not said."""
    finish_reason: str = ""
    """"stop", "length" or "tool_calls"; "": the engine does not say."""
    tool_calls: tuple[ToolCall, ...] = ()
    prompt_tokens: int = 0
    """The prompt as the engine counted it; 0: not said (the declared size stays)."""
    first_token_s: float = 0.0
    """When the engine produced the first output token, on the cluster clock; 0: not given.
    The engine's time to first token is ``first_token_s - started_s`` only when
    ``finished_s >= first_token_s >= started_s > 0``."""


Message = Hello | Heartbeat | Started | Tokens | Finished
"""What a worker sends."""


# ------------------------------------------------------------------ coordinator -> worker


@dataclass(frozen=True, slots=True)
class Chat:
    """What a session's call was given beside its prompt and sizes: its chat messages and
    its options (sampling, tools, response_format), kept from its RunCall (or from Redis,
    after a restart) until it completes, and sent with each of its `Run`s.

    `hexgen_coordinator.client_wire.chat_part` makes one from the call's ``LLMCall``;
    a call that has neither has none (None, not an empty `Chat`)."""

    messages: tuple[workflow_pb2.ChatMessage, ...] = ()
    """The chat's messages as the client gave them; empty: a plain prompt with options."""
    options: workflow_pb2.CallOptions | None = None
    """How to generate, as the client asked; None: absent on the wire (the engine's
    defaults), which is not the same as an empty options message, kept as given."""


@dataclass(frozen=True, slots=True)
class Welcome:
    """The answer to a hello: the slot the worker holds, the cluster's clock and what its
    local queue needs to decide as the coordinator's model does."""

    slot: int
    instance: str
    """The instance's name, e.g. ``"A100#0"``."""
    epoch_unix_s: float
    time_scale: float
    """Cluster clock: ``now_s = (unix time - epoch_unix_s) * time_scale``."""
    cluster: str
    """The cluster as ``--cluster`` writes it: the worker builds the same latency models."""
    queue_policy: str
    queue_params_json: str
    heartbeat_interval_s: float
    drop_call_ids: tuple[str, ...] = ()
    """Resident calls the coordinator no longer wants there."""
    shard: str = ""
    """The shard's Redis key prefix this coordinator holds; "": not sharded."""


@dataclass(frozen=True, slots=True)
class Run:
    """Run a call: the dispatch of one attempt.

    A snapshot of the ticket as it is sent (`Run.of`): the ticket goes on changing (its
    attempt, its deadline) while this waits in the link's outbox, and the worker must get
    it as it was when it was sent."""

    call_id: str
    query_id: str
    tenant: str
    stage: int
    step: str
    input_tokens: int
    output_tokens: int
    """What the engine is asked to generate at most: the declared count."""
    expected_output_tokens: int
    """What the coordinator believes the call generates when it predicts lengths; 0: the
    same as `output_tokens` (the worker's queue then plans with that)."""
    prompt: str
    sequence: int
    """Global release order: every queue policy's tie-breaker."""
    query_sequence: int
    """Order of the query's arrival: the client key of fairness policies."""
    released_s: float
    deadline_s: float
    query_deadline_s: float
    remaining_after_s: float
    traceparent: str
    """W3C traceparent of the call's span."""
    attempt: int
    """1 for the first dispatch, +1 for each redispatch; the worker echoes it."""
    weight: float
    """The tail weight the dispatch charged (1 when the dispatcher does not weigh)."""
    messages: tuple[workflow_pb2.ChatMessage, ...] = ()
    """A chat request's messages as the client gave them; empty: a plain prompt."""
    options: workflow_pb2.CallOptions | None = None
    """How to generate, as the client asked; None: the engine's defaults (absent on the
    wire, which is not the same as an empty options message)."""

    @classmethod
    def of(
        cls,
        ticket: CallTicket,
        prompt: str = "",
        traceparent: str = "",
        messages: Sequence[workflow_pb2.ChatMessage] = (),
        options: workflow_pb2.CallOptions | None = None,
    ) -> Run:
        """The dispatch of `ticket` as it is now (`worker_wire.encode_command` writes it as
        a ``DispatchCall``, which the worker decodes with
        `hexgen_service.convert.dispatch_to_ticket`)."""
        call = ticket.call
        return cls(
            call_id=ticket.call_id,
            query_id=ticket.query_id,
            tenant=ticket.tenant,
            stage=ticket.stage,
            step=call.step,
            input_tokens=call.input_tokens,
            # What the engine is asked for: the declared tokens (`call` may hold the
            # scheduler's belief, `hexgen_flow.lengths`).
            output_tokens=ticket.output_tokens,
            expected_output_tokens=(
                call.output_tokens if call.output_tokens != ticket.output_tokens else 0
            ),
            prompt=prompt,
            sequence=ticket.seq,
            query_sequence=ticket.query_seq,
            released_s=ticket.released_s,
            deadline_s=ticket.deadline_s,
            query_deadline_s=ticket.query_deadline_s,
            remaining_after_s=ticket.remaining_after_s,
            traceparent=traceparent,
            attempt=ticket.attempt,
            weight=ticket.weight,
            messages=tuple(messages),
            options=options,
        )


@dataclass(frozen=True, slots=True)
class CancelRun:
    """Drop the call: queued, it leaves the queue; running, the engine aborts it."""

    call_id: str


@dataclass(frozen=True, slots=True)
class NewDeadline:
    """The call's stage deadline moved (the core revised a waiting call)."""

    call_id: str
    deadline_s: float


@dataclass(frozen=True, slots=True)
class Ack:
    """The coordinator recorded these completions: the worker may forget them."""

    call_ids: tuple[str, ...]


Command = Welcome | Run | CancelRun | NewDeadline | Ack
"""What the coordinator sends a worker (`WorkerLink.outbox` carries these)."""
