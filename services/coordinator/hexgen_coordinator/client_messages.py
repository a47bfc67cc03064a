"""The client API as the coordinator's parts speak it: the requests that start work (a
submission, a workflow session opened, a call given to it), a query's events, what clients
read about a query and the cluster, as small frozen values and enums.

The `CoordinatorService` RPCs carry protobuf (``coordinator_pb2``); only the gRPC servicer
(`hexgen_coordinator.service`) and its translator (`hexgen_coordinator.client_wire`) see
it. The servicer decodes each request into these types and encodes each answer from them;
the modules that own a stored form of the client API's messages read and write it through
`client_wire` (which says which). The parts that own the coordinator's state (`admission`,
`sessions`, `events`, `views`, `completions`, `dispatch`, `ledger`, `coordinator`) build and
read these types, so that they are written and tested without the wire, and a change of the
wire touches one module (issue 28).

The types keep the wire's meanings, proto3's included: 0, "" and an empty list stand for
"not given" wherever a field's docstring says so, as they did on the wire. They are not
turned into None, because the wire cannot tell the two apart and the bytes a client gets
(and the events kept in Redis) must stay those the coordinator wrote before these types
existed; `client_wire`'s translations are exact.

The enums' values are the wire's numbers, so a translation passes them through unchanged.

No protobuf here and no grpc (a chat call's `Chat` carries the client's messages as they
came: `worker_messages` says why).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import IntEnum

from hexgen_coordinator.worker_messages import Chat, ToolCall
from hexgen_flow.workload import Query
from hexgen_service.errors import InvalidFieldError

__all__ = [
    "AlphaChange",
    "AlphaHistory",
    "CallSubmitted",
    "ClusterStatus",
    "EventKind",
    "GivenCall",
    "InstanceStatus",
    "LatencySummary",
    "OpenWorkflow",
    "Overhead",
    "QueryDetail",
    "QueryEvent",
    "QueryInfo",
    "QueryState",
    "RecentOutcomes",
    "RunCall",
    "StageInfo",
    "Submission",
    "ToolCall",
    "opened_fields",
]


class EventKind(IntEnum):
    """What a `QueryEvent` says happened (the wire's ``QueryEventKind``, number for number).

    A query's log in Redis may hold a kind this coordinator does not name (written by a
    newer one before a roll back): it is kept as a member named ``UNKNOWN_<n>`` with its
    number, so that replaying the log gives a client the bytes it was written with."""

    UNSPECIFIED = 0
    SUBMITTED = 1
    STAGE_RELEASED = 2
    CALL_DISPATCHED = 3
    CALL_STARTED = 4
    CALL_TOKENS = 5
    """A chunk of a call's output: live only, never logged."""
    CALL_FINISHED = 6
    STAGE_FINISHED = 7
    CALL_REDISPATCHED = 8
    SUCCEEDED = 9
    CANCELLED = 10
    CALL_FAILED = 11
    """One attempt of a call failed (text: the error)."""
    FAILED = 12
    """The query ended FAILED (text: the reason)."""
    CALL_SKIPPED = 13
    """A call a workflow session expected was not given (text: why)."""
    CLOSED = 14
    """A workflow session takes no more calls (text: closed by the client, or idle)."""
    DEADLINE_UPDATED = 15
    """A waiting call's stage deadline was recomputed (text: the new deadline)."""
    CALL_SUBMITTED = 16
    """A call's prompt was given (a workflow session's RunCall)."""

    @classmethod
    def _missing_(cls, value: object) -> EventKind | None:
        """A number the enum does not name: a pseudo-member that keeps it (see above)."""
        if not isinstance(value, int):
            return None
        member = int.__new__(cls, value)
        member._name_ = f"UNKNOWN_{value}"
        member._value_ = value
        return member


class QueryState(IntEnum):
    """A query's state (the wire's ``QueryState``, number for number)."""

    UNSPECIFIED = 0
    """A stored state this coordinator does not know."""
    RUNNING = 1
    SUCCEEDED = 2
    CANCELLED = 3
    FAILED = 4
    """A call failed on every attempt allowed (`QueryInfo.failure_reason` says why)."""


