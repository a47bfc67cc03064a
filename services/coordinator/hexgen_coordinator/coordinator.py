"""The coordinator: admits queries, keeps their state in Redis, dispatches their calls.

All scheduling decisions are the core's `GlobalScheduler` (the same object the simulator
drives). This class adds what a live system needs around it: persistence in Redis
(`WorkflowStore`), the worker links, events for watchers, recovery from worker failures
and from its own restart, and tracing.

Concurrency: one asyncio loop. Everything that touches one query (completion, cancel)
holds that query's lock, so Redis's view (authoritative) and the in-memory view apply
completions in the same order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from opentelemetry import trace

from hexgen_api.v1 import coordinator_pb2 as cpb
from hexgen_api.v1 import worker_pb2 as wpb
from hexgen_coordinator.config import CoordinatorConfig
from hexgen_coordinator.store import StoredQuery, WorkflowStore
from hexgen_flow.cluster import parse_cluster
from hexgen_flow.metrics import percentile
from hexgen_flow.policies.base import NoInstanceError
from hexgen_flow.policies.presets import resolve_policy
from hexgen_flow.runtime import CallTicket, QueryRun
from hexgen_flow.scheduler import GlobalScheduler
from hexgen_flow.workload import Query
from hexgen_service.clock import ClusterClock
from hexgen_service.convert import parse_submit, ticket_to_dispatch
from hexgen_service.errors import InvalidFieldError
from hexgen_service.telemetry import setup_tracing, traceparent_of

__all__ = ["Coordinator", "SlotTakenError", "UnknownQueryError", "WorkerLink"]

log = logging.getLogger(__name__)

K = cpb.QueryEventKind
_TERMINAL = (K.QUERY_EVENT_KIND_SUCCEEDED, K.QUERY_EVENT_KIND_CANCELLED)
_STATES = {
    "running": cpb.QUERY_STATE_RUNNING,
    "succeeded": cpb.QUERY_STATE_SUCCEEDED,
    "cancelled": cpb.QUERY_STATE_CANCELLED,
}


class UnknownQueryError(LookupError):
    """No query with that id (NOT_FOUND at the edge)."""


class SlotTakenError(RuntimeError):
    """A worker asked for a slot another live worker holds (FAILED_PRECONDITION)."""


def call_id_of(query_id: str, stage: int, index: int) -> str:
    return f"{query_id}/{stage}.{index}"


def parse_call_id(call_id: str) -> tuple[str, int, int]:
    query_id, _, rest = call_id.rpartition("/")
    stage, _, index = rest.partition(".")
    return query_id, int(stage), int(index)


@dataclass(eq=False)
class WorkerLink:
    """One connected worker: the coordinator's end of its stream."""

    worker_id: str
    engine: str
    outbox: asyncio.Queue[wpb.ConnectResponse | None] = field(default_factory=asyncio.Queue)
    slot: int = -1
    last_seen: float = field(default_factory=time.monotonic)
    running: int = 0
    queued: int = 0
    kv_used: int = 0
    closed: bool = False
    _acks: list[str] = field(default_factory=list)

    def send(self, message: wpb.ConnectResponse) -> None:
        if not self.closed:
            self.outbox.put_nowait(message)

    def ack(self, call_id: str) -> None:
        """Acknowledge a completion; the acks of one loop turn go out as one message."""
        if not self._acks:
            asyncio.get_running_loop().call_soon(self._send_acks)
        self._acks.append(call_id)

    def _send_acks(self) -> None:
        acks, self._acks = self._acks, []
        self.send(wpb.ConnectResponse(ack=wpb.AckFinished(call_ids=acks)))

    def close(self) -> None:
        """End the stream: the servicer's writer stops at the None."""
        if not self.closed:
            self.closed = True
            self.outbox.put_nowait(None)


