"""What workers report about their calls (started, tokens, finished), and cancellation.

A completion is applied in Redis first (`WorkflowStore.complete`, exactly once per call),
then in memory, under the query's lock (`hexgen_coordinator.ledger` says why).
"""

from __future__ import annotations

import logging
import time

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_api.v1 import worker_pb2 as wpb
from hexgen_coordinator.dispatch import Dispatch
from hexgen_coordinator.events import record_event
from hexgen_coordinator.ledger import ActiveQuery, Ledger, parse_call_id
from hexgen_coordinator.links import WorkerLink
from hexgen_coordinator.store import WorkflowStore
from hexgen_coordinator.views import QueryViews
from hexgen_coordinator.write_behind import WriteBehind
from hexgen_flow.cluster import Cluster
from hexgen_flow.runtime import CallTicket
from hexgen_flow.scheduler import GlobalScheduler

__all__ = ["Completions"]

log = logging.getLogger("hexgen_coordinator.coordinator")  # the coordinator's one logger

K = cpb.QueryEventKind


class Completions:
    def __init__(
        self,
        cluster: Cluster,
        scheduler: GlobalScheduler,
        store: WorkflowStore,
        ledger: Ledger,
        dispatch: Dispatch,
        writes: WriteBehind,
        views: QueryViews,
    ) -> None:
        self.cluster = cluster
        self.scheduler = scheduler
        self.store = store
        self.ledger = ledger
        self.dispatch = dispatch
        self.writes = writes
        self.views = views

    def on_started(self, link: WorkerLink, msg: wpb.CallStarted) -> None:
        ledger = self.ledger
        ticket = ledger.tickets.get(msg.call_id)
        entry = ledger.active.get(ticket.query_id) if ticket else None
        if ticket is None or entry is None:
            return
        record_event(
            entry,
            K.QUERY_EVENT_KIND_CALL_STARTED,
            ledger.clock.now(),
            stage=ticket.stage,
            call_id=msg.call_id,
            instance=self.cluster.instances[link.slot].name,
        )
        self.writes.persist(entry, [])  # a crash keeps the start in the log

    def on_tokens(self, link: WorkerLink, msg: wpb.CallTokens) -> None:
        ledger = self.ledger
        ticket = ledger.tickets.get(msg.call_id)
        entry = ledger.active.get(ticket.query_id) if ticket else None
        if ticket is None or entry is None or not entry.watchers:
            return
        record_event(
            entry,
            K.QUERY_EVENT_KIND_CALL_TOKENS,
            ledger.clock.now(),
            stage=ticket.stage,
            call_id=msg.call_id,
            text=msg.text,
        )

    async def on_finished(self, link: WorkerLink, msg: wpb.CallFinished) -> None:
        t0 = time.perf_counter()
        ledger = self.ledger
        call_id = msg.call_id
        try:
            query_id, stage, _ = parse_call_id(call_id)
        except ValueError:
            log.warning("worker %s reported a malformed call id %r", link.worker_id, call_id)
            link.ack(call_id)
            return
        entry = ledger.active.get(query_id)
        if entry is None:  # finished, cancelled or unknown: nothing to apply
            link.ack(call_id)
            return
        async with entry.lock:
            ticket = ledger.tickets.get(call_id)
            if ticket is None:  # already applied (a resend)
                link.ack(call_id)
                return
            if msg.error:
                log.warning("call %s failed on %s: %s", call_id, link.worker_id, msg.error)
                link.ack(call_id)
                self.dispatch.redispatch(ticket, f"engine error: {msg.error}")
                self.writes.persist(entry, [ticket])
                return
            now = ledger.clock.now()
            run = entry.run
            ledger.adoptable.pop(call_id, None)  # resent after a restart: nothing to reclaim
            # A ticket resumed after a restart sits on no instance until reclaimed; the
            # worker that reports the result is the one that ran it.
            ran_on = ticket.instance if ticket.instance >= 0 else link.slot
            inst = self.cluster.instances[ran_on] if ran_on >= 0 else None
            record: dict[str, str | int | float] = {
                "query_id": query_id,
                "call_id": call_id,
                "stage": stage,
                "step": ticket.call.step,
                "input_tokens": ticket.call.input_tokens,
                "output_tokens": msg.output_tokens or ticket.call.output_tokens,
                "instance": inst.name if inst else "",
                "gpu": inst.gpu if inst else "",
                "released_s": repr(ticket.released_s),
                "started_s": repr(msg.started_s),
                "finished_s": repr(msg.finished_s or now),
            }
            result = await self.store.complete(
                query_id, call_id, stage, run.query.workflow.dependents[stage], now, record
            )
            link.ack(call_id)
            if not result.applied:
                return
            del ledger.tickets[call_id]
            ledger.completions += 1
            released = self.scheduler.complete(ticket, now)
            stages_released = sorted({t.stage for t in released})
            if tuple(stages_released) != tuple(sorted(result.released)):
                log.error(
                    "release mismatch for %s: redis %s, memory %s",
                    query_id,
                    result.released,
                    stages_released,
                )
            by_stage: dict[int, list[CallTicket]] = {}
            for t in released:
                by_stage.setdefault(t.stage, []).append(t)
            record_event(
                entry,
                K.QUERY_EVENT_KIND_CALL_FINISHED,
                now,
                stage=stage,
                call_id=call_id,
                instance=inst.name if inst else "",
                text=msg.text,
            )
            span = ledger.call_spans.pop(call_id, None)
            if span is not None:
                span.end()
            if run.stage_finished_s[stage] is not None:
                record_event(entry, K.QUERY_EVENT_KIND_STAGE_FINISHED, now, stage=stage)
            for k, tickets in by_stage.items():
                self.dispatch.register_released(entry, k, tickets, now)
            self.dispatch.send(released)
            if released:
                ledger.completion_ms.append((time.perf_counter() - t0) * 1e3)
            if run.finished_s is not None:
                record_event(entry, K.QUERY_EVENT_KIND_SUCCEEDED, now)
            self.writes.persist(entry, released)
            if run.finished_s is not None:
                self.finish(entry)

    def finish(self, entry: ActiveQuery) -> None:
        query_id = entry.run.query.query_id
        entry.span.end()
        for watcher in entry.watchers:
            watcher.put_nowait(None)
        self.ledger.active.pop(query_id, None)
        if entry.run.finished_s is not None:  # succeeded (the `finished` stream counts these)
            self.ledger.queries_finished += 1

    async def cancel(self, query_id: str) -> cpb.QueryInfo:
        ledger = self.ledger
        entry = ledger.active.get(query_id)
        if entry is None:
            return await self.views.get_info(query_id)  # raises UnknownQueryError if none
        async with entry.lock:
            now = ledger.clock.now()
            await self.store.cancel(query_id, now)
            for ticket in [t for t in ledger.tickets.values() if t.query_id == query_id]:
                if ticket.instance >= 0:
                    link = ledger.links[ticket.instance]
                    if link is not None:
                        link.send(
                            wpb.ConnectResponse(cancel=wpb.CancelCall(call_id=ticket.call_id))
                        )
                self.scheduler.withdraw(ticket)
                del ledger.tickets[ticket.call_id]
                span = ledger.call_spans.pop(ticket.call_id, None)
                if span is not None:
                    span.end()
            record_event(entry, K.QUERY_EVENT_KIND_CANCELLED, now)
            self.writes.persist(entry, [])
            await self.writes.flush()
            self.finish(entry)
        return await self.views.get_info(query_id)
