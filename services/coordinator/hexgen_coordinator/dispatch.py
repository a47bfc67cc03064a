"""The dispatch path: released stages become tickets, tickets go to their workers' streams.

The core's `GlobalScheduler` decides (stage budgets, which instance takes a call); this
module names the calls, hands them to the worker links, opens their spans, logs their
events, and sends again what a lost worker held or what waited parked for an instance.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from opentelemetry import trace

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_api.v1 import worker_pb2 as wpb
from hexgen_coordinator.events import record_event
from hexgen_coordinator.ledger import ActiveQuery, Ledger, call_id_of
from hexgen_coordinator.write_behind import WriteBehind
from hexgen_flow.cluster import Cluster
from hexgen_flow.policies.base import NoInstanceError
from hexgen_flow.runtime import CallTicket
from hexgen_flow.scheduler import CallMoved, GlobalScheduler
from hexgen_service import genai
from hexgen_service.convert import ticket_to_dispatch
from hexgen_service.telemetry import traceparent_of

__all__ = ["Dispatch"]

log = logging.getLogger("hexgen_coordinator.coordinator")  # the coordinator's one logger

K = cpb.QueryEventKind


class Dispatch:
    def __init__(
        self,
        cluster: Cluster,
        scheduler: GlobalScheduler,
        tracer: trace.Tracer,
        ledger: Ledger,
        writes: WriteBehind,
    ) -> None:
        self.cluster = cluster
        self.scheduler = scheduler
        self.tracer = tracer
        self.ledger = ledger
        self.writes = writes

    def release_stage(self, entry: ActiveQuery, stage: int, now: float) -> list[CallTicket]:
        tickets = self.scheduler.release(entry.run, stage, now)
        self.register_released(entry, stage, tickets, now)
        return tickets

    def register_released(
        self, entry: ActiveQuery, stage: int, tickets: list[CallTicket], now: float
    ) -> None:
        query_id = entry.run.query.query_id
        record_event(entry, K.QUERY_EVENT_KIND_STAGE_RELEASED, now, stage=stage)
        for ticket in tickets:
            ticket.call_id = call_id_of(query_id, stage, ticket.index)
            self.ledger.tickets[ticket.call_id] = ticket
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
    def end_call_span(span: trace.Span, finished: wpb.CallFinished, model: str) -> None:
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
        ledger = self.ledger
        for ticket in tickets:
            if ticket.instance < 0:
                continue
            link = ledger.links[ticket.instance]
            if link is None:  # the slot went away between dispatch and send
                self.redispatch(ticket, "instance went away")
                continue
            entry = ledger.active[ticket.query_id]
            ledger.metrics.dispatched_on[ticket.instance].inc()
            ticket.attempt += 1  # a completion is taken only from the latest attempt
            instance = self.cluster.instances[ticket.instance]
            chat = entry.chats.get(ticket.call_id)
            options = chat.options if chat is not None and chat.HasField("options") else None
            # OpenTelemetry's GenAI semantic conventions (`hexgen_service.genai`): the
            # inference span, a call to a model, named "{operation} {model}".
            operation = genai.operation_of(chat is not None and bool(chat.messages))
            sampling, json_output = genai.proto_sampling(options)
            attributes = genai.request_attributes(
                operation=operation,
                provider=genai.PROVIDER,
                model=instance.model,
                max_tokens=ticket.call.output_tokens,
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
            old = ledger.call_spans.pop(ticket.call_id, None)
            if old is not None:
                old.end()
            ledger.call_spans[ticket.call_id] = span
            prompts = entry.prompts[ticket.stage]
            index = ticket.index
            link.send(
                wpb.ConnectResponse(
                    dispatch=ticket_to_dispatch(
                        ticket,
                        prompts[index] if index < len(prompts) else "",
                        traceparent_of(span),
                        chat.messages if chat is not None else (),
                        options,
                    )
                )
            )
            record_event(
                entry,
                K.QUERY_EVENT_KIND_CALL_DISPATCHED,
                ledger.clock.now(),
                stage=ticket.stage,
                call_id=ticket.call_id,
                instance=self.cluster.instances[ticket.instance].name,
            )

    def note_first_dispatch(self, entry: ActiveQuery, sent: Iterable[CallTicket]) -> None:
        if entry.first_dispatch_pending is not None and any(t.instance >= 0 for t in sent):
            elapsed = time.perf_counter() - entry.first_dispatch_pending
            self.ledger.submit_ms.append(elapsed * 1e3)
            self.ledger.metrics.submit_to_dispatch.observe(elapsed)
            entry.first_dispatch_pending = None

    def redispatch(self, ticket: CallTicket, reason: str, avoid: int = -1) -> None:
        """Send a call again, to another instance than `avoid` where another can take it."""
        self.ledger.started.discard(ticket.call_id)
        self.scheduler.withdraw(ticket)
        try:
            self._dispatch_avoiding(ticket, avoid)
        except NoInstanceError:
            log.warning("no instance can take %s now; parked", ticket.call_id)
            return
        entry = self.ledger.active.get(ticket.query_id)
        if entry is not None:
            record_event(
                entry,
                K.QUERY_EVENT_KIND_CALL_REDISPATCHED,
                self.ledger.clock.now(),
                stage=ticket.stage,
                call_id=ticket.call_id,
                text=reason,
            )
        self.send([ticket])

    def _dispatch_avoiding(self, ticket: CallTicket, avoid: int) -> None:
        load, now = self.scheduler.load, self.ledger.clock.now()
        if avoid >= 0 and load.available[avoid]:
            load.set_available(avoid, False)
            try:
                self.scheduler.dispatch(ticket, now)
                return
            except NoInstanceError:
                pass  # the only instance that can take it: it gets the call again
            finally:
                load.set_available(avoid, True)
        self.scheduler.dispatch(ticket, now)

    def dispatch_parked(self, now: float) -> None:
        """Dispatch the calls that wait for an instance, in release order; those a worker
        may still reclaim after a restart stay parked."""
        ledger = self.ledger
        parked = sorted(
            (
                t
                for t in ledger.tickets.values()
                if t.instance < 0
                and t.call_id not in ledger.adoptable
                and (t.run is None or t.run.is_given(t.stage, t.index))
            ),
            key=lambda t: t.seq,
        )
        sent = []
        for ticket in parked:
            try:
                self.scheduler.dispatch(ticket, now)
            except NoInstanceError:
                continue
            sent.append(ticket)
        self.send(sent)
        for entry_id in {t.query_id for t in sent}:
            entry = ledger.active.get(entry_id)
            if entry is not None:
                self.note_first_dispatch(entry, sent)
                self.writes.persist(entry, [t for t in sent if t.query_id == entry_id])

    # ------------------------------------------------------------------ re-budgeting

    def rebudget(self, entry: ActiveQuery, now: float) -> None:
        """A stage of `entry` finished: its calls still waiting (released, not started) are
        revised by the core (`GlobalScheduler.revise_waiting`, the simulator's very rule):
        their workers hear of a new deadline (UpdateDeadline), and a call the core moves is
        cancelled where it waited and sent where it goes (both ends connected)."""
        ledger, run = self.ledger, entry.run
        query_id = run.query.query_id
        waiting: list[CallTicket] = []
        for k, stage in enumerate(run.query.workflow.stages):
            if run.stage_released_s[k] is None or run.stage_finished_s[k] is not None:
                continue
            for index in range(len(stage.calls)):
                ticket = ledger.tickets.get(call_id_of(query_id, k, index))
                # A call released now has its deadline from now already (and is not sent
                # yet: the caller sends it).
                if (
                    ticket is not None
                    and ticket.call_id not in ledger.started
                    and ticket.released_s < now
                ):
                    waiting.append(ticket)
        links = ledger.links
        actions = self.scheduler.revise_waiting(
            waiting, now, movable=lambda i: links[i] is not None
        )
        for action in actions:
            ticket = action.ticket
            record_event(
                entry,
                K.QUERY_EVENT_KIND_DEADLINE_UPDATED,
                now,
                stage=ticket.stage,
                call_id=ticket.call_id,
                text=f"{ticket.deadline_s:.3f}",
            )
            if isinstance(action, CallMoved):
                source = links[action.source]
                assert source is not None  # `movable` held for both ends
                source.send(wpb.ConnectResponse(cancel=wpb.CancelCall(call_id=ticket.call_id)))
                record_event(
                    entry,
                    K.QUERY_EVENT_KIND_CALL_REDISPATCHED,
                    now,
                    stage=ticket.stage,
                    call_id=ticket.call_id,
                    text=f"moved from {self.cluster.instances[action.source].name}: its new "
                    f"deadline can be met on {self.cluster.instances[action.target].name} "
                    "and not there",
                )
                self.send([ticket])
                continue
            link = links[ticket.instance] if ticket.instance >= 0 else None
            if link is None:
                continue  # waiting for its prompt or for an instance: nothing to tell
            link.send(
                wpb.ConnectResponse(
                    deadline=wpb.UpdateDeadline(
                        call_id=ticket.call_id, deadline_s=action.deadline_s
                    )
                )
            )
        changed = [action.ticket for action in actions]
        if changed:
            self.writes.persist(entry, changed)
