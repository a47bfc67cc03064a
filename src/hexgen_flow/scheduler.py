"""The two levels of scheduling, as objects every driver shares.

`GlobalScheduler` holds the policies: it admits queries, releases their stages as
dependencies finish (setting each stage's budget) and dispatches every released call to an
instance. `InstanceScheduler` is one instance's admission: its local queue in front of its
engine's capacity. Drivers reach a `GlobalScheduler` through the scheduling protocol
(`hexgen_flow.protocol.Scheduler`: events in, actions out), the simulator in simulated time
and the coordinator service in real time; each worker service and each simulated instance
runs an `InstanceScheduler`.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from hexgen_flow.alpha import alpha_problem
from hexgen_flow.cluster import Cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.estimate import Estimator
from hexgen_flow.learning import CallCost, CostLearner, LearnerSettings
from hexgen_flow.policies.base import Dispatcher, LocalQueue, NoInstanceError, StageBudget
from hexgen_flow.policies.presets import Preset
from hexgen_flow.policies.registration import BUDGETS, DISPATCHERS, QUEUES
from hexgen_flow.runtime import (
    CallState,
    CallTicket,
    ClusterLoad,
    CompletionEffect,
    PolicyContext,
    QueryRun,
)
from hexgen_flow.workload import LLMCall, Query

__all__ = [
    "AdmissionEngine",
    "CallMoved",
    "DeadlineChanged",
    "GlobalScheduler",
    "InstanceScheduler",
    "WaitingAction",
]


@dataclass(frozen=True, slots=True)
class DeadlineChanged:
    """A waiting call's stage deadline changed: its instance re-orders its queue."""

    ticket: CallTicket
    deadline_s: float


@dataclass(frozen=True, slots=True)
class CallMoved:
    """A waiting call moves from `source` to `target`, where it meets its new deadline and
    where it waits would not (the ledger already charges `target`)."""

    ticket: CallTicket
    source: int
    target: int
    deadline_s: float


WaitingAction = DeadlineChanged | CallMoved
"""What `GlobalScheduler.revise_waiting` tells a driver to carry out."""


