"""A worker's state: its calls, its local queue in front of its engine, and its outbox.

`WorkerState` is everything a worker knows, without the network: the coordinator link
(`hexgen_worker.worker.Worker`) feeds it the coordinator's messages (`configure`,
`dispatch`, `cancel`, `update_deadline`, `ack`) and the engine's events
(`run_engine_events`), and it reports through one `send` callable. Tests drive it directly.

Rules it keeps:

- A call id is executed at most once: a dispatch of a call that is queued or running is
  ignored; of a call that finished and is not yet acknowledged, its `CallFinished` is sent
  again.
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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from hexgen_flow.cluster import Cluster, parse_cluster
from hexgen_flow.errors import ConfigError, UnknownNameError
from hexgen_flow.estimate import Estimator
from hexgen_flow.policies.registration import QUEUES
from hexgen_flow.runtime import CallTicket, ClusterLoad, PolicyContext
from hexgen_flow.scheduler import InstanceScheduler
from hexgen_service.clock import ClusterClock
from hexgen_service.telemetry import context_from_traceparent
from hexgen_worker.engines.base import ChatMessage, Engine, translate_time
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

__all__ = ["CallStatus", "DispatchOutcome", "WelcomeSettings", "WorkerState"]

log = logging.getLogger(__name__)


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


@dataclass(frozen=True, slots=True)
class WelcomeSettings:
    """The coordinator's welcome, validated (see `hexgen_worker.convert.welcome_from_proto`)."""

    slot: int
    """Slot of the cluster this worker holds."""
    instance: str
    """Instance name, e.g. "A100#0"."""
    clock: ClusterClock
    """The cluster clock: every time sent and received is read on it."""
    cluster: str
    """The cluster as ``--cluster`` writes it."""
    queue_policy: str
    """Name of the local queue policy (a `QUEUES` name)."""
    queue_params: Mapping[str, Any]
    """The local queue's parameters."""
    heartbeat_interval_s: float
    """Wall seconds between heartbeats."""
    drop_call_ids: tuple[str, ...] = ()
    """Resident calls the coordinator no longer wants here."""