@dataclass(frozen=True, slots=True)
class QueryEvent:
    """One entry of a query's event log, or a live-only token chunk.

    Built once per event (`hexgen_coordinator.events.record_event`), kept in the query's
    `ActiveQuery.events` until written behind to Redis, and handed as is to every watcher."""

    query_id: str
    kind: EventKind
    time_s: float
    sequence: int
    """Position in the query's event log, from 0."""
    stage: int = -1
    """The stage's index in the expanded workflow; -1: not about a stage."""
    call_id: str = ""
    """"": not about a call."""
    instance: str = ""
    """The instance's name (e.g. ``"A100#0"``) of a call's event; "": none."""
    text: str = ""
    """Generated text (CALL_TOKENS, CALL_FINISHED), an error or reason; "": none."""
    finish_reason: str = ""
    """CALL_FINISHED: "stop", "length" or "tool_calls"; "": the engine does not say."""
    tool_calls: tuple[ToolCall, ...] = ()
    """CALL_FINISHED: the tools the model called (the worker's report's own tuple)."""
    prompt_tokens: int = 0
    """CALL_FINISHED: the prompt as the engine counted it; 0: it does not say."""
    output_tokens: int = 0
    """CALL_FINISHED: the tokens the engine generated; 0: it does not say."""


@dataclass(frozen=True, slots=True)
class CallSubmitted:
    """The first answer to a workflow session's RunCall: the call's id (its event's), the
    stage deadline it got (or would get if released now), its CALL_SUBMITTED event and the
    workflow's traceparent. The events that follow are plain `QueryEvent`s."""

    event: QueryEvent
    deadline_s: float
    traceparent: str
    """The W3C traceparent of the workflow's root span; "": the coordinator does not say."""


@dataclass(frozen=True, slots=True)
class Submission:
    """A query as a client submitted it (SubmitQuery, RunQuery's query), or the workflow a
    session is opened with (`OpenWorkflow.expected`), within the coordinator's input
    limits: what admission takes.

    `client_wire.decode_submit` makes one from the request; a field outside the limits is
    an `InvalidFieldError` naming it, raised there, as admission raised it before."""

    query: Query
    """The query as submitted (its SLO as asked: admission resolves it)."""
    prompts: list[tuple[str, ...]]
    """Each expanded stage's prompts, call by call ("" where a call has none): handed on,
    not copied, to the running query (`ActiveQuery.prompts`)."""
    shape: Callable[[], bytes] = field(compare=False, repr=False)
    """The submission without its prompts, as Redis keeps it (the query's ``submit`` and
    ``shape``): encoded when called, so that only a submission that is stored pays for
    it."""
    received: float = field(compare=False)
    """`time.perf_counter()` when the request was decoded: where the coordinator's
    submit-to-dispatch time starts."""


@dataclass(frozen=True, slots=True)
class OpenWorkflow:
    """OpenWorkflow's request: the workflow a session expects, to be admitted as a
    submission of the session's id (`client_wire.decode_open_workflow`)."""

    expected: Submission
    """A named template's stages, or those the client gave; no call has a prompt."""
    names: tuple[str, ...]
    """Each expanded stage's name (its id, else its step): a RunCall names its stage by it."""
    idle_timeout_s: float
    """Wall seconds without a call after which the session is closed (the coordinator's
    ``--session-idle-s`` when the client gave none)."""


@dataclass(frozen=True, slots=True)
class GivenCall:
    """A call of a workflow session: as a client gives it (`RunCall.call`), or as Redis
    keeps it once given, its sizes in the session's ``g:{call_id}`` and its prompt and chat
    part in ``pr:{id}`` until it completes (`client_wire.call_from_bytes` reads either;
    the layout before kept them all in ``g:{call_id}``)."""

    step: str = ""
    """"": the step of the stage it is given to."""
    input_tokens: int = 0
    """0: estimated from the prompt."""
    output_tokens: int = 0
    """0: the expected call's (a default for a stage the workflow did not expect)."""
    prompt: str = ""
    """"": none (or none kept)."""
    chat: Chat | None = None
    """Its chat messages and options, copied out of the request (`client_wire.chat_part`);
    None: it has neither."""


@dataclass(frozen=True, slots=True)
class RunCall:
    """RunCall's request: one call given to a stage of an open workflow session."""

    workflow_id: str
    stage: str
    """The stage's name (its id, else its step); one the workflow does not expect adds a
    stage at the end."""
    call: GivenCall


