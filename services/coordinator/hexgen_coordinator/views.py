"""What clients read: a query's `QueryInfo` and events, and the cluster's status.

A running query is read from memory (`ledger.Queries`: ahead of Redis by the writes still
behind), any other from Redis. A query's events are streamed live by
`hexgen_coordinator.events.watch`.

The answers are `client_messages`' values (the servicer encodes them). This module also
reads a query's event log back from Redis (`logged_events`): the log is kept as the
client API's ``QueryEvent`` bytes, which `client_wire.event_from_bytes` decodes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from itertools import takewhile

from hexgen_coordinator.client_messages import (
    ClusterStatus,
    InstanceStatus,
    LatencySummary,
    Overhead,
    QueryDetail,
    QueryEvent,
    QueryInfo,
    QueryState,
    RecentOutcomes,
    StageInfo,
)
from hexgen_coordinator.client_wire import event_from_bytes
from hexgen_coordinator.ledger import Calls, Clock, Queries, Slots, Tally
from hexgen_coordinator.session_store import stored_workflow
from hexgen_coordinator.store import StoredQuery, WorkflowStore
from hexgen_flow.admission import is_best_effort
from hexgen_flow.cluster import Cluster
from hexgen_flow.metrics import percentile
from hexgen_flow.runtime import QueryRun
from hexgen_flow.scheduler import GlobalScheduler
from hexgen_service import redis_schema as schema
from hexgen_service.redis_schema import F, S

__all__ = ["QueryViews", "UnknownQueryError"]

_STATES = {
    S.RUNNING: QueryState.RUNNING,
    S.SUCCEEDED: QueryState.SUCCEEDED,
    S.CANCELLED: QueryState.CANCELLED,
    S.FAILED: QueryState.FAILED,
}
"""A stored query's state (`redis_schema.F.STATE`) as clients read it."""


class UnknownQueryError(LookupError):
    """No query with that id (NOT_FOUND at the edge)."""


