"""What the coordinator holds in memory: its running queries, their calls, its workers.

Redis (`WorkflowStore`) is the authoritative state; the ledger is the in-memory view the
scheduler works on, shared by every part of the coordinator (admission, dispatch,
completions, recovery, worker links, views). No part keeps a copy of it.

Concurrency: one asyncio loop. Everything that touches one query (completion, cancel)
holds that query's lock (`ActiveQuery.lock`), so Redis's view (authoritative) and the
in-memory view apply completions in the same order.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from dataclasses import dataclass, field

from opentelemetry import trace

from hexgen_coordinator.client_messages import QueryEvent
from hexgen_coordinator.links import WorkerLink
from hexgen_coordinator.metrics import CoordinatorMetrics
from hexgen_coordinator.worker_messages import Chat
from hexgen_flow.runtime import CallTicket, QueryRun
from hexgen_flow.workload import Query
from hexgen_service.clock import ClusterClock

__all__ = [
    "ActiveQuery",
    "Ledger",
    "SessionState",
    "call_id_of",
    "chat_bytes",
    "parse_call_id",
]


def chat_bytes(chat: Chat | None) -> int:
    """Bytes of a call's messages and options as the wire sizes them: kept, and counted,
    as its prompt is (absent options count 0, as an empty options message does)."""
    if chat is None:
        return 0
    size = sum(m.ByteSize() for m in chat.messages)
    return size + (chat.options.ByteSize() if chat.options is not None else 0)


def call_id_of(query_id: str, stage: int, index: int) -> str:
    return f"{query_id}/{stage}.{index}"


def parse_call_id(call_id: str) -> tuple[str, int, int]:
    query_id, _, rest = call_id.rpartition("/")
    stage, _, index = rest.partition(".")
    return query_id, int(stage), int(index)


@dataclass(eq=False)
class SessionState:
    """What a workflow session adds to a running query (`hexgen_coordinator.sessions`)."""

    opened: Query
    """The workflow as opened (what an OpenWorkflow of the same id must match)."""
    names: list[str]
    """Each stage's name (its id in the expected workflow, or the name it was added by)."""
    idle_timeout_s: float
    """Wall seconds without a call after which the session is closed."""
    last_call_wall: float
    """time.monotonic() of the latest given call (or of the opening)."""
    open: bool = True
    closed_stages: set[int] = field(default_factory=set)
    """Stages that take no more calls; their calls never given are skipped."""
    skipped: set[str] = field(default_factory=set)
    """Call ids skipped (never given)."""
    last_done_s: float = 0.0
    """Cluster time the latest call finished (or was given): a closed session ends then."""


@dataclass(eq=False)
class ActiveQuery:
    """In-memory companions of a running query."""

    run: QueryRun
    prompts: list[tuple[str, ...]]
    span: trace.Span
    events: list[QueryEvent] = field(default_factory=list)
    """Logged events since this coordinator took the query (token chunks are live only)."""
    event_base: int = 0
    """Events already in Redis when this coordinator resumed the query."""
    saved: int = 0
    """How many of `events` are in Redis."""
    watchers: set[asyncio.Queue[QueryEvent | None]] = field(default_factory=set)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    first_dispatch_pending: float | None = None
    session: SessionState | None = None
    """Set for a workflow session (OpenWorkflow); None for a query submitted whole."""
    stage_spans: dict[int, trace.Span] = field(default_factory=dict)
    """The open span of each released stage (its calls' spans are its children)."""
    chats: dict[str, Chat] = field(default_factory=dict)
    """A call's chat messages and options (`client_wire.chat_part`) by call id, for the
    calls given some (`prompts` holds the messages' rendering)."""
    held: dict[str, int] = field(default_factory=dict)
    """Bytes of each call's prompt still kept, by call id (`Ledger.hold_prompt`)."""
    digest: str = ""
    """`hexgen_coordinator.store.prompts_digest` of the prompts as submitted: what a
    resubmission of the same id is matched against once prompts are dropped."""
    trace: str = ""
    """The W3C traceparent of the workflow's root span, as stored with the query (Redis's
    ``trace``): `span` is that span, or after a restart a child of it; QueryInfo and the
    first RunCall answer give it to callers ("" for a query stored before it was kept)."""


