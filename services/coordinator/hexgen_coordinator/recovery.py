"""Recovery after a coordinator restart: every running query is rebuilt from Redis.

A call Redis says was dispatched is adoptable: the worker that still holds it reclaims it
when it reconnects (`hexgen_coordinator.workers`). What no worker reclaims within
`resume_grace_s`, and what was never dispatched, goes out again. When the grace ends the
log says how many were reclaimed (`reclaimed`), reported finished, and dispatched again: a
takeover of a coordinator shard whose workers handed the shard's calls over
(`hexgen_worker.handover`) reclaims them all instead of running them twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import NamedTuple

import redis.asyncio as aioredis
from opentelemetry import trace

from hexgen_coordinator.config import CoordinatorConfig
from hexgen_coordinator.dispatch import Dispatch
from hexgen_coordinator.ledger import (
    ActiveQuery,
    Calls,
    Clock,
    Queries,
    SessionState,
    call_id_of,
    chat_bytes,
)
from hexgen_coordinator.session_store import StoredWorkflow, stored_submission, stored_workflow
from hexgen_coordinator.store import StoredQuery, WorkflowStore, prompts_digest
from hexgen_flow.protocol import (
    Adopt,
    GraceOver,
    Resume,
    Resumed,
    Scheduler,
    StoredRun,
    StoredStage,
    Tick,
)
from hexgen_flow.runtime import CallState, CallTicket
from hexgen_service import redis_schema as schema
from hexgen_service.redis_schema import F, S
from hexgen_service.telemetry import context_from_traceparent, traceparent_of

__all__ = ["Recovery"]

log = logging.getLogger("hexgen_coordinator.coordinator")  # the coordinator's one logger


class _Found(NamedTuple):
    """A running query found in Redis."""

    stored: StoredQuery
    built: StoredWorkflow
    logged_events: int


def stored_run(stored: StoredQuery, built: StoredWorkflow) -> StoredRun:
    """What the core rebuilds a stored running query from (`Resume`): Redis's counters,
    stage times and deadlines, the calls done and where the others were dispatched."""
    query = built.query
    f = stored.fields
    stages: list[StoredStage] = []
    done: set[tuple[int, int]] = set()
    placed: dict[tuple[int, int], tuple[int, int]] = {}
    for k, stage in enumerate(query.workflow.stages):
        rel, fin = stored.stage(k, schema.STAGE_REL), stored.stage(k, schema.STAGE_FIN)
        dl = stored.stage(k, schema.STAGE_DL)
        stages.append(
            StoredStage(
                int(f[schema.stage_field(k, schema.STAGE_LEFT)]),
                int(f[schema.stage_field(k, schema.STAGE_DEPS)]),
                float(rel) if rel is not None else None,
                float(fin) if fin is not None else None,
                float(dl) if dl is not None else None,
            )
        )
        for index in range(len(stage.calls)):
            call_id = call_id_of(query.query_id, k, index)
            if stored.done(call_id):
                done.add((k, index))
                continue
            p = stored.placement(call_id)
            if p is not None and p.seq >= 0 and p.slot >= 0:
                placed[(k, index)] = (p.seq, p.slot)
    return StoredRun(
        query,
        int(f[F.INDEX]),
        float(f[F.ARRIVAL_S]),
        float(f[F.SLO_S]),
        int(f[F.CALLS_LEFT]),
        tuple(stages),
        frozenset(done),
        placed,
        best_effort=f.get(F.BEST_EFFORT) == schema.BEST_EFFORT_YES,
        given=tuple(built.given) if built.given is not None else None,
    )


class Recovery:
    def __init__(
        self,
        config: CoordinatorConfig,
        core: Scheduler,
        store: WorkflowStore,
        redis: aioredis.Redis[bytes],
        tracer: trace.Tracer,
        queries: Queries,
        calls: Calls,
        clock: Clock,
        dispatch: Dispatch,
    ) -> None:
        self.config = config
        self.core = core
        self.store = store
        self.redis = redis
        self.tracer = tracer
        self.queries = queries
        self.calls = calls
        self.clock = clock
        self.dispatch = dispatch
        self.reclaimed = 0
        """Calls a worker reclaimed after the resume (its hello listed them as resident)."""
        self._waiting = 0
        """Calls the resume found dispatched, waiting for their workers."""

    async def resume(self) -> asyncio.Task[None] | None:
        """Rebuild every running query from Redis; its calls wait for their workers to
        reclaim them for `resume_grace_s`, then go out again (the task returned, if any
        call waits)."""
        calls = self.calls
        found: list[_Found] = []
        for query_id in await self.store.active_ids():
            taken = await self._load(query_id)
            if taken is not None:
                found.append(taken)
        self._take_up(found, reserve=True)
        self._waiting = len(calls.adoptable)
        if calls.adoptable or any(t.instance < 0 for t in calls.tickets.values()):
            log.info(
                "resumed %d queries, %d calls wait for their workers",
                len(self.queries.active),
                len(calls.tickets),
            )
            return asyncio.create_task(self._end_grace())
        return None

    async def resume_one(self, query_id: str) -> None:
        """Take up one stored running query this coordinator does not hold, and dispatch
        its released calls."""
        if query_id in self.queries.active:
            return
        taken = await self._load(query_id)
        if taken is None or query_id in self.queries.active:
            return
        # No worker holds a call of a query never taken: nothing is reserved.
        self._take_up([taken], reserve=False)
        log.info("took up query %s, stored by a try whose reply was lost", query_id)
        now = self.clock.now()
        self.dispatch.carry_out(self.core.handle(Tick(now)), now)

    async def _load(self, query_id: str) -> _Found | None:
        """The stored query `query_id` if it is running, with its workflow and how many
        events its log holds."""
        stored = await self.store.load(query_id)
        if stored is None or stored.fields.get(F.STATE) != S.RUNNING:
            return None
        logged = int(await self.redis.llen(self.store.evkey(query_id)))
        return _Found(stored, stored_workflow(stored), logged)

    def _take_up(self, found: Sequence[_Found], *, reserve: bool) -> None:
        """Hand the stored queries to the core (`Resume`: it rebuilds each run and its
        calls) and hold what the coordinator keeps of each: prompts, span, session, the
        calls by id and which worker may reclaim each."""
        if not found:
            return
        actions = self.core.handle(
            Resume(tuple(stored_run(f.stored, f.built) for f in found), reserve)
        )
        for taken, action in zip(found, actions, strict=True):
            assert isinstance(action, Resumed)
            self._hold(taken, action)

    def _hold(self, taken: _Found, resumed: Resumed) -> None:
        queries, calls = self.queries, self.calls
        stored, built, run = taken.stored, taken.built, resumed.run
        query = built.query
        f = stored.fields
        # A child of the workflow's root span as stored: the resumed query's stages and
        # calls stay in the workflow's trace.
        root = f.get(F.TRACE, "")
        span = self.tracer.start_span(
            "query (resumed)",
            context=context_from_traceparent(root),
            attributes={"query.id": query.query_id, "gen_ai.conversation.id": query.query_id},
        )
        # Stored before prompts were kept apart: no digest, and the submission held them.
        digest = f.get(F.DIGEST) or prompts_digest(stored_submission(stored)[1])
        entry = ActiveQuery(
            run,
            built.prompts,
            span,
            event_base=taken.logged_events,
            chats=built.chats,
            digest=digest,
            trace=root or traceparent_of(span),
        )
        if built.given is not None:
            opened = stored_submission(stored)[0]
            entry.session = SessionState(
                opened=opened,
                names=built.names,
                idle_timeout_s=built.idle_s,
                last_call_wall=time.monotonic(),  # the idle clock starts again
                open=built.session_open,
                closed_stages=built.closed_stages,
                skipped=stored.skipped(),
                last_done_s=self.clock.now(),
            )
        queries.add(entry)
        for k, texts in enumerate(built.prompts):  # the prompts still kept (calls not done)
            for index, text in enumerate(texts):
                call_id = call_id_of(query.query_id, k, index)
                if text and not stored.done(call_id):
                    nbytes = len(text.encode("utf-8")) + chat_bytes(built.chats.get(call_id))
                    queries.hold_prompt(entry, call_id, nbytes)
        for ticket in resumed.tickets:
            call_id = call_id_of(query.query_id, ticket.stage, ticket.index)
            ticket.call_id = call_id
            # Attempt 0, unknown: the write-behind may not have recorded the latest
            # dispatch before the crash, so the worker that reclaims the call may hold a
            # later attempt than Redis says. Its result is taken by slot alone; the next
            # dispatch counts from 1 again.
            ticket.attempt = 0
            calls.add(ticket)
            if ticket.state is CallState.RESERVED:
                placed = stored.placement(call_id)
                assert placed is not None  # RESERVED: the core found it placed
                calls.keep_adoptable(call_id, placed.slot)

    async def _end_grace(self) -> None:
        await asyncio.sleep(self.config.resume_grace_s)
        unclaimed = self.calls.take_unclaimed()
        # What left the adoptable set otherwise: results a worker resent (or cancels).
        reported = self._waiting - self.reclaimed - len(unclaimed)
        log.info(
            "resume grace over: %d of %d dispatched calls reclaimed by their workers, %d "
            "reported finished, %d not reclaimed (dispatching again)",
            self.reclaimed,
            self._waiting,
            max(reported, 0),
            len(unclaimed),
        )
        now = self.clock.now()
        self.dispatch.carry_out(self.core.handle(GraceOver(now)), now)

    def adopt(self, ticket: CallTicket, slot: int) -> None:
        """A call a reconnecting worker still holds goes back on its ledger."""
        self.calls.drop_adoptable(ticket.call_id)
        self.reclaimed += 1
        self.core.handle(Adopt(ticket, slot, self.clock.now()))