class _Call:
    """A call the worker holds (queued or running)."""

    __slots__ = ("queued_s", "span", "started_s", "status", "ticket")

    def __init__(self, ticket: CallTicket, queued_s: float, span: trace.Span) -> None:
        self.ticket = ticket
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
        send: Callable[[CallReport], None],
        calibration: str | None = None,
        tracer: trace.Tracer | None = None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        """The worker's Prometheus metrics, when it serves them."""
        self.gpu = gpu
        """GPU type this worker declared (the welcome's slot must be one)."""
        self.model = model
        self.calibration = calibration
        """Where the local queue's latency estimates come from (None: the default)."""
        self.kv_cache_tokens = kv_cache_tokens
        """KV-cache tokens declared: a call larger than this can never run here."""
        self._send = send
        self._tracer = tracer or trace.get_tracer("hexgen-worker")
        self.settings: WelcomeSettings | None = None
        self.clock: ClusterClock | None = None
        self.scheduler: InstanceScheduler | None = None
        self._queue_key: tuple[str, int, str, str] | None = None
        self._clusters: dict[str, Cluster] = {}
        self._calls: dict[str, _Call] = {}
        self._outbox: dict[str, CallFinished] = {}
        self.accepting = True
        """False once the worker is stopping: new dispatches are refused."""

    # ------------------------------------------------------------------ what it holds

    def resident_call_ids(self) -> list[str]:
        """Calls queued or running here (the hello's resident_call_ids)."""
        return list(self._calls)

    def unacked(self) -> list[CallFinished]:
        """Finished calls not yet acknowledged, in finishing order (the outbox)."""
        return list(self._outbox.values())

    def status(self, call_id: str) -> CallStatus | None:
        """Whether a call is queued or running here (None: neither)."""
        call = self._calls.get(call_id)
        return call.status if call is not None else None

    def ticket(self, call_id: str) -> CallTicket | None:
        call = self._calls.get(call_id)
        return call.ticket if call is not None else None

    def queued(self) -> int:
        return len(self.scheduler.queue) if self.scheduler is not None else 0

    def heartbeat(self) -> Heartbeat:
        load = self.engine.load()
        return Heartbeat(load.running, self.queued(), load.kv_used_tokens)

    # ------------------------------------------------------------------ the welcome

    def configure(self, settings: WelcomeSettings) -> None:
        """Adopt a welcome: clock, local queue, dropped calls; then admit what fits.

        Raises `ConfigError` when the welcome cannot be served here (a slot of another GPU
        type or model, an unknown queue policy or parameter).
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
        if self.clock is not None and self.clock != settings.clock:
            self._rebase(self.clock, settings.clock)
        self.clock = settings.clock
        self.engine.set_clock(settings.clock)
        params_text = json.dumps(dict(settings.queue_params), sort_keys=True)
        key = (settings.cluster, settings.slot, settings.queue_policy, params_text)
        if key != self._queue_key:
            ctx = PolicyContext(cluster, Estimator(cluster), ClusterLoad(cluster), random.Random(0))
            queue = QUEUES.create(
                settings.queue_policy, ctx, settings.slot, params=dict(settings.queue_params)
            )
            now = self.clock.now()
            waiting = [c.ticket for c in self._calls.values() if c.status.is_queued]
            for ticket in sorted(waiting, key=lambda t: t.seq):
                queue.push(ticket, now)
            self.scheduler = InstanceScheduler(queue, self.engine)
            self._queue_key = key
            log.info(
                "local queue: %s %s on %s (slot %d)",
                settings.queue_policy,
                params_text,
                settings.instance,
                settings.slot,
            )
        self.settings = settings
        for call_id in settings.drop_call_ids:
            if self.cancel(call_id, reason="dropped by the coordinator"):
                log.info("dropped call %s (the coordinator no longer wants it here)", call_id)
        self.admit_ready()

    def _cluster(self, text: str, slot: int) -> Cluster:
        """The welcome's cluster; when it names a file this machine does not have, a
        stand-in whose instances are all this worker's own (the local queues read only
        their own instance's latency model, so they order calls the same)."""
        cluster = self._clusters.get(text)
        if cluster is None:
            try:
                cluster = parse_cluster(text, self.model, self.calibration)
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
                    [entry] * (max(slot, 0) + 1), f"{text} (stand-in)", calibration=self.calibration
                )
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
        for call_id, done in self._outbox.items():
            self._outbox[call_id] = dataclasses.replace(
                done,
                started_s=translate_time(done.started_s, old, new),
                finished_s=translate_time(done.finished_s, old, new),
            )
        self._queue_key = None  # queue keys were computed from the old times

    # ------------------------------------------------------------------ coordinator messages

    def dispatch(
        self,
        ticket: CallTicket,
        *,
        prompt: str = "",
        messages: Sequence[ChatMessage] = (),
        traceparent: str = "",
    ) -> DispatchOutcome:
        """A call dispatched here: queue it (once) and admit what fits. `messages` are a
        chat request's (`prompt` is then their plain rendering)."""
        call_id = ticket.call_id
        finished = self._outbox.get(call_id)
        if finished is not None:
            log.info("call %s dispatched again after it finished: resending its result", call_id)
            # The result answers the latest dispatch: the coordinator accepts only that one.
            finished = self._outbox[call_id] = dataclasses.replace(finished, attempt=ticket.attempt)
            self._send(finished)
            return DispatchOutcome.RESENT
        held = self._calls.get(call_id)
        if held is not None:
            log.info("call %s dispatched again while it is here: ignored", call_id)
            held.ticket.attempt = max(held.ticket.attempt, ticket.attempt)
            return DispatchOutcome.DUPLICATE
        if self.scheduler is None or self.clock is None:
            raise RuntimeError("a dispatch before the welcome")
        now = self.clock.now()
        tokens = ticket.call.input_tokens + ticket.call.output_tokens
        if tokens > self.kv_cache_tokens:
            self.fail(
                call_id,
                f"{tokens} tokens can never fit {self.kv_cache_tokens} KV tokens",
                attempt=ticket.attempt,
            )
            return DispatchOutcome.REJECTED
        if not self.accepting:
            log.info("call %s dispatched while stopping: not taken", call_id)
            return DispatchOutcome.REJECTED
        span = self._tracer.start_span(
            f"worker call {ticket.call.step}",
            context=context_from_traceparent(traceparent),
            attributes={
                "hexgen.call_id": call_id,
                "hexgen.query_id": ticket.query_id,
                "hexgen.step": ticket.call.step,
                "hexgen.input_tokens": ticket.call.input_tokens,
                "hexgen.output_tokens": ticket.call.output_tokens,
                "hexgen.engine": self.engine.kind,
            },
        )
        self._calls[call_id] = _Call(ticket, now, span)
        if prompt:
            self.engine.prompts[call_id] = prompt
        if messages:
            self.engine.messages[call_id] = tuple(messages)
        self.scheduler.queue.push(ticket, now)
        self.admit_ready()
        return DispatchOutcome.QUEUED

    def fail(self, call_id: str, error: str, *, attempt: int = 0) -> None:
        """Report a call that cannot run here as failed (the coordinator retries it)."""
        log.warning("call %s failed here: %s", call_id, error)
        now = self.clock.now() if self.clock is not None else 0.0
        finished = CallFinished(call_id, 0, "", now, now, error, attempt)
        self._outbox[call_id] = finished
        self._send(finished)

    def cancel(self, call_id: str, *, reason: str = "cancelled") -> bool:
        """Forget a call: drop it from the queue or abort it in the engine (nothing is
        reported for it). False when the call is not here."""
        call = self._calls.pop(call_id, None)
        if call is None:
            return self._outbox.pop(call_id, None) is not None
        if call.status.is_queued:
            if self.scheduler is not None:
                self.scheduler.queue.remove(call.ticket)
            self.engine.prompts.pop(call_id, None)
            self.engine.messages.pop(call_id, None)
        else:
            self.engine.cancel(call_id)
        call.span.set_attribute("hexgen.cancelled", reason)
        call.span.end()
        self.admit_ready()
        return True

    def update_deadline(self, call_id: str, deadline_s: float) -> bool:
        """New stage deadline for a call; a queued call moves to its new place in the queue.
        False when the call is not here."""
        call = self._calls.get(call_id)
        if call is None:
            return False
        ticket = call.ticket
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

    def ack(self, call_ids: Iterable[str]) -> None:
        """The coordinator recorded these completions: forget them."""
        for call_id in call_ids:
            self._outbox.pop(call_id, None)

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
        if isinstance(event, CallStarted):
            call.started_s = event.started_s
            self._send(event)
        elif isinstance(event, CallTokens):
            self._send(event)
        else:
            del self._calls[event.call_id]
            event = dataclasses.replace(event, attempt=call.ticket.attempt)
            self._outbox[event.call_id] = event
            span = call.span
            queue_wait_s = event.started_s - call.queued_s
            execution_s = event.finished_s - event.started_s
            span.set_attribute("hexgen.queue_wait_s", queue_wait_s)
            span.set_attribute("hexgen.execution_s", execution_s)
            span.set_attribute("hexgen.generated_tokens", event.output_tokens)
            if self.metrics is not None:
                self.metrics.call_ended(
                    queue_wait_s, execution_s, event.output_tokens, failed=bool(event.error)
                )
            if event.error:
                span.set_status(Status(StatusCode.ERROR, event.error))
            span.end()
            self._send(event)
            self.admit_ready()

    async def run_engine_events(self) -> None:
        """Consume the engine's events for ever (run as a task; cancel to stop)."""
        while True:
            self.on_engine_event(await self.engine.next_event())

    def close(self) -> None:
        """End the spans of the calls still held (the worker is stopping)."""
        for call in self._calls.values():
            call.span.set_attribute("hexgen.abandoned", True)
            call.span.end()
