"""What the coordinator holds in memory: its running queries, their calls, its workers.

Redis (`WorkflowStore`) is the authoritative state; the ledger is the in-memory view the
scheduler works on. It is held by a few owners, one per concern, each behind the narrow
methods its users need:

- `Queries`: the running queries (`ActiveQuery`) and the prompts they keep, by tenant;
- `Calls`: the calls in flight (their tickets), their open spans, and after a restart
  which worker may reclaim each;
- `Slots`: the worker holding each instance's slot;
- `Tally`: counters and latest outcomes for ClusterStatus, and the Prometheus metrics;
- `Clock`: the cluster clock, replaced for every part at once when the coordinator starts.

Each part of the coordinator (admission, dispatch, completions, recovery, sessions,
workers, views, events, metrics) takes the owners it uses, never the whole `Ledger`: that
is only what `Coordinator` wires them from. Parts read an owner's containers, which are
never rebound, and change them only through its methods. No part keeps a copy.

Concurrency: one asyncio loop. Everything that touches one query (completion, cancel)
holds that query's lock (`ActiveQuery.lock`), so Redis's view (authoritative) and the
in-memory view apply completions in the same order.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Callable
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
    "Calls",
    "Clock",
    "Ledger",
    "Queries",
    "SessionState",
    "Slots",
    "Tally",
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
    """Bytes of each call's prompt still kept, by call id (`Queries.hold_prompt`)."""
    digest: str = ""
    """`hexgen_coordinator.store.prompts_digest` of the prompts as submitted: what a
    resubmission of the same id is matched against once prompts are dropped."""
    trace: str = ""
    """The W3C traceparent of the workflow's root span, as stored with the query (Redis's
    ``trace``): `span` is that span, or after a restart a child of it; QueryInfo and the
    first RunCall answer give it to callers ("" for a query stored before it was kept)."""


class Clock:
    """The cluster clock, one for every part: `set` replaces it for all of them at once
    (`Coordinator.start` sets the one kept in Redis; a test, a hand-driven one)."""

    __slots__ = ("current", "now")

    def __init__(self, clock: ClusterClock) -> None:
        self.current: ClusterClock = clock
        """The clock in force."""
        self.now: Callable[[], float] = clock.now
        """The cluster time now (`current.now`, bound once: as cheap as reading it)."""

    def set(self, clock: ClusterClock) -> None:
        self.current = clock
        self.now = clock.now

    @property
    def time_scale(self) -> float:
        return self.current.time_scale

    @property
    def epoch_unix_s(self) -> float:
        return self.current.epoch_unix_s


class Queries:
    """The running queries (`active`, by id) and the prompts they keep, counted by tenant.

    Parts read `active` (never rebound) and change it only through these methods: a query
    is added when admitted, opened or resumed, and `end`ed when it ends."""

    __slots__ = ("active", "prompt_bytes")

    def __init__(self) -> None:
        self.active: dict[str, ActiveQuery] = {}
        self.prompt_bytes: Counter[str] = Counter()
        """Prompt bytes each tenant has kept: its running calls' prompts, held from
        admission (or the call's RunCall) until the call completes or its query ends
        (``--max-tenant-prompt-bytes``)."""

    def add(self, entry: ActiveQuery) -> None:
        """A query runs here from now on (admitted, opened, or resumed after a restart)."""
        self.active[entry.run.query.query_id] = entry

    def end(self, entry: ActiveQuery) -> None:
        """The query ended: it is forgotten, and every prompt it kept goes (Redis's went with
        the script that ended it)."""
        self.active.pop(entry.run.query.query_id, None)
        self._release(entry.run.query.tenant, sum(entry.held.values()))
        entry.held.clear()
        entry.chats.clear()
        entry.prompts = [tuple("" for _ in texts) for texts in entry.prompts]

    def kept_bytes(self, tenant: str) -> int:
        """Prompt bytes `tenant`'s running calls keep now."""
        return self.prompt_bytes.get(tenant, 0)

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

    def _release(self, tenant: str, nbytes: int) -> None:
        left = self.prompt_bytes[tenant] - nbytes
        if left > 0:
            self.prompt_bytes[tenant] = left
        else:
            self.prompt_bytes.pop(tenant, None)