@dataclass(frozen=True, slots=True)
class QueryInfo:
    """A query as a client reads it (submitting, cancelling, getting it)."""

    query_id: str
    tenant: str
    state: QueryState
    arrival_s: float
    slo_s: float
    deadline_s: float
    finished_s: float
    """0: not ended."""
    stages_total: int
    stages_done: int
    calls_total: int
    calls_done: int
    failure_reason: str = ""
    """Why the query failed; "" unless `state` is FAILED."""
    best_effort: bool = False
    """Admitted over the admission check's prediction, at the lowest urgency."""
    session: bool = False
    """A workflow session (OpenWorkflow)."""
    session_open: bool = False
    """A session that still takes calls."""
    traceparent: str = ""
    """The W3C traceparent of the workflow's root span; "": not said."""


@dataclass(frozen=True, slots=True)
class StageInfo:
    """One stage of a query, as GetQuery shows it."""

    index: int
    step: str
    name: str
    after: tuple[int, ...]
    calls_total: int
    calls_done: int
    calls_skipped: int
    calls_given: int
    released_s: float
    """0: not released."""
    finished_s: float
    """0: not finished."""
    deadline_s: float
    """0: none known."""


@dataclass(frozen=True, slots=True)
class QueryDetail:
    """GetQuery's answer: the query, its event log and its stages."""

    query: QueryInfo
    events: tuple[QueryEvent, ...]
    stages: tuple[StageInfo, ...]


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """A sample's summary; all zeros: no sample (still a summary on the wire: present,
    empty)."""

    count: int = 0
    p50: float = 0.0
    p99: float = 0.0
    max: float = 0.0


@dataclass(frozen=True, slots=True)
class RecentOutcomes:
    """How the queries that ended in the last `window_s` wall seconds ended."""

    window_s: float
    succeeded: int
    slo_met: int
    failed: int
    cancelled: int
    latency_s: LatencySummary
    """Of the succeeded ones."""


@dataclass(frozen=True, slots=True)
class Overhead:
    """The coordinator's own time (the wire's ``CoordinatorOverhead``)."""

    completion_to_dispatch_ms: LatencySummary
    submit_to_dispatch_ms: LatencySummary
    completions: int


@dataclass(frozen=True, slots=True)
class InstanceStatus:
    """One instance of the cluster and the worker holding it (if any)."""

    index: int
    name: str
    gpu: str
    model: str
    worker_id: str
    """"": no worker holds the slot."""
    connected: bool
    engine: str
    """"": no worker holds the slot."""
    in_flight: int
    running: int
    queued: int
    kv_used_tokens: int
    kv_capacity_tokens: int
    outstanding_s: float
    others_in_flight: int
    others_weight: float
    learned_prefill_factor: float
    """0: nothing learned (or no learner)."""
    learned_decode_factor: float
    learned_calls: int


@dataclass(frozen=True, slots=True)
class ClusterStatus:
    """ClusterStatus's answer."""

    instances: tuple[InstanceStatus, ...]
    policy: str
    alpha: float
    """0: the policy has no alpha."""
    time_scale: float
    now_s: float
    queries_running: int
    queries_finished: int
    queries_failed: int
    queries_rejected: int
    retention_s: float
    recent: RecentOutcomes
    slo_base_s: float
    cluster: str
    overhead: Overhead


@dataclass(frozen=True, slots=True)
class AlphaChange:
    """One change of α, on the cluster clock and the wall clock."""

    time_s: float
    unix_s: float
    alpha: float
    reason: str


@dataclass(frozen=True, slots=True)
class AlphaHistory:
    """GetAlphaHistory's answer: the α in force (0: the policy has none) and the changes
    kept, oldest first."""

    alpha: float
    changes: tuple[AlphaChange, ...]


@contextlib.contextmanager
def opened_fields() -> Iterator[None]:
    """An `InvalidFieldError` of the submission an OpenWorkflow is admitted as, named by
    the request's own fields: its ``query_id`` is the request's ``workflow_id``, its
    ``workflow`` the request's ``expected``. Both checks an OpenWorkflow meets use it: the
    input limits as it is decoded (`client_wire.decode_open_workflow`) and what the
    deployment serves as it is admitted (`Sessions.open`)."""
    try:
        yield
    except InvalidFieldError as exc:
        field = exc.field
        if field == "query_id":
            field = "workflow_id"
        elif field.startswith("workflow"):
            field = "expected" + field[len("workflow") :]
        raise InvalidFieldError(field, str(exc).split(": ", 1)[-1]) from None
