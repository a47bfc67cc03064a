"""Runtime state that policies read: released calls, running queries, per-instance load.

These are the few mutable objects the policies see. The simulator creates and updates them;
the services will too. They are plain slotted classes, not dataclasses, because the
simulator touches them on every call and attribute access is the hot path.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import random
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

from hexgen_flow.cluster import Cluster
from hexgen_flow.estimate import Estimator
from hexgen_flow.prefix import PrefixHomes
from hexgen_flow.workload import LLMCall, Query, Stage, Workflow

__all__ = [
    "CallState",
    "CallTicket",
    "ClusterLoad",
    "CompletionEffect",
    "PolicyContext",
    "QueryRun",
    "QueryState",
]


class QueryState(enum.Enum):
    """A query's lifecycle in the scheduler (`hexgen_flow.protocol`)."""

    WAITING = "waiting"
    """Admitted best-effort and held: nothing released until the driver says `Start`."""
    RUNNING = "running"
    """Its stages are being released and run."""
    FINISHED = "finished"
    """Its last call finished."""
    ENDED = "ended"
    """Ended early (failed or cancelled): its calls were withdrawn."""


class CallState(enum.Enum):
    """A released call's lifecycle in the scheduler (`hexgen_flow.protocol`)."""

    HELD = "held"
    """A workflow session's call whose prompt has not been given yet."""
    PARKED = "parked"
    """No instance can take it now: it waits in release order for one."""
    RESERVED = "reserved"
    """After a restart, on no ledger while the worker that held it may reclaim it."""
    QUEUED = "queued"
    """Dispatched to `instance` and not started there: its deadline may change, it may move."""
    RUNNING = "running"
    """Its engine started it: it stays where it is."""
    BACKOFF = "backoff"
    """An attempt failed (engine error, lost worker): off every ledger until the driver
    sends it again (`Redispatch`) after its backoff."""
    DONE = "done"
    """Finished (or skipped): its stage counted it."""
    DROPPED = "dropped"
    """Its query ended early."""


_QUEUED: Final = CallState.QUEUED  # read once: an enum member read through its class is a call


class CompletionEffect(NamedTuple):
    """What one finished call does to its query (`QueryRun.completion_effect`)."""

    finishes_stage: bool
    released: tuple[int, ...]
    """The stages its stage's finishing releases (in the workflow's dependents order)."""
    finishes_query: bool


