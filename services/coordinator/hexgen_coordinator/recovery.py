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

import redis.asyncio as aioredis
from opentelemetry import trace

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_coordinator.config import CoordinatorConfig
from hexgen_coordinator.dispatch import Dispatch
from hexgen_coordinator.ledger import ActiveQuery, Ledger, SessionState, call_id_of, chat_bytes
from hexgen_coordinator.session_store import stored_workflow
from hexgen_coordinator.store import StoredQuery, WorkflowStore, prompts_digest
from hexgen_flow.protocol import Adopt, GraceOver, Resume, Scheduler, Tick
from hexgen_flow.runtime import CallTicket
from hexgen_service import redis_schema as schema
from hexgen_service.convert import parse_submit
from hexgen_service.redis_schema import F, S
from hexgen_service.telemetry import context_from_traceparent, traceparent_of

__all__ = ["Recovery"]

log = logging.getLogger("hexgen_coordinator.coordinator")  # the coordinator's one logger


class Recovery:
    def __init__(
        self,
        config: CoordinatorConfig,
        core: Scheduler,
        store: WorkflowStore,
        redis: aioredis.Redis[bytes],
        tracer: trace.Tracer,
        ledger: Ledger,
        dispatch: Dispatch,
    ) -> None:
        self.config = config
        self.core = core
        self.scheduler = core.policy
        """Read here (its budget replays a stage's deadline), and where a resumed query's
        state is rebuilt (`admit`, release order): the core takes it up by `Resume`."""
        self.store = store
        self.redis = redis
        self.tracer = tracer
        self.ledger = ledger
        self.dispatch = dispatch
        self.reclaimed = 0
        """Calls a worker reclaimed after the resume (its hello listed them as resident)."""
        self._waiting = 0
        """Calls the resume found dispatched, waiting for their workers."""

    async def resume(self) -> asyncio.Task[None] | None:
        """Rebuild every running query from Redis; its calls wait for their workers to
        reclaim them for `resume_grace_s`, then go out again (the task returned, if any
        call waits)."""
        ledger = self.ledger
        ids = await self.store.active_ids()
        max_seq = -1
        for query_id in ids:
            stored = await self.store.load(query_id)
            if stored is None or stored.fields.get(F.STATE) != S.RUNNING:
                continue
            logged = int(await self.redis.llen(self.store.evkey(query_id)))
            max_seq = max(max_seq, self._resume_query(stored, logged))
        self.scheduler.next_seq = max(self.scheduler.next_seq, max_seq + 1)
        self._waiting = len(ledger.adoptable)
        if ledger.adoptable or any(t.instance < 0 for t in ledger.tickets.values()):
            log.info(
                "resumed %d queries, %d calls wait for their workers",
                len(ledger.active),
                len(ledger.tickets),
            )
            return asyncio.create_task(self._end_grace())
        return None

    async def resume_one(self, query_id: str) -> None:
        """Take up one stored running query this coordinator does not hold, and dispatch
        its released calls."""
        stored = await self.store.load(query_id)
        if (
            stored is None
            or stored.fields.get(F.STATE) != S.RUNNING
            or query_id in self.ledger.active
        ):
            return
        logged = int(await self.redis.llen(self.store.evkey(query_id)))
        # No worker holds a call of a query never taken: nothing is reserved.
        max_seq = self._resume_query(stored, logged, reserve=False)
        self.scheduler.next_seq = max(self.scheduler.next_seq, max_seq + 1)
        log.info("took up query %s, stored by a try whose reply was lost", query_id)
        now = self.ledger.clock.now()
        self.dispatch.carry_out(self.core.handle(Tick(now)), now)

    def _resume_query(
        self, stored: StoredQuery, logged_events: int, *, reserve: bool = True
    ) -> int:
        ledger = self.ledger
        built = stored_workflow(stored)
        query = built.query
        f = stored.fields
        run = self.scheduler.admit(query, int(f[F.INDEX]), float(f[F.ARRIVAL_S]), float(f[F.SLO_S]))
        # A child of the workflow's root span as stored: the resumed query's stages and
        # calls stay in the workflow's trace.
        root = f.get(F.TRACE, "")
        span = self.tracer.start_span(
            "query (resumed)",
            context=context_from_traceparent(root),
            attributes={"query.id": query.query_id, "gen_ai.conversation.id": query.query_id},
        )
        # Stored before prompts were kept apart: no digest, and the submission held them.
        digest = f.get(F.DIGEST) or prompts_digest(
            parse_submit(cpb.SubmitQueryRequest.FromString(stored.submit))[1]
        )
        entry = ActiveQuery(
            run,
            built.prompts,
            span,
            event_base=logged_events,
            chats=built.chats,
            digest=digest,
            trace=root or traceparent_of(span),
        )
        if built.given is not None:
            run.given = list(built.given)
            opened = parse_submit(cpb.SubmitQueryRequest.FromString(stored.submit))[0]
            entry.session = SessionState(
                opened=opened,
                names=built.names,
                idle_timeout_s=built.idle_s,
                last_call_wall=time.monotonic(),  # the idle clock starts again
                open=built.session_open,
                closed_stages=built.closed_stages,
                skipped=stored.skipped(),
                last_done_s=self.ledger.clock.now(),
            )
        ledger.active[query.query_id] = entry
        stages = query.workflow.stages
        for k, texts in enumerate(built.prompts):  # the prompts still kept (calls not done)
            for index, text in enumerate(texts):
                call_id = call_id_of(query.query_id, k, index)
                if text and not stored.done(call_id):
                    nbytes = len(text.encode("utf-8")) + chat_bytes(built.chats.get(call_id))
                    ledger.hold_prompt(entry, call_id, nbytes)
        run.calls_left = int(f[F.CALLS_LEFT])
        released = []
        for k in range(len(stages)):
            run.stage_calls_left[k] = int(f[schema.stage_field(k, schema.STAGE_LEFT)])
            run.deps_left[k] = int(f[schema.stage_field(k, schema.STAGE_DEPS)])
            rel, fin = stored.stage(k, schema.STAGE_REL), stored.stage(k, schema.STAGE_FIN)
            run.stage_finished_s[k] = float(fin) if fin is not None else None
            if rel is not None:
                released.append((float(rel), k))
        max_seq = -1
        tickets: list[CallTicket] = []
        reserved: list[int] = []
        plan = self.scheduler.estimator.plan(query.workflow, "call")
        for rel_s, k in sorted(released):
            run.stage_released_s[k] = rel_s
            computed = self.scheduler.budget.deadline(run, k, rel_s)  # replays budget state
            if run.stage_finished_s[k] is not None:
                continue
            dl = stored.stage(k, schema.STAGE_DL)
            deadline = float(dl) if dl is not None else computed
            for index, call in enumerate(stages[k].calls):
                call_id = call_id_of(query.query_id, k, index)
                if stored.done(call_id):
                    continue
                placed = stored.placement(call_id) if run.is_given(k, index) else None
                slot = -1
                if placed is not None and placed.seq >= 0 and placed.slot >= 0:
                    slot, seq = placed.slot, placed.seq
                else:  # never placed, or between attempts: a new release order
                    seq = self.scheduler.next_seq
                    self.scheduler.next_seq += 1
                ticket = CallTicket(
                    seq, run, k, call, rel_s, deadline, plan.tail_s[k] - plan.stage_s[k], index
                )
                ticket.call_id = call_id
                # Attempt 0, unknown: the write-behind may not have recorded the latest
                # dispatch before the crash, so the worker that reclaims the call may hold a
                # later attempt than Redis says. Its result is taken by slot alone; the
                # next dispatch counts from 1 again.
                ticket.attempt = 0
                ledger.tickets[call_id] = ticket
                max_seq = max(max_seq, seq)
                if slot >= 0 and reserve:
                    ledger.adoptable[call_id] = slot
                tickets.append(ticket)
                reserved.append(slot if reserve else -1)
        self.core.handle(Resume(run, tuple(tickets), tuple(reserved)))
        return max_seq

    async def _end_grace(self) -> None:
        await asyncio.sleep(self.config.resume_grace_s)
        unclaimed = list(self.ledger.adoptable)
        self.ledger.adoptable.clear()
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
        now = self.ledger.clock.now()
        self.dispatch.carry_out(self.core.handle(GraceOver(now)), now)

    def adopt(self, ticket: CallTicket, slot: int) -> None:
        """A call a reconnecting worker still holds goes back on its ledger."""
        self.ledger.adoptable.pop(ticket.call_id, None)
        self.reclaimed += 1
        self.core.handle(Adopt(ticket, slot, self.ledger.clock.now()))