@dataclass(eq=False)
class _Active:
    """In-memory companions of a running query."""

    run: QueryRun
    prompts: list[tuple[str, ...]]
    span: trace.Span
    events: list[cpb.QueryEvent] = field(default_factory=list)
    """Logged events since this coordinator took the query (token chunks are live only)."""
    event_base: int = 0
    """Events already in Redis when this coordinator resumed the query."""
    saved: int = 0
    """How many of `events` are in Redis."""
    watchers: set[asyncio.Queue[cpb.QueryEvent | None]] = field(default_factory=set)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    first_dispatch_pending: float | None = None


class Coordinator:
    def __init__(self, config: CoordinatorConfig, redis: aioredis.Redis[bytes]) -> None:
        self.config = config
        self.cluster = parse_cluster(config.cluster, config.model)
        preset = resolve_policy(config.policy)
        self.scheduler = GlobalScheduler(self.cluster, preset, seed=config.seed)
        self.store = WorkflowStore(redis, config.redis_prefix)
        self.redis = redis
        self.slo_base_s = self.scheduler.slo_base_s
        self.clock = ClusterClock.starting_now(config.time_scale)
        self.tracer = setup_tracing("hexgen-coordinator")
        self.active: dict[str, _Active] = {}
        self.tickets: dict[str, CallTicket] = {}
        """Calls released and not finished, by call id; instance -1 while parked."""
        self.links: list[WorkerLink | None] = [None] * len(self.cluster)
        self._adoptable: dict[str, int] = {}
        """After a restart: call id -> the slot Redis says it was dispatched to."""
        self._call_spans: dict[str, trace.Span] = {}
        self._completion_ms: deque[float] = deque(maxlen=200_000)
        self._submit_ms: deque[float] = deque(maxlen=200_000)
        self.completions = 0
        self.queries_finished = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._pending_writes: list[tuple[_Active, list[CallTicket]]] = []
        self._writer: asyncio.Future[None] | None = None
        for i in range(len(self.cluster)):
            self.scheduler.load.set_available(i, False)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        epoch, scale = await self.store.epoch(time.time(), self.config.time_scale)
        if scale != self.config.time_scale:
            log.warning(
                "cluster keeps its first time scale %s (asked: %s)", scale, self.config.time_scale
            )
        self.clock = ClusterClock(epoch, scale)
        stored_alpha = await self.store.alpha()
        alpha = self.config.alpha if self.config.alpha is not None else stored_alpha
        if alpha is not None and self.scheduler.alpha is not None:
            self.scheduler.set_alpha(alpha)
        self.queries_finished = int(await self.redis.xlen(self.store.finished_key))
        await self._resume()
        self._tasks.append(asyncio.create_task(self._watch_heartbeats()))

    async def stop(self) -> None:
        await self.flush()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for link in self.links:
            if link is not None:
                link.close()

    # ------------------------------------------------------------------ queries

    async def submit(self, request: cpb.SubmitQueryRequest) -> tuple[cpb.QueryInfo, bool]:
        """Admit a query (idempotent on its id); raises InvalidFieldError for bad input."""
        t0 = time.perf_counter()
        query, prompts = parse_submit(request)
        self._check_fits(query)
        existing = self.active.get(query.query_id)
        if existing is not None:
            return self._info_of_run(existing.run), False
        now = self.clock.now()
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
        if not created or query.query_id in self.active:
            return await self.get_info(query.query_id), False
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
        entry = _Active(run, prompts, span, first_dispatch_pending=t0)
        self.active[query.query_id] = entry
        self._event(entry, K.QUERY_EVENT_KIND_SUBMITTED, now)
        released: list[CallTicket] = []
        for k in query.workflow.roots:
            released.extend(self._release_stage(entry, k, now))
        self._send(released)
        self._note_first_dispatch(entry, released)
        self._persist(entry, released)
        return self._info_of_run(run), True

    def _check_fits(self, query: Query) -> None:
        oversized = self.scheduler.oversized_call(query)
        if oversized is not None:
            k, c, call = oversized
            raise InvalidFieldError(
                f"workflow.stages[{k}].calls[{c}]",
                f"{call.input_tokens}+{call.output_tokens} tokens fit no instance's KV cache "
                f"(largest: {max(self.scheduler.load.kv_tokens)} tokens)",
            )

    def _release_stage(self, entry: _Active, stage: int, now: float) -> list[CallTicket]:
        tickets = self.scheduler.release(entry.run, stage, now)
        self._register_released(entry, stage, tickets, now)
        return tickets

    def _register_released(
        self, entry: _Active, stage: int, tickets: list[CallTicket], now: float
    ) -> None:
        query_id = entry.run.query.query_id
        self._event(entry, K.QUERY_EVENT_KIND_STAGE_RELEASED, now, stage=stage)
        for index, ticket in enumerate(tickets):
            ticket.call_id = call_id_of(query_id, stage, index)
            self.tickets[ticket.call_id] = ticket

    def _send(self, tickets: Iterable[CallTicket]) -> None:
        """Hand dispatched tickets to their workers' streams (parked ones wait)."""
        for ticket in tickets:
            if ticket.instance < 0:
                continue
            link = self.links[ticket.instance]
            if link is None:  # the slot went away between dispatch and send
                self._redispatch(ticket, "instance went away")
                continue
            entry = self.active[ticket.query_id]
            span = self.tracer.start_span(
                "call",
                context=trace.set_span_in_context(entry.span),
                attributes={
                    "call.id": ticket.call_id,
                    "call.step": ticket.call.step,
                    "call.instance": self.cluster.instances[ticket.instance].name,
                },
            )
            old = self._call_spans.pop(ticket.call_id, None)
            if old is not None:
                old.end()
            self._call_spans[ticket.call_id] = span
            prompts = entry.prompts[ticket.stage]
            index = parse_call_id(ticket.call_id)[2]
            link.send(
                wpb.ConnectResponse(
                    dispatch=ticket_to_dispatch(
                        ticket,
                        prompts[index] if index < len(prompts) else "",
                        traceparent_of(span),
                    )
                )
            )
            self._event(
                entry,
                K.QUERY_EVENT_KIND_CALL_DISPATCHED,
                self.clock.now(),
                stage=ticket.stage,
                call_id=ticket.call_id,
                instance=self.cluster.instances[ticket.instance].name,
            )

    def _note_first_dispatch(self, entry: _Active, sent: Iterable[CallTicket]) -> None:
        if entry.first_dispatch_pending is not None and any(t.instance >= 0 for t in sent):
            self._submit_ms.append((time.perf_counter() - entry.first_dispatch_pending) * 1e3)
            entry.first_dispatch_pending = None

    def _persist(self, entry: _Active, tickets: Iterable[CallTicket]) -> None:
        """Record where calls went and the query's new events, behind the critical path.

        Writes of every query are gathered and sent in one pipeline per loop turn, after
        the calls were sent. A crash before the write loses no call: `_resume` dispatches
        what Redis does not place, and workers reclaim what they hold.
        """
        self._pending_writes.append((entry, list(tickets)))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.ensure_future(self._write_behind())
            self._writer.add_done_callback(_log_failure)

    async def _write_behind(self) -> None:
        while self._pending_writes:
            batch, self._pending_writes = self._pending_writes, []
            async with self.redis.pipeline(transaction=False) as pipe:
                for entry, tickets in batch:
                    query_id = entry.run.query.query_id
                    qkey = self.store.qkey(query_id)
                    for ticket in tickets:
                        if ticket.instance >= 0:
                            pipe.hset(
                                qkey, f"c:{ticket.call_id}", f"{ticket.instance}:{ticket.seq}"
                            )
                        pipe.hset(qkey, f"s{ticket.stage}:dl", repr(ticket.deadline_s))
                    unsaved = entry.events[entry.saved :]
                    if unsaved:
                        pipe.rpush(
                            self.store.evkey(query_id), *[e.SerializeToString() for e in unsaved]
                        )
                        entry.saved = len(entry.events)
                await pipe.execute()

    async def flush(self) -> None:
        """Wait until every write behind has reached Redis."""
        while self._writer is not None and not self._writer.done():
            await asyncio.shield(self._writer)

    # ------------------------------------------------------------------ completions

    async def on_finished(self, link: WorkerLink, msg: wpb.CallFinished) -> None:
        t0 = time.perf_counter()
        call_id = msg.call_id
        try:
            query_id, stage, _ = parse_call_id(call_id)
        except ValueError:
            log.warning("worker %s reported a malformed call id %r", link.worker_id, call_id)
            link.ack(call_id)
            return
        entry = self.active.get(query_id)
        if entry is None:  # finished, cancelled or unknown: nothing to apply
            link.ack(call_id)
            return
        async with entry.lock:
            ticket = self.tickets.get(call_id)
            if ticket is None:  # already applied (a resend)
                link.ack(call_id)
                return
            if msg.error:
                log.warning("call %s failed on %s: %s", call_id, link.worker_id, msg.error)
                link.ack(call_id)
                self._redispatch(ticket, f"engine error: {msg.error}")
                self._persist(entry, [ticket])
                return
            now = self.clock.now()
            run = entry.run
            self._adoptable.pop(call_id, None)  # resent after a restart: nothing to reclaim
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
            del self.tickets[call_id]
            self.completions += 1
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
            self._event(
                entry,
                K.QUERY_EVENT_KIND_CALL_FINISHED,
                now,
                stage=stage,
                call_id=call_id,
                instance=inst.name if inst else "",
                text=msg.text,
            )
            span = self._call_spans.pop(call_id, None)
            if span is not None:
                span.end()
            if run.stage_finished_s[stage] is not None:
                self._event(entry, K.QUERY_EVENT_KIND_STAGE_FINISHED, now, stage=stage)
            for k, tickets in by_stage.items():
                self._register_released(entry, k, tickets, now)
            self._send(released)
            if released:
                self._completion_ms.append((time.perf_counter() - t0) * 1e3)
            if run.finished_s is not None:
                self._event(entry, K.QUERY_EVENT_KIND_SUCCEEDED, now)
            self._persist(entry, released)
            if run.finished_s is not None:
                self._finish(entry)

    def _finish(self, entry: _Active) -> None:
        query_id = entry.run.query.query_id
        entry.span.end()
        for watcher in entry.watchers:
            watcher.put_nowait(None)
        self.active.pop(query_id, None)
        if entry.run.finished_s is not None:  # succeeded (the `finished` stream counts these)
            self.queries_finished += 1

    async def cancel(self, query_id: str) -> cpb.QueryInfo:
        entry = self.active.get(query_id)
        if entry is None:
            return await self.get_info(query_id)  # raises UnknownQueryError if none
        async with entry.lock:
            now = self.clock.now()
            await self.store.cancel(query_id, now)
            for ticket in [t for t in self.tickets.values() if t.query_id == query_id]:
                if ticket.instance >= 0:
                    link = self.links[ticket.instance]
                    if link is not None:
                        link.send(
                            wpb.ConnectResponse(cancel=wpb.CancelCall(call_id=ticket.call_id))
                        )
                self.scheduler.withdraw(ticket)
                del self.tickets[ticket.call_id]
                span = self._call_spans.pop(ticket.call_id, None)
                if span is not None:
                    span.end()
            self._event(entry, K.QUERY_EVENT_KIND_CANCELLED, now)
            self._persist(entry, [])
            await self.flush()
            self._finish(entry)
        return await self.get_info(query_id)

    # ------------------------------------------------------------------ events, queries

    def _event(
        self,
        entry: _Active,
        kind: cpb.QueryEventKind.ValueType,
        now: float,
        *,
        stage: int = -1,
        call_id: str = "",
        instance: str = "",
        text: str = "",
    ) -> None:
        event = cpb.QueryEvent(
            query_id=entry.run.query.query_id,
            kind=kind,
            time_s=now,
            stage=stage,
            call_id=call_id,
            instance=instance,
            text=text,
            sequence=entry.event_base + len(entry.events),
        )
        if kind != K.QUERY_EVENT_KIND_CALL_TOKENS:  # token chunks are live only
            entry.events.append(event)
        for watcher in entry.watchers:
            watcher.put_nowait(event)

    def on_started(self, link: WorkerLink, msg: wpb.CallStarted) -> None:
        ticket = self.tickets.get(msg.call_id)
        entry = self.active.get(ticket.query_id) if ticket else None
        if ticket is None or entry is None:
            return
        self._event(
            entry,
            K.QUERY_EVENT_KIND_CALL_STARTED,
            self.clock.now(),
            stage=ticket.stage,
            call_id=msg.call_id,
            instance=self.cluster.instances[link.slot].name,
        )
        self._persist(entry, [])  # a crash keeps the start in the log

    def on_tokens(self, link: WorkerLink, msg: wpb.CallTokens) -> None:
        ticket = self.tickets.get(msg.call_id)
        entry = self.active.get(ticket.query_id) if ticket else None
        if ticket is None or entry is None or not entry.watchers:
            return
        self._event(
            entry,
            K.QUERY_EVENT_KIND_CALL_TOKENS,
            self.clock.now(),
            stage=ticket.stage,
            call_id=msg.call_id,
            text=msg.text,
        )

    async def watch(self, query_id: str) -> AsyncIterator[cpb.QueryEvent]:
        """The query's events so far, then live ones until it ends."""
        entry = self.active.get(query_id)
        if entry is None:
            await self.get_info(query_id)  # NOT_FOUND if unknown
            for raw in await self.store.events(query_id):
                yield cpb.QueryEvent.FromString(raw)
            return
        queue: asyncio.Queue[cpb.QueryEvent | None] = asyncio.Queue()
        past = list(entry.events)  # snapshot and subscribe with no await in between
        entry.watchers.add(queue)
        try:
            if entry.event_base:
                stored = await self.store.events(query_id)
                for raw in stored[: entry.event_base]:
                    yield cpb.QueryEvent.FromString(raw)
            for event in past:
                yield event
            while True:
                live = await queue.get()
                if live is None:
                    return
                yield live
        finally:
            entry.watchers.discard(queue)

    async def get_info(self, query_id: str) -> cpb.QueryInfo:
        entry = self.active.get(query_id)
        if entry is not None:
            return self._info_of_run(entry.run)
        stored = await self.store.load(query_id)
        if stored is None:
            raise UnknownQueryError(query_id)
        return self._info_of_stored(stored)

    async def get(self, query_id: str) -> tuple[cpb.QueryInfo, list[cpb.QueryEvent]]:
        info = await self.get_info(query_id)
        entry = self.active.get(query_id)
        stored = [cpb.QueryEvent.FromString(r) for r in await self.store.events(query_id)]
        if entry is not None:
            return info, stored[: entry.event_base] + list(entry.events)
        return info, stored

    def _info_of_run(self, run: QueryRun) -> cpb.QueryInfo:
        q = run.query
        stages_done = sum(1 for f in run.stage_finished_s if f is not None)
        return cpb.QueryInfo(
            query_id=q.query_id,
            tenant=q.tenant,
            state=cpb.QUERY_STATE_SUCCEEDED
            if run.finished_s is not None
            else cpb.QUERY_STATE_RUNNING,
            arrival_s=run.arrival_s,
            slo_s=run.slo_s,
            deadline_s=run.deadline_s,
            finished_s=run.finished_s or 0.0,
            stages_total=len(q.workflow.stages),
            stages_done=stages_done,
            calls_total=q.workflow.num_calls,
            calls_done=q.workflow.num_calls - run.calls_left,
        )

    def _info_of_stored(self, stored: StoredQuery) -> cpb.QueryInfo:
        f = stored.fields
        return cpb.QueryInfo(
            query_id=stored.query_id,
            tenant=f["tenant"],
            state=_STATES.get(f["state"], cpb.QUERY_STATE_UNSPECIFIED),
            arrival_s=float(f["arrival_s"]),
            slo_s=float(f["slo_s"]),
            deadline_s=float(f["deadline_s"]),
            finished_s=float(f["finished_s"]),
            stages_total=int(f["stages_total"]),
            stages_done=int(f["stages_done"]),
            calls_total=int(f["calls_total"]),
            calls_done=int(f["calls_total"]) - int(f["calls_left"]),
        )

    # ------------------------------------------------------------------ workers

    def connect(self, hello: wpb.WorkerHello, link: WorkerLink) -> wpb.WorkerWelcome:
        """Give a worker its slot; raises InvalidFieldError / SlotTakenError."""
        slot = self._slot_for(hello)
        old = self.links[slot]
        if old is not None and old is not link:
            old.close()  # the same worker reconnecting: its old stream is dead
        link.slot = slot
        self.links[slot] = link
        self.scheduler.load.set_available(slot, True)
        now = self.clock.now()
        drop = []
        for call_id in hello.resident_call_ids:
            ticket = self.tickets.get(call_id)
            if ticket is not None and ticket.instance == slot:
                continue
            if ticket is not None and ticket.instance < 0 and self._adoptable.get(call_id) == slot:
                self._adopt(ticket, slot)
                continue
            drop.append(call_id)
        # Calls this slot should hold but the worker does not (it restarted): send again.
        resident = set(hello.resident_call_ids)
        resend = [
            t for t in self.tickets.values() if t.instance == slot and t.call_id not in resident
        ]
        welcome = wpb.WorkerWelcome(
            slot=slot,
            instance=self.cluster.instances[slot].name,
            epoch_unix_s=self.clock.epoch_unix_s,
            time_scale=self.clock.time_scale,
            cluster=self.cluster.inline,
            queue_policy=self.scheduler.preset.queue.name,
            queue_params_json=json.dumps(dict(self.scheduler.preset.queue.params)),
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            drop_call_ids=drop,
        )
        link.send(wpb.ConnectResponse(welcome=welcome))
        self._send(resend)
        self._dispatch_parked(now)
        log.info("worker %s (%s) holds slot %d", hello.worker_id, link.engine, slot)
        return welcome

    def _slot_for(self, hello: wpb.WorkerHello) -> int:
        gpu = hello.gpu.strip().lower()
        instances = self.cluster.instances
        if hello.slot >= len(instances):
            raise InvalidFieldError(
                "hello.slot",
                f"{hello.slot} is not a slot of this cluster (0..{len(instances) - 1})",
            )
        if hello.slot >= 0:
            inst = instances[hello.slot]
            if inst.gpu.lower() != gpu:
                raise InvalidFieldError(
                    "hello.gpu", f"slot {hello.slot} is a {inst.gpu}, the worker says {hello.gpu!r}"
                )
            holder = self.links[hello.slot]
            if holder is not None and holder.worker_id != hello.worker_id and not holder.closed:
                raise SlotTakenError(f"slot {hello.slot} is held by worker {holder.worker_id}")
            candidates = [hello.slot]
        else:
            candidates = [
                inst.index
                for inst, holder in zip(instances, self.links, strict=True)
                if inst.gpu.lower() == gpu
                and (holder is None or holder.worker_id == hello.worker_id)
            ]
            if not candidates:
                known = sorted({i.gpu for i in instances})
                if gpu not in {g.lower() for g in known}:
                    raise InvalidFieldError(
                        "hello.gpu",
                        f"no {hello.gpu!r} slot in this cluster (GPU types: {', '.join(known)})",
                    )
                raise SlotTakenError(f"every {hello.gpu} slot is held by another worker")
        slot = candidates[0]
        if hello.model and hello.model.lower() != instances[slot].model:
            raise InvalidFieldError(
                "hello.model",
                f"slot {slot} serves {instances[slot].model}, the worker says {hello.model!r}",
            )
        return slot

    def on_heartbeat(self, link: WorkerLink, msg: wpb.WorkerHeartbeat) -> None:
        link.last_seen = time.monotonic()
        link.running, link.queued, link.kv_used = msg.running, msg.queued, msg.kv_used_tokens

    def disconnect(self, link: WorkerLink, reason: str) -> None:
        """The worker's stream ended: its calls go elsewhere."""
        link.close()
        if link.slot < 0 or self.links[link.slot] is not link:
            return
        slot = link.slot
        self.links[slot] = None
        self.scheduler.load.set_available(slot, False)
        moved = [t for t in self.tickets.values() if t.instance == slot]
        log.warning(
            "worker %s left slot %d (%s); redispatching %d calls",
            link.worker_id,
            slot,
            reason,
            len(moved),
        )
        for ticket in moved:
            self._redispatch(ticket, f"worker {link.worker_id} lost: {reason}")
        for entry_id in {t.query_id for t in moved}:
            entry = self.active.get(entry_id)
            if entry is not None:
                self._persist(entry, [t for t in moved if t.query_id == entry_id])

    def _redispatch(self, ticket: CallTicket, reason: str) -> None:
        self.scheduler.withdraw(ticket)
        try:
            self.scheduler.dispatch(ticket, self.clock.now())
        except NoInstanceError:
            log.warning("no instance can take %s now; parked", ticket.call_id)
            return
        entry = self.active.get(ticket.query_id)
        if entry is not None:
            self._event(
                entry,
                K.QUERY_EVENT_KIND_CALL_REDISPATCHED,
                self.clock.now(),
                stage=ticket.stage,
                call_id=ticket.call_id,
                text=reason,
            )
        self._send([ticket])

    def _dispatch_parked(self, now: float) -> None:
        parked = sorted(
            (
                t
                for t in self.tickets.values()
                if t.instance < 0 and t.call_id not in self._adoptable
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
        self._send(sent)
        for entry_id in {t.query_id for t in sent}:
            entry = self.active.get(entry_id)
            if entry is not None:
                self._note_first_dispatch(entry, sent)
                self._persist(entry, [t for t in sent if t.query_id == entry_id])

    def _adopt(self, ticket: CallTicket, slot: int) -> None:
        """A call a reconnecting worker still holds goes back on its ledger."""
        self._adoptable.pop(ticket.call_id, None)
        ticket.instance = slot
        ticket.work_s = self.scheduler.estimator.call_time(slot, ticket.call)
        self.scheduler.load.on_dispatch(ticket)

    async def _watch_heartbeats(self) -> None:
        timeout = self.config.heartbeat_timeout_s
        while True:
            await asyncio.sleep(min(timeout / 4, 0.25))
            now = time.monotonic()
            for link in list(self.links):
                if link is not None and now - link.last_seen > timeout:
                    self.disconnect(link, f"no heartbeat for {now - link.last_seen:.1f} s")

    # ------------------------------------------------------------------ restart

    async def _resume(self) -> None:
        """Rebuild every running query from Redis; its calls wait for their workers to
        reclaim them for `resume_grace_s`, then go out again."""
        ids = await self.store.active_ids()
        max_seq = -1
        for query_id in ids:
            stored = await self.store.load(query_id)
            if stored is None or stored.fields.get("state") != "running":
                continue
            logged = int(await self.redis.llen(self.store.evkey(query_id)))
            max_seq = max(max_seq, self._resume_query(stored, logged))
        self.scheduler.next_seq = max(self.scheduler.next_seq, max_seq + 1)
        if self._adoptable or any(t.instance < 0 for t in self.tickets.values()):
            log.info(
                "resumed %d queries, %d calls wait for their workers",
                len(self.active),
                len(self.tickets),
            )
            self._tasks.append(asyncio.create_task(self._end_grace()))

    def _resume_query(self, stored: StoredQuery, logged_events: int) -> int:
        request = cpb.SubmitQueryRequest.FromString(stored.submit)
        query, prompts = parse_submit(request)
        f = stored.fields
        run = self.scheduler.admit(query, int(f["index"]), float(f["arrival_s"]), float(f["slo_s"]))
        span = self.tracer.start_span("query (resumed)", attributes={"query.id": query.query_id})
        entry = _Active(run, prompts, span, event_base=logged_events)
        self.active[query.query_id] = entry
        stages = query.workflow.stages
        run.calls_left = int(f["calls_left"])
        released = []
        for k in range(len(stages)):
            run.stage_calls_left[k] = int(f[f"s{k}:left"])
            run.deps_left[k] = int(f[f"s{k}:deps"])
            rel, fin = stored.stage(k, "rel"), stored.stage(k, "fin")
            run.stage_finished_s[k] = float(fin) if fin is not None else None
            if rel is not None:
                released.append((float(rel), k))
        max_seq = -1
        plan = self.scheduler.estimator.plan(query.workflow, "call")
        for rel_s, k in sorted(released):
            run.stage_released_s[k] = rel_s
            computed = self.scheduler.budget.deadline(run, k, rel_s)  # replays budget state
            if run.stage_finished_s[k] is not None:
                continue
            dl = stored.stage(k, "dl")
            deadline = float(dl) if dl is not None else computed
            for index, call in enumerate(stages[k].calls):
                call_id = call_id_of(query.query_id, k, index)
                state = stored.call(call_id)
                if state == "done":
                    continue
                seq = self.scheduler.next_seq
                slot = -1
                if state:
                    slot_s, _, seq_s = state.partition(":")
                    slot, seq = int(slot_s), int(seq_s)
                else:
                    self.scheduler.next_seq += 1
                ticket = CallTicket(
                    seq, run, k, call, rel_s, deadline, plan.tail_s[k] - plan.stage_s[k]
                )
                ticket.call_id = call_id
                self.tickets[call_id] = ticket
                max_seq = max(max_seq, seq)
                if slot >= 0:
                    self._adoptable[call_id] = slot
        return max_seq

    async def _end_grace(self) -> None:
        await asyncio.sleep(self.config.resume_grace_s)
        unclaimed = list(self._adoptable)
        self._adoptable.clear()
        if unclaimed:
            log.info(
                "%d calls were not reclaimed by their workers; dispatching again", len(unclaimed)
            )
        self._dispatch_parked(self.clock.now())

    # ------------------------------------------------------------------ status

    async def set_alpha(self, alpha: float, reason: str) -> float:
        previous = self.scheduler.alpha
        if previous is None:
            raise InvalidFieldError("alpha", f"policy {self.config.policy!r} has no alpha")
        if not 0.0 <= alpha <= 1.0:
            raise InvalidFieldError("alpha", f"must be in [0, 1], got {alpha}")
        self.scheduler.set_alpha(alpha)
        await self.store.set_alpha(alpha, self.clock.now(), reason)
        return previous

    def status(self) -> cpb.ClusterStatusResponse:
        load = self.scheduler.load
        instances = []
        for inst in self.cluster.instances:
            link = self.links[inst.index]
            instances.append(
                cpb.InstanceStatus(
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
                )
            )
        return cpb.ClusterStatusResponse(
            instances=instances,
            policy=self.scheduler.preset.name,
            alpha=self.scheduler.alpha or 0.0,
            time_scale=self.clock.time_scale,
            now_s=self.clock.now(),
            queries_running=len(self.active),
            queries_finished=self.queries_finished,
            slo_base_s=self.slo_base_s,
            cluster=self.cluster.description,
            overhead=cpb.CoordinatorOverhead(
                completion_to_dispatch_ms=_summary(self._completion_ms),
                submit_to_dispatch_ms=_summary(self._submit_ms),
                completions=self.completions,
            ),
        )


def _summary(samples: Iterable[float]) -> cpb.LatencySummary:
    values = list(samples)
    if not values:
        return cpb.LatencySummary()
    return cpb.LatencySummary(
        count=len(values), p50=percentile(values, 50), p99=percentile(values, 99), max=max(values)
    )


def _log_failure(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("persisting failed: %s", task.exception())