class QueryRun:
    """A query being executed: its deadline and which stages are done."""

    __slots__ = (
        "arrival_s",
        "best_effort",
        "budget_state",
        "calls_left",
        "deadline_s",
        "deps_left",
        "finished_s",
        "given",
        "index",
        "query",
        "slo_s",
        "stage_calls_left",
        "stage_finished_s",
        "stage_released_s",
        "state",
    )

    def __init__(self, query: Query, index: int, arrival_s: float, slo_s: float) -> None:
        stages = query.workflow.stages
        self.query = query
        self.index = index
        """Position in the run's query list: the tie-breaker between queries."""
        self.arrival_s = arrival_s
        self.slo_s = slo_s
        self.deadline_s = arrival_s + slo_s
        """Absolute end-to-end deadline."""
        self.deps_left = [len(s.after) for s in stages]
        self.stage_calls_left = [len(s.calls) for s in stages]
        self.calls_left = query.workflow.num_calls
        self.stage_released_s: list[float | None] = [None] * len(stages)
        self.stage_finished_s: list[float | None] = [None] * len(stages)
        self.finished_s: float | None = None
        self.budget_state: Any = None
        """Owned by the run's StageBudget policy (e.g. the query's own template copy)."""
        self.given: list[int] | None = None
        """A workflow session's calls given so far per stage (`give`); None: every call's
        prompt came with the query. A released call beyond its stage's count waits."""
        self.state = QueryState.RUNNING
        """Where the query is in its lifecycle (`hexgen_flow.protocol` moves it)."""
        self.best_effort = False
        """Admitted best-effort: its calls come after every query held to its SLO
        (`hexgen_flow.protocol.Submit`)."""

    def start_session(self) -> None:
        """Make this run a workflow session: its calls wait until `give` supplies them, and
        it does not finish while the session is open (`end_session` lifts that hold)."""
        self.given = [0] * len(self.query.workflow.stages)
        self.calls_left += 1

    def end_session(self, now: float) -> None:
        """The session takes no more calls: the query finishes with its last call (at
        `now` if none is left)."""
        self.calls_left -= 1
        if self.calls_left == 0:
            self.finished_s = now

    def is_given(self, stage: int, index: int) -> bool:
        return self.given is None or index < self.given[stage]

    def give(self, stage: int, call: LLMCall) -> int:
        """A session's client supplies the next call of `stage`: it replaces the expected
        call there, or joins the stage when every expected one is given. Returns its index
        within the stage. The stage must not have finished."""
        assert self.given is not None, "give() is for workflow sessions"
        assert self.stage_finished_s[stage] is None, "the stage has finished"
        index = self.given[stage]
        calls = list(self.query.workflow.stages[stage].calls)
        if index < len(calls):
            calls[index] = call
        else:
            calls.append(call)
            self.stage_calls_left[stage] += 1
            self.calls_left += 1
        self.given[stage] = index + 1
        self._replace_stage(stage, tuple(calls))
        return index

    def add_stage(self, call: LLMCall) -> int:
        """A session's client names a stage the workflow does not expect: it is added at
        the end with this one call, waiting for nothing. Returns its index."""
        assert self.given is not None, "add_stage() is for workflow sessions"
        stages = (*self.query.workflow.stages, Stage(step=call.step, calls=(call,)))
        self.query = dataclasses.replace(self.query, workflow=Workflow(stages))
        self.deps_left.append(0)
        self.stage_calls_left.append(1)
        self.calls_left += 1
        self.stage_released_s.append(None)
        self.stage_finished_s.append(None)
        self.given.append(1)
        self.finished_s = None
        return len(stages) - 1

    def _replace_stage(self, stage: int, calls: tuple[LLMCall, ...]) -> None:
        stages = list(self.query.workflow.stages)
        stages[stage] = dataclasses.replace(stages[stage], calls=calls)
        self.query = dataclasses.replace(self.query, workflow=Workflow(tuple(stages)))

    @property
    def tenant(self) -> str:
        return self.query.tenant

    def completion_effect(self, stage: int) -> CompletionEffect:
        """What one more finished call of `stage` does, changing nothing: the workflow's
        release rule, its one implementation. A stage finishes with its last call; a
        stage is released when every stage it waits for has finished; the query finishes
        with its last call (a session's open hold counts as one). `complete_call` applies
        it; the coordinator hands it to Redis's completion script, which applies it too
        and decides nothing."""
        if self.stage_calls_left[stage] != 1:
            return CompletionEffect(False, (), self.calls_left == 1)
        deps = self.deps_left
        released = tuple(j for j in self.query.workflow.dependents[stage] if deps[j] == 1)
        return CompletionEffect(True, released, self.calls_left == 1)

    def complete_call(
        self, stage: int, now: float, effect: CompletionEffect | None = None
    ) -> list[int]:
        """Record that one call of `stage` finished at `now`; return the stages it releases.
        `effect`: what `completion_effect(stage)` gave the driver, which applied it
        elsewhere first (the coordinator, in Redis); the very same effect is applied here,
        not evaluated again. None: evaluated now."""
        if effect is None:
            effect = self.completion_effect(stage)
        self.stage_calls_left[stage] -= 1
        if effect.finishes_stage:
            self.stage_finished_s[stage] = now
            deps = self.deps_left
            for j in self.query.workflow.dependents[stage]:
                deps[j] -= 1
        self.calls_left -= 1
        if effect.finishes_query:
            self.finished_s = now
        return list(effect.released)


