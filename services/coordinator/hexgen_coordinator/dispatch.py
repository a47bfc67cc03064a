"""The dispatch path: the core's actions reach the workers' streams.

The core (`hexgen_flow.protocol.Scheduler`) decides: which instance takes a call, a stage's
budget, which waiting call gets a new deadline or moves. `Dispatch.carry_out` carries out
what it returned for one event: it names released calls, hands them to the worker links,
opens their spans, logs their events and tells workers of new deadlines and moves. It
decides nothing itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

from opentelemetry import trace

from hexgen_coordinator.client_messages import EventKind
from hexgen_coordinator.events import record_event
from hexgen_coordinator.ledger import ActiveQuery, Calls, Clock, Queries, Slots, Tally, call_id_of
from hexgen_coordinator.worker_messages import CancelRun, Finished, NewDeadline, Run
from hexgen_coordinator.write_behind import WriteBehind
from hexgen_flow.cluster import Cluster
from hexgen_flow.protocol import (
    Action,
    CallMoved,
    DeadlineChanged,
    Park,
    Redispatch,
    Scheduler,
    StageReleased,
)
from hexgen_flow.protocol import Dispatch as DispatchCall
from hexgen_flow.runtime import CallTicket
from hexgen_service import genai
from hexgen_service.telemetry import traceparent_of

__all__ = ["Dispatch"]

log = logging.getLogger("hexgen_coordinator.coordinator")  # the coordinator's one logger


class Dispatch:
    def __init__(
        self,
        cluster: Cluster,
        core: Scheduler,
        tracer: trace.Tracer,
        queries: Queries,
        calls: Calls,
        slots: Slots,
        tally: Tally,
        clock: Clock,
        writes: WriteBehind,
    ) -> None:
        self.cluster = cluster
        self.core = core
        self.tracer = tracer
        self.queries = queries
        self.calls = calls
        self.slots = slots
        self.tally = tally
        self.clock = clock
        self.writes = writes

    def carry_out(self, actions: Sequence[Action], now: float, *, reason: str = "") -> list[Action]:
        """Carry out the core's actions of one event, in order: a released stage's calls
        are named, registered and sent (parked and held ones wait), a waiting call's worker
        hears of its new deadline, a moved call is cancelled where it waited and sent where
        it goes, a dispatched call is sent (logged as redispatched, with `reason`, when
        one is given), a parked one is logged; each query touched is persisted. Returns
        the actions that are the caller's own (`Admitted`, `Lost`, `Cancel`, `Finish`),
        in order."""
        rest: list[Action] = []
        touched: dict[str, list[CallTicket]] = {}
        active = self.queries.active
        for action in actions:
            if isinstance(action, StageReleased):
                entry = active.get(action.run.query.query_id)
                if entry is None:
                    continue
                tickets = list(action.tickets)
                self.register_released(entry, action.stage, tickets, now)
                self.send(tickets)
                self.note_first_dispatch(entry, tickets)
                touched.setdefault(entry.run.query.query_id, []).extend(tickets)
            elif isinstance(action, DeadlineChanged | CallMoved):
                entry = active.get(action.ticket.query_id)
                if entry is not None:
                    self._revised(entry, action, now)
                    touched.setdefault(action.ticket.query_id, []).append(action.ticket)
            elif isinstance(action, DispatchCall):
                ticket = action.ticket
                entry = active.get(ticket.query_id)
                if entry is None:
                    continue
                if reason:
                    self._redispatched(entry, ticket, now, reason)
                self.send([ticket])
                self.note_first_dispatch(entry, [ticket])
                touched.setdefault(ticket.query_id, []).append(ticket)
            elif isinstance(action, Park):
                log.warning("no instance can take %s now; parked", action.ticket.call_id)
                touched.setdefault(action.ticket.query_id, []).append(action.ticket)
            else:
                rest.append(action)
        for query_id, tickets in touched.items():
            entry = active.get(query_id)
            if entry is not None:
                self.writes.persist(entry, tickets)
        return rest

    def register_released(
        self, entry: ActiveQuery, stage: int, tickets: list[CallTicket], now: float
    ) -> None:
        query_id, calls = entry.run.query.query_id, self.calls
        record_event(entry, EventKind.STAGE_RELEASED, now, stage=stage)
        for ticket in tickets:
            ticket.call_id = call_id_of(query_id, stage, ticket.index)
            calls.add(ticket)
        if stage not in entry.stage_spans and tickets:
            names = entry.session.names if entry.session is not None else ()
            entry.stage_spans[stage] = self.tracer.start_span(
                "stage",
                context=trace.set_span_in_context(entry.span),
                attributes={
                    "hexgen.workflow.id": query_id,
                    "hexgen.stage.index": stage,
                    "hexgen.stage.name": names[stage] if stage < len(names) else "",
                    "hexgen.stage.step": tickets[0].call.step,
                    "hexgen.stage.calls": len(tickets),
                    "hexgen.stage.released_s": now,
                    "hexgen.stage.deadline_s": tickets[0].deadline_s,
                },
            )

    @staticmethod
    def end_stage_span(entry: ActiveQuery, stage: int, now: float) -> None:
        """The stage finished (or its query ended): its span ends."""
        span = entry.stage_spans.pop(stage, None)
        if span is not None:
            span.set_attribute("hexgen.stage.finished_s", now)
            span.end()

    @staticmethod
    def end_call_span(span: trace.Span, finished: Finished, model: str) -> None:
        """A call finished: its span ends with the GenAI response attributes, the usage the
        engine reported (the declared prompt size stays where the engine does not count)."""
        span.set_attributes(
            genai.response_attributes(
                model=model,
                finish_reason=finished.finish_reason,
                input_tokens=finished.prompt_tokens,
                output_tokens=finished.output_tokens,
            )
        )
        span.end()

    def send(self, tickets: Iterable[CallTicket]) -> None:
        """Hand dispatched tickets to their workers' streams (parked ones wait)."""
        links, active, clock = self.slots.links, self.queries.active, self.clock
        for ticket in tickets:
            if ticket.instance < 0:
                continue
            link = links[ticket.instance]
            if link is None:  # the slot went away between dispatch and send
                now = clock.now()
                self.carry_out(
                    self.core.handle(Redispatch(ticket, now)), now, reason="instance went away"
                )
                continue
            entry = active[ticket.query_id]
            self.tally.metrics.dispatched_on[ticket.instance].inc()
            ticket.attempt += 1  # a completion is taken only from the latest attempt
            instance = self.cluster.instances[ticket.instance]
            chat = entry.chats.get(ticket.call_id)
            options = chat.options if chat is not None else None
            # OpenTelemetry's GenAI semantic conventions (`hexgen_service.genai`): the
            # inference span, a call to a model, named "{operation} {model}".
            operation = genai.operation_of(chat is not None and bool(chat.messages))
            sampling, json_output = genai.proto_sampling(options)
            attributes = genai.request_attributes(
                operation=operation,
                provider=genai.PROVIDER,
                model=instance.model,
                max_tokens=ticket.output_tokens,  # declared: what the engine is asked
                sampling=sampling,
                json_output=json_output,
                conversation_id=ticket.query_id,
            )
            attributes.update(
                {
                    "call.id": ticket.call_id,
                    "call.step": ticket.call.step,
                    "call.instance": instance.name,
                    "call.attempt": ticket.attempt,
                    "hexgen.workflow.id": ticket.query_id,
                    "hexgen.stage.index": ticket.stage,
                    "hexgen.deadline_s": ticket.deadline_s,
                    # the declared size; the engine's count replaces it when the call ends
                    "gen_ai.usage.input_tokens": ticket.call.input_tokens,
                }
            )
            span = self.tracer.start_span(
                genai.span_name(operation, instance.model),
                context=trace.set_span_in_context(entry.stage_spans.get(ticket.stage, entry.span)),
                kind=trace.SpanKind.CLIENT,
                attributes=attributes,
            )
            self.calls.open_span(ticket.call_id, span)
            prompts = entry.prompts[ticket.stage]
            index = ticket.index
            link.send(
                Run.of(
                    ticket,
                    prompts[index] if index < len(prompts) else "",
                    traceparent_of(span),
                    chat.messages if chat is not None else (),
                    options,
                )
            )
            record_event(
                entry,
                EventKind.CALL_DISPATCHED,
                clock.now(),
                stage=ticket.stage,
                call_id=ticket.call_id,
                instance=self.cluster.instances[ticket.instance].name,
            )

    def note_first_dispatch(self, entry: ActiveQuery, sent: Iterable[CallTicket]) -> None:
        if entry.first_dispatch_pending is not None and any(t.instance >= 0 for t in sent):
            elapsed = time.perf_counter() - entry.first_dispatch_pending
            self.tally.first_dispatch(elapsed)
            entry.first_dispatch_pending = None

    # ------------------------------------------------------------------ re-budgeting

    @staticmethod
    def _redispatched(entry: ActiveQuery, ticket: CallTicket, now: float, why: str) -> None:
        record_event(
            entry,
            EventKind.CALL_REDISPATCHED,
            now,
            stage=ticket.stage,
            call_id=ticket.call_id,
            text=why,
        )

    def _revised(self, entry: ActiveQuery, action: DeadlineChanged | CallMoved, now: float) -> None:
        """A stage of `entry` finished and the core revised a waiting call
        (`GlobalScheduler.revise_waiting`, the simulator's very rule): its worker hears of
        the new deadline (UpdateDeadline), or a moved call is cancelled where it waited and
        sent where it goes (the core moves a call only between connected instances)."""
        ticket = action.ticket
        links = self.slots.links
        record_event(
            entry,
            EventKind.DEADLINE_UPDATED,
            now,
            stage=ticket.stage,
            call_id=ticket.call_id,
            text=f"{ticket.deadline_s:.3f}",
        )
        if isinstance(action, CallMoved):
            source = links[action.source]
            if source is not None:
                source.send(CancelRun(ticket.call_id))
            self._redispatched(
                entry,
                ticket,
                now,
                f"moved from {self.cluster.instances[action.source].name}: its new deadline "
                f"can be met on {self.cluster.instances[action.target].name} and not there",
            )
            self.send([ticket])
            return
        link = links[ticket.instance] if ticket.instance >= 0 else None
        if link is None:
            return  # waiting for its prompt or for an instance: nothing to tell
        link.send(NewDeadline(ticket.call_id, action.deadline_s))
