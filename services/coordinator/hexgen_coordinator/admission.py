"""Admission: validate a submitted query, store it once, release its root stages.

Idempotent on the client's `query_id`: Redis's submit script creates the query only if it
does not exist, so a resubmission (or one that races the first) returns the stored query.
"""

from __future__ import annotations

import time

from opentelemetry import trace

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_coordinator.config import CoordinatorConfig
from hexgen_coordinator.dispatch import Dispatch
from hexgen_coordinator.events import record_event
from hexgen_coordinator.ledger import ActiveQuery, Ledger
from hexgen_coordinator.store import WorkflowStore
from hexgen_coordinator.views import QueryViews
from hexgen_coordinator.write_behind import WriteBehind
from hexgen_flow.runtime import CallTicket
from hexgen_flow.scheduler import GlobalScheduler
from hexgen_flow.workload import Query
from hexgen_service.convert import parse_submit
from hexgen_service.errors import InvalidFieldError

__all__ = ["Admission"]

K = cpb.QueryEventKind


class Admission:
    def __init__(
        self,
        config: CoordinatorConfig,
        scheduler: GlobalScheduler,
        store: WorkflowStore,
        tracer: trace.Tracer,
        ledger: Ledger,
        dispatch: Dispatch,
        writes: WriteBehind,
        views: QueryViews,
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self.store = store
        self.tracer = tracer
        self.ledger = ledger
        self.dispatch = dispatch
        self.writes = writes
        self.views = views

    async def submit(self, request: cpb.SubmitQueryRequest) -> tuple[cpb.QueryInfo, bool]:
        """Admit a query (idempotent on its id); raises InvalidFieldError for bad input."""
        t0 = time.perf_counter()
        query, prompts = parse_submit(request)
        self.check_fits(query)
        active = self.ledger.active
        existing = active.get(query.query_id)
        if existing is not None:
            return self.views.info_of_run(existing.run), False
        now = self.ledger.clock.now()
        slo_s = self.scheduler.slo_of(query, self.config.slo_scale)
        stages = query.workflow.stages
        created, index = await self.store.submit(
            query.query_id,
            request.SerializeToString(),
            query.tenant,
            now,
            slo_s,
            [len(s.calls) for s in stages],
            [len(s.after) for s in stages],
        )
        if not created or query.query_id in active:
            return await self.views.get_info(query.query_id), False
        run = self.scheduler.admit(query, index, now, slo_s)
        span = self.tracer.start_span(
            "query",
            attributes={
                "query.id": query.query_id,
                "query.tenant": query.tenant,
                "query.slo_s": slo_s,
                "query.calls": query.workflow.num_calls,
            },
        )
        entry = ActiveQuery(run, prompts, span, first_dispatch_pending=t0)
        active[query.query_id] = entry
        record_event(entry, K.QUERY_EVENT_KIND_SUBMITTED, now)
        released: list[CallTicket] = []
        for k in query.workflow.roots:
            released.extend(self.dispatch.release_stage(entry, k, now))
        self.dispatch.send(released)
        self.dispatch.note_first_dispatch(entry, released)
        self.writes.persist(entry, released)
        return self.views.info_of_run(run), True

    def check_fits(self, query: Query) -> None:
        oversized = self.scheduler.oversized_call(query)
        if oversized is not None:
            k, c, call = oversized
            raise InvalidFieldError(
                f"workflow.stages[{k}].calls[{c}]",
                f"{call.input_tokens}+{call.output_tokens} tokens fit no instance's KV cache "
                f"(largest: {max(self.scheduler.load.kv_tokens)} tokens)",
            )
