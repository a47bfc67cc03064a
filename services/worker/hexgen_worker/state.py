"""A worker's state: its calls, its local queue in front of its engine, and its outbox.

`WorkerState` is everything a worker knows, without the network: the coordinator links
(`hexgen_worker.link.CoordinatorLink`) feed it the coordinators' messages (`configure`,
`dispatch`, `cancel`, `update_deadline`, `ack`) and the engine's events
(`run_engine_events`), and it reports through one `send(link, report)` callable. Tests
drive it directly.

A worker may serve several coordinator shards at once (one link each, numbered in the
order of ``--coordinator``): every method that concerns a coordinator's call takes its
`link` (0 with one coordinator), calls are known by (link, call id), each call's reports go
to the link that dispatched it, and the calls of every link share the one local queue and
engine (`hexgen_worker.shards.ShardMap` maps their ids, order and clocks onto them).

Rules it keeps:

- A (link, call id) is executed at most once: a dispatch of a call that is queued or
  running is ignored; of a call that finished and is not yet acknowledged, its
  `CallFinished` is sent again.
- Every `CallFinished` stays in the outbox until the coordinator acknowledges it; the link
  resends the outbox after every reconnect, so nothing finished is lost while the link is
  down (`send` may drop messages then).
- Calls are admitted in the local queue's order whenever something changes (a dispatch, a
  finish, a cancel, a deadline update), through the core's `InstanceScheduler`.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from hexgen_flow.cluster import Cluster, parse_cluster
from hexgen_flow.errors import ConfigError, UnknownNameError
from hexgen_flow.estimate import Estimator
from hexgen_flow.hardware import GpuCatalogue
from hexgen_flow.policies.registration import QUEUES
from hexgen_flow.runtime import CallTicket, ClusterLoad, PolicyContext
from hexgen_flow.scheduler import InstanceScheduler
from hexgen_service import genai
from hexgen_service.clock import ClusterClock
from hexgen_service.eos_script import EosScript
from hexgen_service.telemetry import context_from_traceparent
from hexgen_worker.engines.base import NO_OPTIONS, CallOptions, ChatMessage, Engine, translate_time
from hexgen_worker.events import (
    CallFinished,
    CallReport,
    CallStarted,
    CallTokens,
    CapacityReleased,
    EngineEvent,
    Heartbeat,
)
from hexgen_worker.metrics import WorkerMetrics
from hexgen_worker.shards import ShardMap
from hexgen_worker.welcome import WelcomeSettings

__all__ = ["CallStatus", "DispatchOutcome", "WelcomeSettings", "WorkerState"]

log = logging.getLogger(__name__)

_REMOTE_ENGINES = frozenset({"openai"})
"""Engines whose model runs in another process (a server they call): their spans of a call
are of kind CLIENT, the others' INTERNAL (GenAI conventions: a model in the same process)."""


class CallStatus(enum.IntEnum):
    """Where a call the worker holds is (finished calls live in the outbox)."""

    QUEUED = 1
    RUNNING = 2

    @property
    def is_queued(self) -> bool:
        return self is CallStatus.QUEUED

    @property
    def is_running(self) -> bool:
        return self is CallStatus.RUNNING


class DispatchOutcome(enum.Enum):
    """What `WorkerState.dispatch` did with a dispatch."""

    QUEUED = "queued"
    """New call: queued (and admitted if the engine had room)."""
    DUPLICATE = "duplicate"
    """Already queued or running here: ignored."""
    RESENT = "resent"
    """Already finished and not acknowledged: its CallFinished was sent again."""
    REJECTED = "rejected"
    """Cannot run here (it can never fit, or the worker is stopping): reported failed."""


class _Call:
    """A call the worker holds (queued or running)."""

    __slots__ = ("call_id", "link", "queued_s", "span", "started_s", "status", "ticket", "work_s")

    def __init__(
        self,
        ticket: CallTicket,
        link: int,
        call_id: str,
        queued_s: float,
        span: trace.Span,
        work_s: float,
    ) -> None:
        self.ticket = ticket
        """The ticket the queue and the engine hold (id, order and times mapped to them)."""
        self.link = link
        """The link (coordinator) that dispatched it: its reports go there."""
        self.call_id = call_id
        """Its id at that coordinator."""
        self.work_s = work_s
        """Its estimated single-request seconds here (what other links are told)."""
        self.status = CallStatus.QUEUED
        self.queued_s = queued_s
        """When it reached this worker's queue (cluster clock)."""
        self.started_s: float | None = None
        self.span = span
        """The worker's span of the call: queue wait and execution."""