class CallTicket:
    """One released LLM call on its way through dispatch, a local queue and an engine.

    Queue policies read only the ticket's own fields, never `run`: a worker holds tickets
    for calls whose query lives in the coordinator (`CallTicket.detached`).
    """

    __slots__ = (
        "admitted_s",
        "attempt",
        "cached_tokens",
        "call",
        "call_id",
        "deadline_s",
        "finished_s",
        "first_token_s",
        "index",
        "instance",
        "key",
        "output_tokens",
        "query_deadline_s",
        "query_id",
        "query_seq",
        "released_s",
        "remaining_after_s",
        "run",
        "scheduled_s",
        "seq",
        "stage",
        "state",
        "tenant",
        "weight",
        "work_s",
    )

    def __init__(
        self,
        seq: int,
        run: QueryRun | None,
        stage: int,
        call: LLMCall,
        released_s: float,
        deadline_s: float,
        remaining_after_s: float = 0.0,
        index: int = 0,
    ) -> None:
        self.seq = seq
        """Global release order; every policy breaks ties on it."""
        self.run: QueryRun | None = run
        """The query's runtime state where the driver keeps it (simulator, coordinator);
        None for a detached ticket (`detached` sets the query's fields)."""
        if run is not None:
            self.query_id = run.query.query_id
            self.query_seq = run.index
            """Arrival order of the query: the client key of fairness policies."""
            self.tenant = run.query.tenant
            self.query_deadline_s = run.deadline_s
        else:
            self.query_id = ""
            self.query_seq = 0
            self.tenant = ""
            self.query_deadline_s = deadline_s
        self.remaining_after_s = remaining_after_s
        """Estimated time the query still needs after this call's stage (its longest path)."""
        self.stage = stage
        self.index = index
        """Position of the call within its stage."""
        self.call = call
        """The call as the scheduler believes it (`hexgen_flow.lengths`: its output tokens may
        be a prediction)."""
        self.output_tokens = call.output_tokens
        """The output tokens the call really generates: what an engine runs (the simulator
        sets it from the workload when the scheduler only predicts lengths; a coordinator
        from what the worker reported)."""
        self.call_id = ""
        """Identifier across processes (the services set it; the simulator needs none)."""
        self.released_s = released_s
        """a_r: when the call was released (and dispatched)."""
        self.deadline_s = deadline_s
        """Absolute stage deadline set by the StageBudget policy."""
        self.instance = -1
        """Instance chosen by the dispatcher."""
        self.work_s = 0.0
        """Estimated single-request time on the chosen instance (outstanding-work ledger)."""
        self.weight = 1.0
        """What a second of delay to this call costs, as its dispatcher weighs it
        (`Dispatcher.weight`, set with `instance`): the weighted ledger sums it."""
        self.key: Any = None
        """Owned by the local queue holding the ticket (its ordering key)."""
        self.admitted_s: float | None = None
        self.finished_s: float | None = None
        self.cached_tokens = 0
        """Prompt tokens the engine found cached when it started the call (engine models
        with prefix caching set it; a cost learner reads it)."""
        self.scheduled_s: float | None = None
        """When the engine first scheduled the call (its first prefill step): an engine
        that keeps a waiting list of its own sets it; `admitted_s` otherwise."""
        self.first_token_s: float | None = None
        """When the engine produced the call's first output token (the end of its prompt's
        last prefill step): engine models that know set it; a cost learner reads it, to
        tell prefill from decode."""
        self.attempt = 0
        """Dispatches of the call so far (the services count them; a completion names its own)."""
        self.state = _QUEUED
        """Where the call is in its lifecycle (`hexgen_flow.protocol` moves it)."""

    @classmethod
    def detached(
        cls,
        *,
        seq: int,
        call_id: str,
        query_id: str,
        query_seq: int,
        tenant: str,
        stage: int,
        call: LLMCall,
        released_s: float,
        deadline_s: float,
        query_deadline_s: float,
        remaining_after_s: float,
        attempt: int = 0,
        weight: float = 1.0,
        output_tokens: int | None = None,
    ) -> CallTicket:
        """A ticket without its query's runtime state: what a worker's queue holds.
        `output_tokens`: what its engine is asked to generate (default: `call`'s, which
        is what the queue plans with)."""
        # Through __init__ (a class compiled by mypyc has no bare __new__), then the fields
        # that differ from a query-owned ticket's.
        ticket = cls(seq, None, stage, call, released_s, deadline_s, remaining_after_s)
        ticket.query_id = query_id
        ticket.query_seq = query_seq
        ticket.tenant = tenant
        ticket.query_deadline_s = query_deadline_s
        if output_tokens is not None:
            ticket.output_tokens = output_tokens
        ticket.call_id = call_id
        ticket.weight = weight
        ticket.attempt = attempt
        return ticket

    def asked(self) -> LLMCall:
        """The call as its engine is asked to run it: `call` with `output_tokens` (what a
        driver's engine generates, or the declared cap; `call` may hold a belief)."""
        call = self.call
        if call.output_tokens == self.output_tokens:
            return call
        return dataclasses.replace(call, output_tokens=self.output_tokens)

    def __repr__(self) -> str:
        return f"CallTicket(seq={self.seq}, q={self.query_id}, step={self.call.step})"