class QueryViews:
    def __init__(
        self,
        cluster: Cluster,
        scheduler: GlobalScheduler,
        store: WorkflowStore,
        queries: Queries,
        calls: Calls,
        slots: Slots,
        tally: Tally,
        clock: Clock,
    ) -> None:
        self.cluster = cluster
        self.scheduler = scheduler
        self.store = store
        self.queries = queries
        self.calls = calls
        self.slots = slots
        self.tally = tally
        self.clock = clock

    async def get_info(self, query_id: str) -> QueryInfo:
        entry = self.queries.active.get(query_id)
        if entry is not None:
            return self.info_of_run(entry.run)
        stored = await self.store.load(query_id)
        if stored is None:
            raise UnknownQueryError(query_id)
        return self.info_of_stored(stored)

    async def get(self, query_id: str) -> QueryDetail:
        """The query's info, its event log and its stages."""
        info = await self.get_info(query_id)
        entry = self.queries.active.get(query_id)
        stored = await self.store.load(query_id)
        if entry is not None:
            events = await self.logged_events(query_id, entry.event_base)
            events += entry.events
        else:
            events = await self.logged_events(query_id)
        return QueryDetail(query=info, events=tuple(events), stages=self._stages(stored))

    async def logged_events(self, query_id: str, first: int | None = None) -> list[QueryEvent]:
        """The query's event log as Redis has it (its `first` events; None: all)."""
        raw = await self.store.events(query_id)
        return [event_from_bytes(r) for r in raw[:first]]

    def _stages(self, stored: StoredQuery | None) -> tuple[StageInfo, ...]:
        """Each stage from Redis, overlaid with what memory knows ahead of the writes still
        behind (a running query's releases, finishes and deadlines)."""
        if stored is None:
            return ()  # expired between the reads
        entry = self.queries.active.get(stored.query_id)
        built = stored_workflow(stored)
        workflow = entry.run.query.workflow if entry is not None else built.query.workflow
        names = entry.session.names if entry is not None and entry.session else built.names
        skipped_ids = (
            entry.session.skipped if entry is not None and entry.session else stored.skipped()
        )
        deadlines: dict[int, float] = {}
        now = self.clock.now()
        if entry is not None:
            for ticket in self.calls.tickets.values():
                if ticket.query_id == stored.query_id:
                    deadlines[ticket.stage] = ticket.deadline_s
            run = entry.run
            for k in range(len(workflow.stages)):
                if run.stage_released_s[k] is None and k not in deadlines:
                    deadlines[k] = self.scheduler.budget.revise(run, k, now)  # if released now
        stages = []
        for k, stage in enumerate(workflow.stages):
            released = stored.stage(k, schema.STAGE_REL)
            finished = stored.stage(k, schema.STAGE_FIN)
            left = int(stored.stage(k, schema.STAGE_LEFT) or len(stage.calls))
            skipped = sum(
                1 for i in range(len(stage.calls)) if f"{stored.query_id}/{k}.{i}" in skipped_ids
            )
            given = built.given[k] if built.given is not None and k < len(built.given) else None
            released_s = float(released) if released is not None else 0.0
            finished_s = float(finished) if finished is not None else 0.0
            calls_done = len(stage.calls) - left
            calls_given = len(stage.calls) if given is None else given
            if entry is not None:  # memory is ahead of Redis
                run = entry.run
                released_s = run.stage_released_s[k] or 0.0
                finished_s = run.stage_finished_s[k] or 0.0
                calls_done = len(stage.calls) - run.stage_calls_left[k]
                if run.given is not None:
                    calls_given = run.given[k]
            info = StageInfo(
                index=k,
                step=stage.step,
                name=names[k] if k < len(names) else stage.step,
                after=tuple(stage.after),
                calls_total=len(stage.calls),
                calls_done=calls_done,
                calls_skipped=skipped,
                calls_given=calls_given,
                released_s=released_s,
                finished_s=finished_s,
                deadline_s=deadlines.get(k, float(stored.stage(k, schema.STAGE_DL) or 0.0)),
            )
            stages.append(info)
        return tuple(stages)

    def info_of_run(self, run: QueryRun) -> QueryInfo:
        q = run.query
        stages_done = sum(1 for f in run.stage_finished_s if f is not None)
        entry = self.queries.active.get(q.query_id)
        session = entry.session if entry is not None and entry.run is run else None
        hold = 1 if session is not None and session.open else 0  # the open session's own
        return QueryInfo(
            query_id=q.query_id,
            tenant=q.tenant,
            state=QueryState.SUCCEEDED if run.finished_s is not None else QueryState.RUNNING,
            arrival_s=run.arrival_s,
            slo_s=run.slo_s,
            deadline_s=run.deadline_s,
            finished_s=run.finished_s or 0.0,
            stages_total=len(q.workflow.stages),
            stages_done=stages_done,
            calls_total=q.workflow.num_calls,
            calls_done=q.workflow.num_calls - (run.calls_left - hold),
            best_effort=is_best_effort(run),
            session=session is not None,
            session_open=bool(hold),
            traceparent=entry.trace if entry is not None and entry.run is run else "",
        )

    def info_of_stored(self, stored: StoredQuery) -> QueryInfo:
        f = stored.fields
        # A session counts one call more in Redis: its own, done when it is closed.
        session = int(F.SESSION in f)
        hold = f.get(F.SESSION) == S.OPEN
        return QueryInfo(
            query_id=stored.query_id,
            tenant=f[F.TENANT],
            state=_STATES.get(f[F.STATE], QueryState.UNSPECIFIED),
            arrival_s=float(f[F.ARRIVAL_S]),
            slo_s=float(f[F.SLO_S]),
            deadline_s=float(f[F.DEADLINE_S]),
            finished_s=float(f[F.FINISHED_S]),
            stages_total=int(f[F.STAGES_TOTAL]),
            stages_done=int(f[F.STAGES_DONE]),
            calls_total=int(f[F.CALLS_TOTAL]) - session,
            calls_done=int(f[F.CALLS_TOTAL]) - int(f[F.CALLS_LEFT]) - (session and not hold),
            failure_reason=f.get(F.REASON, ""),
            session=bool(session),
            session_open=bool(hold),
            traceparent=f.get(F.TRACE, ""),
        )

    def _recent(self) -> RecentOutcomes:
        since = time.monotonic() - RECENT_WINDOW_S
        ended = list(takewhile(lambda r: r[0] >= since, reversed(self.tally.recent)))
        succeeded = [r for r in ended if r[1] == "succeeded"]
        return RecentOutcomes(
            window_s=RECENT_WINDOW_S,
            succeeded=len(succeeded),
            slo_met=sum(1 for r in succeeded if r[3]),
            failed=sum(1 for r in ended if r[1] == "failed"),
            cancelled=sum(1 for r in ended if r[1] == "cancelled"),
            latency_s=_summary(r[2] for r in succeeded),
        )

    def status(self) -> ClusterStatus:
        tally, clock = self.tally, self.clock
        load = self.scheduler.load
        learner = self.scheduler.learner
        learned = learner.factors() if learner is not None else None
        instances = []
        for inst in self.cluster.instances:
            link = self.slots.links[inst.index]
            factors = learned[inst.index] if learned is not None else None
            instances.append(
                InstanceStatus(
                    index=inst.index,
                    name=inst.name,
                    gpu=inst.gpu,
                    model=inst.model,
                    worker_id=link.worker_id if link else "",
                    connected=link is not None,
                    engine=link.engine if link else "",
                    in_flight=load.in_flight[inst.index],
                    running=link.running if link else 0,
                    queued=link.queued if link else 0,
                    kv_used_tokens=link.kv_used if link else 0,
                    kv_capacity_tokens=inst.kv_cache_tokens,
                    outstanding_s=load.outstanding_s[inst.index],
                    others_in_flight=load.others_in_flight[inst.index],
                    others_weight=load.others_weight[inst.index],
                    learned_prefill_factor=factors.prefill if factors else 0.0,
                    learned_decode_factor=factors.decode if factors else 0.0,
                    learned_calls=factors.calls if factors else 0,
                )
            )
        return ClusterStatus(
            instances=tuple(instances),
            policy=self.scheduler.preset.name,
            alpha=self.scheduler.alpha or 0.0,
            time_scale=clock.time_scale,
            now_s=clock.now(),
            queries_running=len(self.queries.active),
            queries_finished=tally.queries_finished,
            queries_failed=tally.queries_failed,
            queries_rejected=tally.queries_rejected,
            retention_s=self.store.retention_ms / 1000,
            recent=self._recent(),
            slo_base_s=self.scheduler.slo_base_s,
            cluster=self.cluster.description,
            overhead=Overhead(
                completion_to_dispatch_ms=_summary(tally.completion_ms),
                submit_to_dispatch_ms=_summary(tally.submit_ms),
                completions=tally.completions,
            ),
        )


RECENT_WINDOW_S = 300.0
"""Wall seconds of ended queries that ClusterStatus.recent sums."""


def _summary(samples: Iterable[float]) -> LatencySummary:
    values = list(samples)
    if not values:
        return LatencySummary()
    return LatencySummary(
        count=len(values), p50=percentile(values, 50), p99=percentile(values, 99), max=max(values)
    )