class Calls:
    """The calls released and not finished, their spans, and after a restart which worker
    may reclaim each.

    Parts read `tickets` and `adoptable` (never rebound) and change them only through these
    methods."""

    __slots__ = ("adoptable", "spans", "tickets")

    def __init__(self) -> None:
        self.tickets: dict[str, CallTicket] = {}
        """Calls released and not finished, by call id; instance -1 while parked."""
        self.adoptable: dict[str, int] = {}
        """After a restart: call id -> the slot Redis says it was dispatched to."""
        self.spans: dict[str, trace.Span] = {}
        """The open span of each dispatched call, ended when it finishes or is sent again."""

    def add(self, ticket: CallTicket) -> None:
        """A call released (or resumed, or given to a session) is in flight, by its id."""
        self.tickets[ticket.call_id] = ticket

    def forget(self, call_id: str) -> None:
        """The call completed (or was skipped)."""
        del self.tickets[call_id]

    def forget_query(self, query_id: str) -> None:
        """The query ended early: its calls go, and their open spans end."""
        for ticket in [t for t in self.tickets.values() if t.query_id == query_id]:
            del self.tickets[ticket.call_id]
            self.adoptable.pop(ticket.call_id, None)
            span = self.spans.pop(ticket.call_id, None)
            if span is not None:
                span.end()

    def open_span(self, call_id: str, span: trace.Span) -> None:
        """The call was sent: `span` is its open span (one it was sent with before ends)."""
        old = self.spans.pop(call_id, None)
        if old is not None:
            old.end()
        self.spans[call_id] = span

    def close_span(self, call_id: str) -> trace.Span | None:
        """The call finished: its open span, if any, for the caller to end."""
        return self.spans.pop(call_id, None)

    def keep_adoptable(self, call_id: str, slot: int) -> None:
        """After a restart: the worker on `slot` may reclaim the call."""
        self.adoptable[call_id] = slot

    def drop_adoptable(self, call_id: str) -> None:
        """No worker reclaims the call any more (one did, or its result came)."""
        self.adoptable.pop(call_id, None)

    def take_unclaimed(self) -> list[str]:
        """The grace after a restart is over: the calls no worker reclaimed, none left
        adoptable."""
        unclaimed = list(self.adoptable)
        self.adoptable.clear()
        return unclaimed


class Slots:
    """The worker holding each instance's slot (`links`, by slot; None while it has none).

    Parts read `links` (never rebound); a worker takes and leaves its slot through these
    methods (`hexgen_coordinator.workers`)."""

    __slots__ = ("links",)

    def __init__(self, instances: int) -> None:
        self.links: list[WorkerLink | None] = [None] * instances

    def hold(self, slot: int, link: WorkerLink) -> None:
        self.links[slot] = link

    def free(self, slot: int) -> None:
        self.links[slot] = None


class Tally:
    """What this coordinator counted since it started, its latest outcomes, and its
    Prometheus metrics: what ClusterStatus and /metrics report. Parts count through these
    methods (and `metrics`' own); they read the counters."""

    __slots__ = (
        "completion_ms",
        "completions",
        "metrics",
        "queries_failed",
        "queries_finished",
        "queries_rejected",
        "recent",
        "submit_ms",
    )

    def __init__(self) -> None:
        self.completion_ms: deque[float] = deque(maxlen=200_000)
        """Wall ms from a worker's result to the calls it released being sent."""
        self.submit_ms: deque[float] = deque(maxlen=200_000)
        """Wall ms from a submission to its first call being sent."""
        self.completions = 0
        """Calls completed since this coordinator started."""
        self.queries_finished = 0
        """Queries that succeeded in this cluster (the `finished` stream's length)."""
        self.queries_failed = 0
        """Queries that ended FAILED since this coordinator started."""
        self.queries_rejected = 0
        """Submissions refused by admission control since this coordinator started."""
        self.recent: deque[tuple[float, str, float, bool]] = deque(maxlen=100_000)
        """(time.monotonic(), outcome, latency s, SLO met) of the latest queries that ended:
        what ClusterStatus sums over its window (`hexgen-flow top`)."""
        self.metrics = CoordinatorMetrics()
        """The coordinator's Prometheus metrics (`hexgen_coordinator.metrics`)."""

    def carry_on(self, queries_finished: int) -> None:
        """Count on from the queries that succeeded before this coordinator started."""
        self.queries_finished = queries_finished

    def rejected(self, tenant: str, reason: str) -> None:
        """Admission control refused a submission of `tenant` (`reason`: `REJECTION_REASONS`)."""
        self.queries_rejected += 1
        self.metrics.queries_rejected.labels(tenant, reason).inc()

    def call_completed(self) -> None:
        self.completions += 1

    def first_dispatch(self, elapsed: float) -> None:
        """A query's first call was sent `elapsed` wall seconds after its submission."""
        self.submit_ms.append(elapsed * 1e3)
        self.metrics.submit_to_dispatch.observe(elapsed)

    def completion_dispatch(self, elapsed: float) -> None:
        """The calls a result released were sent `elapsed` wall seconds after it came."""
        self.completion_ms.append(elapsed * 1e3)
        self.metrics.completion_to_dispatch.observe(elapsed)

    def query_failed(self) -> None:
        self.queries_failed += 1

    def query_ended(self, tenant: str, outcome: str, latency: float | None, slo_s: float) -> None:
        """A query of `tenant` ended (`outcome`: succeeded, failed or cancelled); `latency`:
        its cluster seconds from arrival to finish when it succeeded, None otherwise."""
        metrics = self.metrics
        metrics.queries_finished.labels(tenant, outcome).inc()
        met = False
        if latency is not None:  # succeeded (the `finished` stream counts these)
            self.queries_finished += 1
            metrics.query_latency.labels(tenant).observe(latency)
            met = latency <= slo_s
            if met:
                metrics.slo_met.labels(tenant).inc()
        self.recent.append((time.monotonic(), outcome, latency or 0.0, met))


class Ledger:
    """The owners of the coordinator's in-memory state, one per concern, as the
    `Coordinator` wires them into its parts; no part takes the ledger itself, only the
    owners it uses (each part's constructor says which)."""

    __slots__ = ("calls", "clock", "queries", "slots", "tally")

    def __init__(self, instances: int, clock: ClusterClock) -> None:
        self.clock = Clock(clock)
        self.queries = Queries()
        self.calls = Calls()
        self.slots = Slots(instances)
        self.tally = Tally()