class Ledger:
    """The shared in-memory state; every part mutates these very objects, never rebinds them
    (the `Coordinator` exposes `active`, `tickets` and `links` as attributes)."""

    def __init__(self, instances: int, clock: ClusterClock) -> None:
        self.clock = clock
        """The cluster clock; `Coordinator.start` replaces it with the one kept in Redis."""
        self.active: dict[str, ActiveQuery] = {}
        self.tickets: dict[str, CallTicket] = {}
        """Calls released and not finished, by call id; instance -1 while parked."""
        self.links: list[WorkerLink | None] = [None] * instances
        """The worker holding each slot, None while it has none."""
        self.adoptable: dict[str, int] = {}
        """After a restart: call id -> the slot Redis says it was dispatched to."""
        self.started: set[str] = set()
        """Calls a worker reported started and not finished: no longer movable."""
        self.call_spans: dict[str, trace.Span] = {}
        """The open span of each dispatched call, ended when it finishes or is sent again."""
        self.completion_ms: deque[float] = deque(maxlen=200_000)
        self.submit_ms: deque[float] = deque(maxlen=200_000)
        self.completions = 0
        self.queries_finished = 0
        self.queries_failed = 0
        """Queries that ended FAILED since this coordinator started."""
        self.metrics = CoordinatorMetrics()
        """The coordinator's Prometheus metrics (`hexgen_coordinator.metrics`)."""
        self.queries_rejected = 0
        """Submissions refused by admission control since this coordinator started."""
        self.recent: deque[tuple[float, str, float, bool]] = deque(maxlen=100_000)
        """(time.monotonic(), outcome, latency s, SLO met) of the latest queries that ended:
        what ClusterStatus sums over its window (`hexgen-flow top`)."""
        self.prompt_bytes: Counter[str] = Counter()
        """Prompt bytes each tenant has kept: its running calls' prompts, held from
        admission (or the call's RunCall) until the call completes or its query ends
        (``--max-tenant-prompt-bytes``)."""

    # ------------------------------------------------------------------ kept prompts

    def hold_prompt(self, entry: ActiveQuery, call_id: str, nbytes: int) -> None:
        """Count a call's prompt of `nbytes` against its tenant until it is dropped."""
        if nbytes <= 0:
            return
        tenant = entry.run.query.tenant
        self.prompt_bytes[tenant] += nbytes - entry.held.get(call_id, 0)
        entry.held[call_id] = nbytes

    def drop_prompt(self, entry: ActiveQuery, call_id: str) -> None:
        """The call completed: its prompt is not needed again (in memory or in Redis, whose
        completion script drops its copy)."""
        nbytes = entry.held.pop(call_id, 0)
        if nbytes:
            self._release(entry.run.query.tenant, nbytes)
        entry.chats.pop(call_id, None)
        _, stage, index = parse_call_id(call_id)
        if stage < len(entry.prompts) and index < len(entry.prompts[stage]):
            texts = entry.prompts[stage]
            if texts[index]:
                entry.prompts[stage] = (*texts[:index], "", *texts[index + 1 :])

    def drop_prompts(self, entry: ActiveQuery) -> None:
        """The query ended: every prompt it kept goes."""
        self._release(entry.run.query.tenant, sum(entry.held.values()))
        entry.held.clear()
        entry.chats.clear()
        entry.prompts = [tuple("" for _ in texts) for texts in entry.prompts]

    def _release(self, tenant: str, nbytes: int) -> None:
        left = self.prompt_bytes[tenant] - nbytes
        if left > 0:
            self.prompt_bytes[tenant] = left
        else:
            self.prompt_bytes.pop(tenant, None)
