"""The two levels of scheduling, as objects every driver shares.

`GlobalScheduler` is the coordinator's brain: it admits queries, releases their stages as
dependencies finish (setting each stage's budget) and dispatches every released call to an
instance. `InstanceScheduler` is one instance's admission: its local queue in front of its
engine's capacity. The simulator drives both in simulated time; the coordinator service
drives a `GlobalScheduler` and each worker service an `InstanceScheduler`, in real time.
"""

from __future__ import annotations

import random
from typing import Protocol

from hexgen_flow.cluster import Cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.estimate import Estimator
from hexgen_flow.policies.base import Dispatcher, LocalQueue, NoInstanceError, StageBudget
from hexgen_flow.policies.presets import Preset
from hexgen_flow.policies.registration import BUDGETS, DISPATCHERS, QUEUES
from hexgen_flow.runtime import CallTicket, ClusterLoad, PolicyContext, QueryRun
from hexgen_flow.workload import LLMCall, Query

__all__ = ["AdmissionEngine", "GlobalScheduler", "InstanceScheduler"]


class GlobalScheduler:
    """Admission, stage release, stage budgets and dispatch for one cluster and preset."""

    def __init__(
        self,
        cluster: Cluster,
        preset: Preset,
        *,
        seed: int = 0,
        estimator: Estimator | None = None,
    ) -> None:
        self.cluster = cluster
        self.preset = preset
        self.estimator = estimator or Estimator(cluster)
        self.load = ClusterLoad(cluster)
        self.ctx = PolicyContext(cluster, self.estimator, self.load, random.Random(seed))
        self.dispatcher: Dispatcher = DISPATCHERS.create(
            preset.dispatch.name, self.ctx, params=preset.dispatch.params
        )
        self.budget: StageBudget = BUDGETS.create(
            preset.budget.name, self.ctx, params=preset.budget.params
        )
        self.next_seq = 0
        """Sequence number of the next released call (release order across queries)."""
        self.slo_base_s = self.estimator.slo_base()
        """SLO_base of this cluster (docs/algorithm.md §5)."""

    def make_queue(self, instance: int) -> LocalQueue:
        """The preset's local queue for `instance` (used where the instance runs)."""
        return QUEUES.create(
            self.preset.queue.name, self.ctx, instance, params=self.preset.queue.params
        )

    @property
    def alpha(self) -> float | None:
        alpha = getattr(self.dispatcher, "alpha", None)
        return float(alpha) if alpha is not None else None

    def set_alpha(self, alpha: float) -> None:
        """Change the dispatcher's α from now on (the online tuner's knob)."""
        if not hasattr(self.dispatcher, "alpha"):
            raise ConfigError(f"policy {self.preset.name!r} has no alpha")
        if not 0.0 <= alpha <= 1.0:
            raise ConfigError(f"alpha must be in [0, 1], got {alpha}")
        self.dispatcher.alpha = alpha

    def slo_of(self, query: Query, default_scale: float) -> float:
        """A query's end-to-end SLO: its own, or its (else the run's) scale x SLO_base."""
        if query.slo_s is not None:
            return query.slo_s
        scale = query.slo_scale if query.slo_scale is not None else default_scale
        return scale * self.slo_base_s

    def oversized_call(self, query: Query) -> tuple[int, int, LLMCall] | None:
        """(stage, call index, call) of the first call no instance's KV cache can hold."""
        biggest = max(self.load.kv_tokens)
        for k, stage in enumerate(query.workflow.stages):
            for c, call in enumerate(stage.calls):
                if call.input_tokens + call.output_tokens > biggest:
                    return k, c, call
        return None

    def admit(self, query: Query, index: int, arrival_s: float, slo_s: float) -> QueryRun:
        """Start a query; release its root stages with `release`."""
        run = QueryRun(query, index, arrival_s, slo_s)
        self.budget.start(run)
        return run

    def release(self, run: QueryRun, stage: int, now: float) -> list[CallTicket]:
        """Release a stage: set its budget, make a ticket per call and dispatch each.

        A ticket no instance can take right now keeps ``instance == -1``; the caller holds
        it and calls `dispatch` again when an instance comes back.
        """
        run.stage_released_s[stage] = now
        deadline = self.budget.deadline(run, stage, now)
        plan = self.estimator.plan(run.query.workflow, "call")
        remaining = plan.tail_s[stage] - plan.stage_s[stage]
        tickets = []
        for call in run.query.workflow.stages[stage].calls:
            ticket = CallTicket(self.next_seq, run, stage, call, now, deadline, remaining)
            self.next_seq += 1
            try:  # noqa: SIM105 - contextlib.suppress costs a context manager per call here
                self.dispatch(ticket, now)
            except NoInstanceError:
                pass  # parked: instance stays -1
            tickets.append(ticket)
        return tickets

    def dispatch(self, ticket: CallTicket, now: float) -> int:
        """Choose the ticket's instance and charge it to the load ledger."""
        i = self.dispatcher.select(ticket, now)
        ticket.instance = i
        ticket.work_s = self.estimator.call_time(i, ticket.call)
        self.load.on_dispatch(ticket)
        return i

    def withdraw(self, ticket: CallTicket) -> None:
        """Take a dispatched ticket off its instance's ledger (before redispatching it)."""
        if ticket.instance >= 0:
            self.load.on_complete(ticket)
            ticket.instance = -1

    def complete(self, ticket: CallTicket, now: float) -> list[CallTicket]:
        """A call finished: update the ledger and the query; return the calls it releases.

        A ticket that is on no instance's ledger (a service resuming calls that finished
        while it was down) only updates the query.
        """
        if ticket.instance >= 0:
            self.load.on_complete(ticket)
        run = ticket.run
        assert run is not None, "complete() needs the ticket's QueryRun"
        released: list[CallTicket] = []
        for stage in run.complete_call(ticket.stage, now):
            released.extend(self.release(run, stage, now))
        return released


class AdmissionEngine(Protocol):
    """What an instance's engine offers its admission loop."""

    def fits(self, ticket: CallTicket) -> bool:
        """Whether the engine can start the ticket now."""
        ...

    def admit(self, ticket: CallTicket, now: float) -> None:
        """Start the ticket (the caller checked `fits`)."""
        ...


class InstanceScheduler:
    """One instance: its local queue in front of its engine's admission check."""

    __slots__ = ("engine", "queue")

    def __init__(self, queue: LocalQueue, engine: AdmissionEngine) -> None:
        self.queue = queue
        self.engine = engine

    def admit_ready(self, now: float) -> list[CallTicket]:
        """Admit waiting calls in queue order while the engine has room; return them.

        Head-of-line: when the queue's choice does not fit, nothing jumps it, so an urgent
        large call is not starved by a stream of small ones.
        """
        queue, engine = self.queue, self.engine
        admitted: list[CallTicket] = []
        while True:
            ticket = queue.peek(now)  # None when empty
            if ticket is None or not engine.fits(ticket):
                break
            queue.pop(now)
            engine.admit(ticket, now)
            queue.on_admit(ticket, now)
            admitted.append(ticket)
        return admitted