class WorkerState:
    """One worker's calls, local queue, engine admission and outbox."""

    def __init__(
        self,
        engine: Engine,
        *,
        gpu: str,
        model: str,
        kv_cache_tokens: int,
        send: Callable[[int, CallReport], None],
        coordinators: Sequence[str] = ("coordinator",),
        calibration: str | None = None,
        catalogue: GpuCatalogue | None = None,
        tracer: trace.Tracer | None = None,
        metrics: WorkerMetrics | None = None,
        eos_script: EosScript | None = None,
    ) -> None:
        """`send(link, report)` reports on link `link`; `coordinators` names the links (the
        coordinators' addresses, in link order: what errors and logs call them)."""
        self.engine = engine
        self.eos_script = eos_script
        """Where each call's model stops (``--eos-script``); None: at the call's cap."""
        self.metrics = metrics
        """The worker's Prometheus metrics, when it serves them."""
        self.gpu = gpu
        """GPU type this worker declared (the welcome's slot must be one)."""
        self.model = model
        self.calibration = calibration
        """Where the local queue's latency estimates come from (None: the default)."""
        self.catalogue = catalogue
        """What `gpu` is resolved in when the welcome's cluster file is not on this
        machine (None: the shipped catalogue; `WorkerConfig.catalogue`)."""
        self.kv_cache_tokens = kv_cache_tokens
        """KV-cache tokens declared: a call larger than this can never run here."""
        self._send = send
        self._tracer = tracer or trace.get_tracer("hexgen-worker")
        self.shards = ShardMap(coordinators)
        self.settings: WelcomeSettings | None = None
        """The latest welcome (of any link; `shards.settings` holds each link's)."""
        self.clock: ClusterClock | None = None
        """The clock the queue and the engine run on (the first welcome's; with one
        coordinator, its latest)."""
        self.scheduler: InstanceScheduler | None = None
        self._queue_key: tuple[str, int, str, str] | None = None
        self._queue_link: int | None = None
        """The link whose slot the local queue plans for (the first welcomed)."""
        self._estimator: Estimator | None = None
        self._clusters: dict[str, Cluster] = {}
        self._stand_ins: set[str] = set()
        """Welcome clusters this machine cannot read (`_cluster`)."""
        self._calls: dict[str, _Call] = {}
        """By engine id (`ShardMap.engine_id`)."""
        self._outbox: dict[tuple[int, str], CallFinished] = {}
        """By (link, call id); times on the local clock."""
        self.accepting = True
        """False once the worker is stopping: new dispatches are refused."""

    # ------------------------------------------------------------------ what it holds

    def resident_call_ids(self, link: int = 0) -> list[str]:
        """Link `link`'s calls queued or running here (its hello's resident_call_ids)."""
        return [c.call_id for c in self._calls.values() if c.link == link]

    def unacked(self, link: int = 0) -> list[CallFinished]:
        """Link `link`'s finished calls not yet acknowledged, in finishing order (its part
        of the outbox), with times on its clock."""
        return [self._for_link(link, f) for (at, _), f in self._outbox.items() if at == link]

    def status(self, call_id: str, link: int = 0) -> CallStatus | None:
        """Whether a call is queued or running here (None: neither)."""
        call = self._calls.get(self.shards.engine_id(link, call_id))
        return call.status if call is not None else None

    def ticket(self, call_id: str, link: int = 0) -> CallTicket | None:
        """The ticket the queue holds for a call (its times on the local clock)."""
        call = self._calls.get(self.shards.engine_id(link, call_id))
        return call.ticket if call is not None else None

    def queued(self) -> int:
        return len(self.scheduler.queue) if self.scheduler is not None else 0

    def heartbeat(self, link: int = 0) -> Heartbeat:
        """The load reported on link `link`: the whole engine and queue, and what the other
        links' coordinators have here."""
        load = self.engine.load()
        if self.shards.links == 1:
            return Heartbeat(load.running, self.queued(), load.kv_used_tokens)
        others = [c for c in self._calls.values() if c.link != link]
        return Heartbeat(
            load.running,
            self.queued(),
            load.kv_used_tokens,
            others_in_flight=len(others),
            others_outstanding_s=sum(c.work_s for c in others),
            others_tokens=sum(c.ticket.call.input_tokens + c.ticket.output_tokens for c in others),
            others_weight=sum(c.ticket.weight for c in others),
            others_weighted_outstanding_s=sum(c.ticket.weight * c.work_s for c in others),
        )

    # ------------------------------------------------------------------ the welcome

    def configure(self, settings: WelcomeSettings, link: int = 0) -> None:
        """Adopt link `link`'s welcome: clock, local queue, dropped calls; then admit what
        fits.

        Raises `ConfigError` when the welcome cannot be served here (a slot of another GPU
        type or model, an unknown queue policy or parameter, or a disagreement with another
        link's welcome, `ShardMap.check_agreement`).
        """
        cluster = self._cluster(settings.cluster, settings.slot)
        if not 0 <= settings.slot < len(cluster):
            raise ConfigError(
                f"welcome: slot {settings.slot} is not in the cluster {settings.cluster!r} "
                f"({len(cluster)} instances)"
            )
        spec = cluster.instances[settings.slot]
        if (spec.gpu, spec.model) != (self.gpu, self.model):
            raise ConfigError(
                f"welcome: slot {settings.slot} is {spec.model} on {spec.gpu}, but this "
                f"worker serves {self.model} on {self.gpu}"
            )
        if spec.kv_cache_tokens != self.kv_cache_tokens:
            log.warning(
                "slot %d has %d KV-cache tokens in the cluster; this worker declared %d and "
                "admits by its own",
                settings.slot,
                spec.kv_cache_tokens,
                self.kv_cache_tokens,
            )
        shards = self.shards
        shards.check_agreement(link, settings)
        if self.clock is None:
            self.clock = settings.clock
        elif self.clock != settings.clock and not shards.others_welcomed(link):
            # The only coordinator (so far) restarted with another epoch or time scale: the
            # worker follows it. With other links, the local clock stays and this link's
            # times are translated (`ShardMap.to_local`; the time scales agree).
            self._rebase(self.clock, settings.clock)
            self.clock = settings.clock
        shards.local_clock = self.clock
        shards.settings[link] = settings
        self.engine.set_clock(self.clock)
        if self._queue_link is None:
            self._queue_link = link
        # Every link's slot is of this GPU type and model (checked above); the queue plans
        # for the first welcomed link's.
        queue_slot = (
            settings.slot
            if link == self._queue_link or self._queue_key is None
            else self._queue_key[1]
        )
        params_text = json.dumps(dict(settings.queue_params), sort_keys=True)
        key = (settings.cluster, queue_slot, settings.queue_policy, params_text)
        if key != self._queue_key:
            estimator = Estimator(cluster)
            ctx = PolicyContext(cluster, estimator, ClusterLoad(cluster), random.Random(0))
            queue = QUEUES.create(
                settings.queue_policy, ctx, queue_slot, params=dict(settings.queue_params)
            )
            now = self.clock.now()
            waiting = [c.ticket for c in self._calls.values() if c.status.is_queued]
            for ticket in sorted(waiting, key=lambda t: t.seq):
                queue.push(ticket, now)
            self.scheduler = InstanceScheduler(queue, self.engine)
            self._queue_key = key
            self._estimator = estimator
            log.info(
                "local queue: %s %s on %s (slot %d)",
                settings.queue_policy,
                params_text,
                settings.instance,
                queue_slot,
            )
        self.settings = settings
        for call_id in settings.drop_call_ids:
            if self.cancel(call_id, link=link, reason="dropped by the coordinator"):
                log.info(
                    "dropped call %s (coordinator %s no longer wants it here)",
                    call_id,
                    shards.names[link],
                )
        self.admit_ready()

    def _cluster(self, text: str, slot: int) -> Cluster:
        """The welcome's cluster; when it names a file this machine does not have, a
        stand-in whose instances are all this worker's own (the local queues read only
        their own instance's latency model, so they order calls the same), grown to
        `slot` when another coordinator's welcome names a higher one."""
        cluster = self._clusters.get(text)
        if cluster is None or (text in self._stand_ins and slot >= len(cluster)):
            try:
                cluster = parse_cluster(text, self.model, self.calibration, self.catalogue)
            except UnknownNameError:
                raise
            except ConfigError as exc:
                log.warning(
                    "cannot read the welcome's cluster (%s); the local queue plans with this "
                    "worker's own instance",
                    exc,
                )
                entry: dict[str, Any] = {
                    "gpu": self.gpu,
                    "model": self.model,
                    "kv_cache_tokens": self.kv_cache_tokens,
                }
                cluster = Cluster.build(
                    [entry] * (max(slot, 0) + 1),
                    f"{text} (stand-in)",
                    self.catalogue,
                    calibration=self.calibration,
                )
                self._stand_ins.add(text)
            self._clusters[text] = cluster
        return cluster

    def _rebase(self, old: ClusterClock, new: ClusterClock) -> None:
        """Move every time held from clock `old` to clock `new` (a coordinator restarted
        with another epoch or time scale)."""
        log.warning("the cluster clock changed (%s -> %s); moving held times onto it", old, new)
        for call in self._calls.values():
            t = call.ticket
            t.released_s = translate_time(t.released_s, old, new)
            t.deadline_s = translate_time(t.deadline_s, old, new)
            t.query_deadline_s = translate_time(t.query_deadline_s, old, new)
            call.queued_s = translate_time(call.queued_s, old, new)
            if call.started_s is not None:
                call.started_s = translate_time(call.started_s, old, new)
        for key, done in self._outbox.items():
            self._outbox[key] = dataclasses.replace(
                done,
                started_s=translate_time(done.started_s, old, new),
                finished_s=translate_time(done.finished_s, old, new),
                first_token_s=(  # 0: not given, on any clock
                    translate_time(done.first_token_s, old, new) if done.first_token_s else 0.0
                ),
            )
        self._queue_key = None  # queue keys were computed from the old times

    # ------------------------------------------------------------------ coordinator messages

    def dispatch(
        self,
        ticket: CallTicket,
        *,
        link: int = 0,
        prompt: str = "",
        messages: Sequence[ChatMessage] = (),
        options: CallOptions = NO_OPTIONS,
        traceparent: str = "",
    ) -> DispatchOutcome:
        """A call link `link` dispatched here (`ticket` as that coordinator sent it): queue it
        (once) and admit what fits. `messages` are a chat request's (`prompt` is then their
        plain rendering)."""
        call_id = ticket.call_id
        finished = self._outbox.get((link, call_id))
        if finished is not None:
            log.info("call %s dispatched again after it finished: resending its result", call_id)
            # The result answers the latest dispatch: the coordinator accepts only that one.
            finished = dataclasses.replace(finished, attempt=ticket.attempt)
            self._outbox[(link, call_id)] = finished
            self._send(link, self._for_link(link, finished))
            return DispatchOutcome.RESENT
        engine_id = self.shards.engine_id(link, call_id, new=True)
        held = self._calls.get(engine_id)
        if held is not None:
            log.info("call %s dispatched again while it is here: ignored", call_id)
            held.ticket.attempt = max(held.ticket.attempt, ticket.attempt)
            return DispatchOutcome.DUPLICATE
        if self.scheduler is None or self.clock is None:
            raise RuntimeError("a dispatch before the welcome")
        now = self.clock.now()
        tokens = ticket.call.input_tokens + ticket.output_tokens
        if tokens > self.kv_cache_tokens:
            self.fail(
                call_id,
                f"{tokens} tokens can never fit {self.kv_cache_tokens} KV tokens",
                attempt=ticket.attempt,
                link=link,
            )
            return DispatchOutcome.REJECTED
        if not self.accepting:
            log.info("call %s dispatched while stopping: not taken", call_id)
            return DispatchOutcome.REJECTED
        # OpenTelemetry's GenAI semantic conventions (`hexgen_service.genai`): the engine's
        # execution of the call, "{engine} {operation} {model}" (the coordinator's span,
        # its parent, is the "{operation} {model}" one).
        operation = genai.operation_of(bool(messages))
        response_format = (options.response_format or {}).get("type")
        attributes = genai.request_attributes(
            operation=operation,
            provider=self.engine.kind,
            model=self.model,
            max_tokens=ticket.output_tokens,
            sampling=options.sampling(),
            json_output=response_format in ("json_object", "json_schema"),
            conversation_id=ticket.query_id,
        )
        attributes.update(
            {
                "hexgen.call_id": call_id,
                "hexgen.query_id": ticket.query_id,
                "hexgen.step": ticket.call.step,
                "hexgen.input_tokens": ticket.call.input_tokens,
                "hexgen.output_tokens": ticket.output_tokens,
                "hexgen.engine": self.engine.kind,
            }
        )
        if self.eos_script is not None:  # the model stops there: the engine is asked that
            ticket.output_tokens = self.eos_script.tokens(call_id, ticket.output_tokens)
        work_s = 0.0
        if self.shards.links > 1:
            attributes["hexgen.coordinator"] = self.shards.names[link]
            ticket = self._local_ticket(link, ticket, engine_id)
            if self._estimator is not None and self._queue_key is not None:
                work_s = self._estimator.call_time(self._queue_key[1], ticket.call)
        span = self._tracer.start_span(
            f"{self.engine.kind} {genai.span_name(operation, self.model)}",
            context=context_from_traceparent(traceparent),
            # a model server the engine calls is a client call; a model in this process not
            kind=trace.SpanKind.CLIENT
            if self.engine.kind in _REMOTE_ENGINES
            else trace.SpanKind.INTERNAL,
            attributes=attributes,
        )
        self._calls[engine_id] = _Call(ticket, link, call_id, now, span, work_s)
        if prompt:
            self.engine.prompts[engine_id] = prompt
        if messages:
            self.engine.messages[engine_id] = tuple(messages)
        if options != NO_OPTIONS:
            self.engine.options[engine_id] = options
        self.scheduler.queue.push(ticket, now)
        self.admit_ready()
        return DispatchOutcome.QUEUED

    def _local_ticket(self, link: int, ticket: CallTicket, engine_id: str) -> CallTicket:
        """A link's ticket as the shared queue and engine hold it: its engine id, its
        release and query order made unique among the links', its times on the local
        clock (`ShardMap`)."""
        shards = self.shards
        return CallTicket.detached(
            seq=shards.order(link, ticket.seq),
            call_id=engine_id,
            query_id=ticket.query_id,
            query_seq=shards.order(link, ticket.query_seq),
            tenant=ticket.tenant,
            stage=ticket.stage,
            call=ticket.call,
            released_s=shards.to_local(link, ticket.released_s),
            deadline_s=shards.to_local(link, ticket.deadline_s),
            query_deadline_s=shards.to_local(link, ticket.query_deadline_s),
            remaining_after_s=ticket.remaining_after_s,
            attempt=ticket.attempt,
            weight=ticket.weight,
            output_tokens=ticket.output_tokens,  # the engine's ask (`call` may hold a belief)
        )

    def fail(self, call_id: str, error: str, *, attempt: int = 0, link: int = 0) -> None:
        """Report a call that cannot run here as failed (the coordinator retries it)."""
        log.warning("call %s failed here: %s", call_id, error)
        now = self.clock.now() if self.clock is not None else 0.0
        finished = CallFinished(call_id, 0, "", now, now, error, attempt)
        self._outbox[(link, call_id)] = finished
        self._send(link, self._for_link(link, finished))

    def cancel(self, call_id: str, *, link: int = 0, reason: str = "cancelled") -> bool:
        """Forget link `link`'s call: drop it from the queue or abort it in the engine
        (nothing is reported for it). False when the call is not here."""
        engine_id = self.shards.engine_id(link, call_id)
        call = self._calls.pop(engine_id, None)
        if call is None:
            return self._outbox.pop((link, call_id), None) is not None
        self.shards.forget(link, call_id)
        if call.status.is_queued:
            if self.scheduler is not None:
                self.scheduler.queue.remove(call.ticket)
            self.engine.prompts.pop(engine_id, None)
            self.engine.messages.pop(engine_id, None)
            self.engine.options.pop(engine_id, None)
        else:
            self.engine.cancel(engine_id)
        call.span.set_attribute("hexgen.cancelled", reason)
        call.span.end()
        self.admit_ready()
        return True

    def update_deadline(self, call_id: str, deadline_s: float, *, link: int = 0) -> bool:
        """New stage deadline (on link `link`'s clock) for its call; a queued call moves to
        its new place in the queue. False when the call is not here."""
        call = self._calls.get(self.shards.engine_id(link, call_id))
        if call is None:
            return False
        ticket = call.ticket
        deadline_s = self.shards.to_local(link, deadline_s)
        log.info(
            "call %s: stage deadline %.3f -> %.3f (%s)",
            call_id,
            ticket.deadline_s,
            deadline_s,
            "queued" if call.status.is_queued else "running",
        )
        if call.status.is_queued and self.scheduler is not None and self.clock is not None:
            queue = self.scheduler.queue
            queue.remove(ticket)
            ticket.deadline_s = deadline_s
            queue.push(ticket, self.clock.now())
            self.admit_ready()
        else:
            ticket.deadline_s = deadline_s  # running: nothing to reorder
        return True

    def ack(self, call_ids: Iterable[str], *, link: int = 0) -> None:
        """Link `link`'s coordinator recorded these completions: forget them."""
        for call_id in call_ids:
            self._outbox.pop((link, call_id), None)

    def move_calls(self, source: int, target: int) -> tuple[int, int]:
        """Make link `source`'s calls (untouched in the queue and engine) and unacknowledged
        results link `target`'s; `hexgen_worker.handover` says when and why. A call `target`
        holds already stays, the other copy goes. Returns (calls, results) moved."""
        calls = results = 0
        for call in [c for c in self._calls.values() if c.link == source]:
            held = self.status(call.call_id, target) is not None
            if held or (target, call.call_id) in self._outbox:
                self.cancel(call.call_id, link=source, reason="held by the new shard holder")
                continue
            self.shards.hand_over(source, target, call.call_id)
            call.link, calls = target, calls + 1
            call.span.set_attribute("hexgen.coordinator", self.shards.names[target])
        for key in [k for k in self._outbox if k[0] == source]:
            finished = self._outbox.pop(key)
            if (target, key[1]) not in self._outbox and self.status(key[1], target) is None:
                self._outbox[(target, key[1])], results = finished, results + 1
        return calls, results

    # ------------------------------------------------------------------ admission and engine

    def admit_ready(self) -> list[CallTicket]:
        """Admit waiting calls in queue order while the engine has room."""
        if self.scheduler is None or self.clock is None:
            return []
        now = self.clock.now()
        admitted = self.scheduler.admit_ready(now)
        for ticket in admitted:
            call = self._calls[ticket.call_id]
            call.status = CallStatus.RUNNING
            call.span.add_event("admitted", {"hexgen.queue_wait_s": now - call.queued_s})
        return admitted

    def on_engine_event(self, event: EngineEvent) -> None:
        """Record and report one engine event; a finish admits what now fits."""
        if isinstance(event, CapacityReleased):
            self.admit_ready()
            return
        call = self._calls.get(event.call_id)
        if call is None:
            return  # cancelled or dropped: nothing is reported for it
        link = call.link
        if isinstance(event, CallStarted):
            call.started_s = event.started_s
            if event.call_id != call.call_id:
                event = CallStarted(call.call_id, self.shards.to_link(link, event.started_s))
            self._send(link, event)
        elif isinstance(event, CallTokens):
            if event.call_id != call.call_id:
                event = CallTokens(call.call_id, event.text)
            self._send(link, event)
        else:
            del self._calls[event.call_id]
            self.shards.forget(link, call.call_id)
            event = dataclasses.replace(event, call_id=call.call_id, attempt=call.ticket.attempt)
            self._outbox[(link, call.call_id)] = event
            span = call.span
            queue_wait_s = event.started_s - call.queued_s
            execution_s = event.finished_s - event.started_s
            span.set_attribute("hexgen.queue_wait_s", queue_wait_s)
            span.set_attribute("hexgen.execution_s", execution_s)
            span.set_attribute("hexgen.generated_tokens", event.output_tokens)
            if not event.error:
                span.set_attributes(
                    genai.response_attributes(
                        model=self.model,
                        finish_reason=event.finish_reason,
                        # the engine's count, else the declared size
                        input_tokens=event.prompt_tokens or call.ticket.call.input_tokens,
                        output_tokens=event.output_tokens,
                    )
                )
            if self.metrics is not None:
                self.metrics.call_ended(
                    queue_wait_s, execution_s, event.output_tokens, failed=bool(event.error)
                )
            if event.error:
                span.set_status(Status(StatusCode.ERROR, event.error))
            span.end()
            self._send(link, self._for_link(link, event))
            self.admit_ready()

    def _for_link(self, link: int, finished: CallFinished) -> CallFinished:
        """A result held on the local clock, as link `link` reads it."""
        shards = self.shards
        started_s = shards.to_link(link, finished.started_s)
        if started_s == finished.started_s:
            return finished  # one clock (always so with one coordinator)
        finished_s = shards.to_link(link, finished.finished_s)
        first_token_s = finished.first_token_s  # 0: not given, on any clock
        if first_token_s:
            first_token_s = shards.to_link(link, first_token_s)
        return dataclasses.replace(
            finished, started_s=started_s, finished_s=finished_s, first_token_s=first_token_s
        )

    async def run_engine_events(self) -> None:
        """Consume the engine's events for ever (run as a task; cancel to stop)."""
        while True:
            self.on_engine_event(await self.engine.next_event())

    def close(self) -> None:
        """End the spans of the calls still held (the worker is stopping)."""
        for call in self._calls.values():
            call.span.set_attribute("hexgen.abandoned", True)
            call.span.end()