def _non_negative(value: float) -> float:
    """`value`, or 0 when it is negative or not finite (a report from another process)."""
    return value if math.isfinite(value) and value > 0.0 else 0.0


class ClusterLoad:
    """Per-instance load ledger that the dispatchers read.

    `in_flight` counts calls dispatched to an instance and not yet finished (queued or
    running); `outstanding_s` is their estimated single-request time on that instance;
    `weight_in_flight` and `weighted_outstanding_s` the same two sums with each call
    weighted by `CallTicket.weight` (this driver's calls only; other drivers' are
    `others_weight` and `others_weighted_outstanding_s`, as reported);
    `tokens_in_flight` their prompt and output tokens (the KV blocks they hold or will);
    `prefix_homes` where each query's calls of each step type last went (prefix-aware
    dispatch reads it through `prefix_home`). The driver calls `on_dispatch` and
    `on_complete`, and sets `prefix_caching`; nothing else writes here, except
    `report_others` where other drivers share the instances.

    Other drivers: coordinator shards share their workers, so an instance also runs calls
    that another shard dispatched. `report_others` adds what the instance last reported of
    those to `in_flight`, `outstanding_s` and `tokens_in_flight`, so that every policy
    reading them sees the whole instance, and keeps their weighted sums apart (a weighing
    dispatcher reads them; 0 when not reported); the simulator has one driver and never
    calls it.
    """

    __slots__ = (
        "all_available",
        "available",
        "cluster",
        "in_flight",
        "kv_tokens",
        "min_kv_tokens",
        "others_in_flight",
        "others_outstanding_s",
        "others_reported",
        "others_tokens",
        "others_weight",
        "others_weighted_outstanding_s",
        "outstanding_kv_s",
        "outstanding_s",
        "prefix_caching",
        "prefix_homes",
        "tokens_in_flight",
        "weight_in_flight",
        "weighted_outstanding_s",
    )

    def __init__(self, cluster: Cluster) -> None:
        n = len(cluster)
        self.cluster = cluster
        self.in_flight = [0] * n
        self.outstanding_s = [0.0] * n
        self.outstanding_kv_s = [0.0] * n
        """KV-token-seconds in flight: sum of (input + output tokens) x work_s."""
        self.tokens_in_flight = [0] * n
        self.weight_in_flight = [0.0] * n
        """Sum of `CallTicket.weight` over this driver's calls in flight."""
        self.weighted_outstanding_s = [0.0] * n
        """Sum of weight x work_s over this driver's calls in flight."""
        self.prefix_homes = PrefixHomes()
        self.prefix_caching = True
        """Whether the engines cache prompt prefixes (vLLM V1's default); the driver sets it
        (the simulator from its engine model). Off, no instance is a prefix home."""
        self.kv_tokens = [inst.kv_cache_tokens for inst in cluster.instances]
        self.min_kv_tokens = min(self.kv_tokens)
        self.available = [True] * n
        """Whether an instance takes new calls (a service's worker may be away)."""
        self.all_available = True
        self.others_in_flight = [0] * n
        """Of `in_flight`: calls other drivers put on the instance (`report_others`)."""
        self.others_outstanding_s = [0.0] * n
        """Of `outstanding_s`: those calls' estimated single-request seconds."""
        self.others_tokens = [0] * n
        """Of `tokens_in_flight`: those calls' input + output tokens."""
        self.others_weight = [0.0] * n
        """Those calls' weights summed (0: not reported, e.g. by an older worker)."""
        self.others_weighted_outstanding_s = [0.0] * n
        """Those calls' weight x estimated seconds summed (0: not reported)."""
        self.others_reported = False
        """Whether `report_others` was ever called: False, every `others_*` entry is 0 (a
        dispatcher skips their terms without reading them; read-only outside)."""

    def on_dispatch(self, ticket: CallTicket) -> None:
        i = ticket.instance
        work, weight = ticket.work_s, ticket.weight
        self.in_flight[i] += 1
        self.outstanding_s[i] += work
        call = ticket.call
        tokens = call.input_tokens + call.output_tokens
        self.outstanding_kv_s[i] += tokens * work
        self.tokens_in_flight[i] += tokens
        self.weight_in_flight[i] += weight
        self.weighted_outstanding_s[i] += weight * work
        self.prefix_homes.put(ticket.query_id, call.step, i)

    def on_complete(self, ticket: CallTicket) -> None:
        i = ticket.instance
        work, weight = ticket.work_s, ticket.weight
        in_flight = self.in_flight
        in_flight[i] -= 1
        self.outstanding_s[i] -= work
        call = ticket.call
        tokens = call.input_tokens + call.output_tokens
        self.outstanding_kv_s[i] -= tokens * work
        self.tokens_in_flight[i] -= tokens
        self.weight_in_flight[i] -= weight
        self.weighted_outstanding_s[i] -= weight * work
        if in_flight[i] == self.others_in_flight[i]:
            # none of ours left: no float drift on an instance idle for us
            self.outstanding_s[i] = self.others_outstanding_s[i]
            self.outstanding_kv_s[i] = 0.0
            self.weight_in_flight[i] = 0.0
            self.weighted_outstanding_s[i] = 0.0

    def report_others(
        self,
        instance: int,
        in_flight: int,
        outstanding_s: float,
        tokens: int,
        weight: float = 0.0,
        weighted_outstanding_s: float = 0.0,
    ) -> None:
        """What other drivers have in flight on `instance` now (its latest report): replaces
        the previous report in `in_flight`, `outstanding_s` and `tokens_in_flight`, and in
        `others_weight` and `others_weighted_outstanding_s` (0: not reported). Their
        KV-token-seconds are not reported: `outstanding_kv_s` stays this driver's own."""
        i = instance
        self.others_reported = True
        in_flight, tokens = max(in_flight, 0), max(tokens, 0)
        outstanding_s = _non_negative(outstanding_s)
        self.in_flight[i] += in_flight - self.others_in_flight[i]
        self.outstanding_s[i] += outstanding_s - self.others_outstanding_s[i]
        self.tokens_in_flight[i] += tokens - self.others_tokens[i]
        self.others_in_flight[i] = in_flight
        self.others_outstanding_s[i] = outstanding_s
        self.others_tokens[i] = tokens
        self.others_weight[i] = _non_negative(weight) if in_flight else 0.0
        self.others_weighted_outstanding_s[i] = (
            _non_negative(weighted_outstanding_s) if in_flight else 0.0
        )

    def prefix_home(self, ticket: CallTicket) -> int | None:
        """The instance that probably caches `ticket`'s shared prompt prefix: where its
        query's last call of the same step type went; None if none, or no engine caches."""
        if not self.prefix_caching:
            return None
        return self.prefix_homes.get(ticket.query_id, ticket.call.step)

    def set_available(self, instance: int, available: bool) -> None:
        self.available[instance] = available
        self.all_available = all(self.available)

    def can_serve(self, instance: int, call: LLMCall) -> bool:
        """The dispatch filter: the instance is available and its KV cache can hold the call."""
        return (
            self.available[instance]
            and call.input_tokens + call.output_tokens <= self.kv_tokens[instance]
        )

    def fits_everywhere(self, call: LLMCall) -> bool:
        """Fast path of the filter: every instance can serve the call."""
        return self.all_available and call.input_tokens + call.output_tokens <= self.min_kv_tokens


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """What every policy may read besides the tickets: injected, never global."""

    cluster: Cluster
    estimator: Estimator
    load: ClusterLoad
    rng: random.Random
    """Seeded by the run; the only source of randomness a policy may use."""