class GlobalScheduler:
    """Admission, stage release, stage budgets and dispatch for one cluster and preset."""

    def __init__(
        self,
        cluster: Cluster,
        preset: Preset,
        *,
        seed: int = 0,
        estimator: Estimator | None = None,
        slo_base_s: float | None = None,
        prefix_caching: bool = True,
    ) -> None:
        self.cluster = cluster
        self.preset = preset
        self.estimator = estimator or Estimator(cluster)
        self.load = ClusterLoad(cluster)
        self.load.prefix_caching = prefix_caching
        """Whether the engines cache prompt prefixes: dispatch then counts a query's
        repeated prefix as cached where its earlier call of the step ran. The simulator
        sets it from its engine model, the coordinator from ``--prefix-caching``."""
        self.ctx = PolicyContext(cluster, self.estimator, self.load, random.Random(seed))
        self.dispatcher: Dispatcher = DISPATCHERS.create(
            preset.dispatch.name, self.ctx, params=preset.dispatch.params
        )
        self.budget: StageBudget = BUDGETS.create(
            preset.budget.name, self.ctx, params=preset.budget.params
        )
        # The completion hook, unless the dispatcher keeps the base class's (a no-op).
        hook = self.dispatcher.on_complete
        self._on_complete = (
            None if type(self.dispatcher).on_complete is Dispatcher.on_complete else hook
        )
        self.next_seq = 0
        """Sequence number of the next released call (release order across queries)."""
        self.learner: CostLearner | None = None
        """Learns each instance's costs from the calls it served (`learn_costs`); None:
        the calibration is believed as it is."""
        self.slo_base_s = self.estimator.slo_base() if slo_base_s is None else slo_base_s
        """SLO_base of this cluster (docs/algorithm.md §5): by the scheduler's own latency
        models unless the driver gives it (a simulation whose engines run other models takes
        the SLO from what they run, so that a query's SLO does not depend on a belief)."""

    def learn_costs(self, settings: LearnerSettings | None = None) -> CostLearner:
        """From now on, learn each instance's latency model from the calls it serves
        (`observe_cost`), with the cluster's calibration as the prior."""
        self.learner = CostLearner(self.cluster, settings)
        return self.learner

    def observe_cost(self, cost: CallCost) -> bool:
        """A call finished and its driver measured what it cost (`CallCost`). When the
        learner's factors for its instance moved, every estimate, the dispatcher's and the
        stage budget's tables follow from now on (calls already placed keep their
        charges). True when they did. Without `learn_costs`, does nothing."""
        learner = self.learner
        if learner is None or not learner.observe(cost):
            return False
        self.estimator.recalibrate(cost.instance, learner.model(cost.instance))
        self.dispatcher.costs_changed()
        self.budget.costs_changed()
        return True

    def believed_cluster(self) -> Cluster:
        """The cluster as this scheduler believes it now: each instance's calibration,
        scaled by what was learned of its costs (`learn_costs`), the model every estimate
        uses. What a tuner replays."""
        learner = self.learner
        if learner is None:
            return self.cluster
        return self.cluster.with_learned([(f.prefill, f.decode) for f in learner.factors()])

    def restore_costs(self, states: Mapping[str, str]) -> list[int]:
        """Carry on learning from states a restarted driver kept (`CostLearner.states`):
        the instances restored believe what was learned at once. Without `learn_costs`,
        does nothing."""
        learner = self.learner
        if learner is None:
            return []
        restored = learner.restore(self.cluster, states)
        for i in restored:
            self.estimator.recalibrate(i, learner.model(i))
        if restored:
            self.dispatcher.costs_changed()
            self.budget.costs_changed()
        return restored

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
        if (problem := alpha_problem(alpha)) is not None:
            raise ConfigError(f"alpha {problem}, got {alpha}")
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
        workflow = run.query.workflow
        plan = self.estimator.plan(workflow, "call")
        remaining = plan.tail_s[stage] - plan.stage_s[stage]
        tickets = []
        given = run.given
        dispatcher = self.dispatcher
        select, weight = dispatcher.select, dispatcher.weight
        call_time, on_dispatch = self.estimator.call_time, self.load.on_dispatch
        for index, call in enumerate(workflow.stages[stage].calls):
            ticket = CallTicket(self.next_seq, run, stage, call, now, deadline, remaining, index)
            self.next_seq += 1
            tickets.append(ticket)
            if given is not None and index >= given[stage]:
                ticket.state = CallState.HELD  # a session's call not given yet
                continue
            try:  # `dispatch`, inlined: this runs for every call
                i = select(ticket, now)
            except NoInstanceError:
                ticket.state = CallState.PARKED  # instance stays -1
                continue
            # `charge`, inlined (the same three steps, in its order)
            ticket.instance = i
            ticket.work_s = call_time(i, call)
            ticket.weight = weight(ticket, now)
            on_dispatch(ticket)
        return tickets

    def dispatch(self, ticket: CallTicket, now: float) -> int:
        """Choose the ticket's instance and charge it to the load ledger."""
        i = self.dispatcher.select(ticket, now)
        self.charge(ticket, i, now)
        return i

    def charge(self, ticket: CallTicket, instance: int, now: float) -> None:
        """Put a ticket on `instance`'s ledger: its single-request time there and the weight
        its dispatcher gives it (a driver adopting a call it did not choose calls this too)."""
        ticket.instance = instance
        ticket.work_s = self.estimator.call_time(instance, ticket.call)
        ticket.weight = self.dispatcher.weight(ticket, now)
        self.load.on_dispatch(ticket)

    def rebudget(self, waiting: Sequence[CallTicket], now: float) -> list[CallTicket]:
        """A stage finished: give the calls still waiting (released, not started) the
        deadline their stage gets from the time left now (`StageBudget.revise`). Returns
        the tickets whose deadline changed; the driver tells their instances."""
        changed: list[CallTicket] = []
        revised: dict[tuple[int, int], float] = {}
        for ticket in waiting:
            run = ticket.run
            assert run is not None, "rebudget() needs the ticket's QueryRun"
            key = (id(run), ticket.stage)
            deadline = revised.get(key)
            if deadline is None:
                deadline = self.budget.revise(run, ticket.stage, now)
                revised[key] = deadline
            if abs(deadline - ticket.deadline_s) > 1e-9:
                ticket.deadline_s = deadline
                changed.append(ticket)
        return changed

    def revise_waiting(
        self,
        waiting: Sequence[CallTicket],
        now: float,
        movable: Callable[[int], bool] | None = None,
    ) -> tuple[WaitingAction, ...]:
        """A stage of their query finished: the calls of `waiting` (released, dispatched and
        not started: the driver knows which) get the deadline their stage gets from the time
        left now (`rebudget`); one that would then be late where it waits, and would not be
        on another instance, moves there (`better_instance`, `move`) when `movable` (default:
        every instance) accepts both ends. Returns what the driver carries out, in order:
        the simulator re-queues, the coordinator tells the workers. The one place this
        decision is made, for both."""
        actions: list[WaitingAction] = []
        for ticket in self.rebudget(waiting, now):
            here = ticket.instance
            better = None
            if here >= 0 and (movable is None or movable(here)):
                better = self.better_instance(ticket, now)
                if better is not None and movable is not None and not movable(better):
                    better = None
            if better is None:
                actions.append(DeadlineChanged(ticket, ticket.deadline_s))
            else:
                self.move(ticket, better)
                actions.append(CallMoved(ticket, here, better, ticket.deadline_s))
        return tuple(actions)

    def finish_estimate(self, ticket: CallTicket, instance: int, now: float) -> float:
        """When `ticket` would finish on `instance`: its single-request time after the
        instance's own outstanding work (what is in flight there besides this call,
        drained at the engine's concurrency)."""
        load = self.load
        backlog = load.outstanding_s[instance]
        if ticket.instance == instance:
            backlog -= ticket.work_s
        slots = max(1, self.cluster.instances[instance].max_batch)
        return now + max(backlog, 0.0) / slots + self.estimator.call_time(instance, ticket.call)

    def better_instance(self, ticket: CallTicket, now: float) -> int | None:
        """An instance where a waiting `ticket` meets its deadline when the one it waits
        on does not (the earliest such finish); None when it should stay."""
        here = ticket.instance
        if here < 0 or self.finish_estimate(ticket, here, now) <= ticket.deadline_s:
            return None
        best, best_finish = None, ticket.deadline_s
        for i in range(len(self.cluster)):
            if i == here or not self.load.can_serve(i, ticket.call):
                continue
            finish = self.finish_estimate(ticket, i, now)
            if finish <= best_finish:
                best, best_finish = i, finish
        return best

    def move(self, ticket: CallTicket, instance: int) -> None:
        """Take a dispatched ticket off its instance and charge it to `instance` (with the
        weight it has: a move changes where the call runs, not what its delay costs)."""
        self.withdraw(ticket)
        ticket.instance = instance
        ticket.work_s = self.estimator.call_time(instance, ticket.call)
        self.load.on_dispatch(ticket)

    def withdraw(self, ticket: CallTicket) -> None:
        """Take a dispatched ticket off its instance's ledger (before redispatching it)."""
        if ticket.instance >= 0:
            self.load.on_complete(ticket)
            ticket.instance = -1

    def complete(
        self, ticket: CallTicket, now: float, effect: CompletionEffect | None = None
    ) -> list[CallTicket]:
        """A call finished: update the ledger and the query; return the calls it releases.
        `effect`: the call's `QueryRun.completion_effect`, where the driver already
        evaluated it (`QueryRun.complete_call`).

        A ticket that is on no instance's ledger (a service resuming calls that finished
        while it was down) only updates the query.
        """
        if ticket.instance >= 0:
            self.load.on_complete(ticket)
            if self._on_complete is not None:
                self._on_complete(ticket, now)
        run = ticket.run
        assert run is not None, "complete() needs the ticket's QueryRun"
        # `call_done`, inlined: this runs for every call
        stages = run.complete_call(ticket.stage, now, effect)
        if not stages:
            return []
        released: list[CallTicket] = []
        for k in stages:
            released.extend(self.release(run, k, now))
        return released

    def call_done(self, run: QueryRun, stage: int, now: float) -> list[CallTicket]:
        """One call of `stage` is done (finished, or a session's skipped call that has no
        ticket): update the query; return the calls it releases."""
        released: list[CallTicket] = []
        for k in run.complete_call(stage, now):
            released.extend(self.release(run, k, now))
        return released

    def forget(self, query: Query) -> None:
        """`query` ended (any outcome): drop what the scheduler keeps for it, its cached plans
        and its prefix homes, so a long-running driver holds only the queries it runs. The
        driver calls it where it ends a query (the simulator when the last call finishes,
        the coordinator whatever the outcome)."""
        self.estimator.forget(query.workflow)
        self.load.prefix_homes.forget(query.query_id)

    def release_call(self, run: QueryRun, stage: int, index: int, now: float) -> CallTicket:
        """A ticket for a session's call given after its stage's release (a call beyond the
        stage's expected ones), with the deadline the stage gets from the time left now;
        dispatched when an instance can take it."""
        plan = self.estimator.plan(run.query.workflow, "call")
        call = run.query.workflow.stages[stage].calls[index]
        deadline = self.budget.revise(run, stage, now)
        remaining = plan.tail_s[stage] - plan.stage_s[stage]
        ticket = CallTicket(self.next_seq, run, stage, call, now, deadline, remaining, index)
        self.next_seq += 1
        with contextlib.suppress(NoInstanceError):
            self.dispatch(ticket, now)
        return ticket


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

    __slots__ = ("admit_hook", "engine", "queue")

    def __init__(self, queue: LocalQueue, engine: AdmissionEngine) -> None:
        self.queue = queue
        self.engine = engine
        hook = queue.on_admit
        self.admit_hook = None if type(queue).on_admit is LocalQueue.on_admit else hook
        """The queue's `on_admit`, unless it keeps the base class's (which does nothing):
        what `admit_ready` calls on each admitted ticket (read-only outside)."""

    def admit_ready(self, now: float) -> list[CallTicket]:
        """Admit waiting calls in queue order while the engine has room; return them.

        Head-of-line: when the queue's choice does not fit, nothing jumps it, so an urgent
        large call is not starved by a stream of small ones.
        """
        queue, engine, on_admit = self.queue, self.engine, self.admit_hook
        admitted: list[CallTicket] = []
        while True:
            ticket = queue.peek(now)  # None when empty
            if ticket is None or not engine.fits(ticket):
                break
            queue.pop(now)
            engine.admit(ticket, now)
            if on_admit is not None:
                on_admit(ticket, now)
            admitted.append(ticket)
        return admitted
