"""Discrete-event simulator: replays queries through the very policy objects the services use.

One heap of engine events ``(time, seq, instance, generation)``; query arrivals come from a
sorted list merged with the heap, engine events first on equal times. An engine event is
stale when its instance's generation moved on (its next event was re-planned after an
admission or a completion). Handling an event may release stages, which dispatch calls,
which mark instances dirty; after every event each dirty instance admits what its queue
and KV cache allow and re-plans its next event. Same inputs and seed, same run: byte for
byte (ties break on sequence numbers, randomness comes from one seeded generator).
"""

from __future__ import annotations

import gc
import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mypy_extensions import mypyc_attr  # scripts/compile_core.py

from hexgen_flow.cluster import Cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.estimate import Estimator
from hexgen_flow.lengths import (
    DEFAULT_MAX_TOKENS,
    MaxTokensBelief,
    OutputLengthPredictor,
    OutputLengths,
)
from hexgen_flow.metrics import QueryOutcome, RunMetrics
from hexgen_flow.policies.presets import Preset
from hexgen_flow.protocol import (
    Action,
    Admitted,
    CallMoved,
    DeadlineChanged,
    Finish,
    Scheduler,
    StageReleased,
    Submit,
)
from hexgen_flow.runtime import CallTicket, QueryRun
from hexgen_flow.scheduler import GlobalScheduler, InstanceScheduler
from hexgen_flow.sim.arrivals import arrival_times
from hexgen_flow.sim.engines import (
    DEFAULT_ENGINE_MODEL,
    EngineModel,
    create_engine_model,
    prefix_caching_of,
)
from hexgen_flow.sim.metering import MeteredEngine
from hexgen_flow.workload import Query

__all__ = ["SimConfig", "Simulation", "check_same_instances", "simulate"]


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Settings of one simulated run."""

    qps: float
    """Mean arrival rate of queries per second."""
    slo_scale: float = 3.0
    """A query's SLO is slo_scale x SLO_base unless the query says otherwise."""
    seed: int = 0
    """Seeds the arrival process and every policy's random generator."""
    arrival_cv: float = 1.0
    """Coefficient of variation of inter-arrival gaps (1 = Poisson, > 1 = bursty)."""
    engine: str = DEFAULT_ENGINE_MODEL
    """Engine model of every instance, by name (`hexgen_flow.sim.engines.ENGINE_MODELS`)."""
    prefix_caching: bool | None = None
    """Prefix caching in the engine model; None (the default) is the engine's own default,
    made explicit on construction: on for vllm-v1, as vLLM V1 serves; prefill-first has
    none (`hexgen_flow.sim.engines.prefix_caching_of`)."""
    output_lengths: OutputLengths = OutputLengths.KNOWN
    """What the scheduler knows of each call's output length (`hexgen_flow.lengths`): the
    workload's (known), a prediction learned from finished calls (learned), or the cap
    `max_tokens` (max-tokens); the engines always generate the workload's."""
    max_tokens: int = DEFAULT_MAX_TOKENS
    """The cap every call is believed to have under ``max-tokens`` (a trace states none)."""
    learned_cap: int | None = None
    """Under ``learned``: the cap every call is declared at, as a coordinator's clients
    declare their max_tokens, which the belief never exceeds; None: no cap (a trace's
    declared lengths are what the engines generate, not caps)."""
    learn_costs: bool = False
    """Whether the scheduler learns each instance's latency model online from the calls it
    served (`hexgen_flow.learning`), with the calibration as its prior; off, it believes
    the calibration as it is."""

    def __post_init__(self) -> None:
        if not self.qps > 0:
            raise ConfigError(f"qps must be > 0, got {self.qps}")
        if not self.slo_scale > 0:
            raise ConfigError(f"slo-scale must be > 0, got {self.slo_scale}")
        if not self.arrival_cv > 0:
            raise ConfigError(f"arrival-cv must be > 0, got {self.arrival_cv}")
        if self.learned_cap is not None and self.learned_cap < 1:
            raise ConfigError(f"learned cap must be >= 1, got {self.learned_cap}")
        caching = prefix_caching_of(self.engine, self.prefix_caching)
        object.__setattr__(self, "prefix_caching", caching)  # frozen: set once, here


@mypyc_attr(allow_interpreted_subclasses=True)  # AdmittingSimulation; scripts/compile_core.py
class Simulation:
    """One run of `queries` on `cluster` under `preset`.

    Truth and belief: the scheduler (dispatch, queues, stage budgets, admission, the α
    tuner) plans with `cluster`'s latency models; the engine models execute `truth`'s, the
    same instances under another calibration (default: `cluster` itself, a scheduler that
    knows its engines exactly). Each query's SLO comes from `truth`: what a belief gets
    wrong changes where calls run, never what they are held to.
    """

    _every: tuple[float, Callable[[float, Simulation], None]] | None = None
    """(period, hook) set by `every`; None (the default) costs the event loop nothing."""

    def __init__(
        self,
        queries: Sequence[Query],
        cluster: Cluster,
        preset: Preset,
        config: SimConfig,
        estimator: Estimator | None = None,
        *,
        truth: Cluster | None = None,
    ) -> None:
        if not queries:
            raise ConfigError("no queries to simulate")
        self.queries = list(queries)
        self.cluster = cluster
        self.truth = cluster if truth is None else check_same_instances(cluster, truth)
        """The cluster the engine models execute (`cluster`: what the scheduler believes)."""
        self.preset = preset
        self.config = config
        slo_base_s = None if truth is None else Estimator(truth).slo_base()
        self.scheduler = GlobalScheduler(
            cluster,
            preset,
            seed=config.seed + 1,
            estimator=estimator,
            slo_base_s=slo_base_s,
            prefix_caching=bool(config.prefix_caching),
        )
        self.core = Scheduler(self.scheduler)
        """The scheduling protocol this run drives (`hexgen_flow.protocol`): every arrival,
        start and finish is an event, and the run carries out the actions it returns."""
        self.estimator = self.scheduler.estimator
        self.slo_base_s = self.scheduler.slo_base_s
        self._check_fits()
        rng = random.Random(config.seed)
        times = arrival_times(self.queries, config.qps, config.arrival_cv, rng)
        self._arrivals = sorted((t, i) for i, t in enumerate(times))
        self.engines: list[EngineModel] = [
            create_engine_model(config.engine, inst, prefix_caching=config.prefix_caching)
            for inst in self.truth.instances
        ]
        declared: int | None = None  # the output tokens a call's engine is asked for
        if config.output_lengths is OutputLengths.LEARNED:
            self.core.lengths = OutputLengthPredictor(cap=config.learned_cap)
            declared = config.learned_cap
        elif config.output_lengths is OutputLengths.MAX_TOKENS:
            self.core.lengths = MaxTokensBelief(config.max_tokens)
            declared = config.max_tokens
        self._believed: dict[int, Query] = {}
        """Each arrived query as the scheduler believes it (`planned`)."""
        self._metered: list[MeteredEngine] | None = None
        if config.learn_costs:
            self.scheduler.learn_costs()
            self._metered = [MeteredEngine(e, i, declared) for i, e in enumerate(self.engines)]
            self.engines = list(self._metered)
        self.instances = [
            InstanceScheduler(self.scheduler.make_queue(inst.index), engine)
            for inst, engine in zip(cluster.instances, self.engines, strict=True)
        ]
        self._gen = [0] * len(cluster)
        self._planned = [float("inf")] * len(cluster)
        self._heap: list[tuple[float, int, int, int]] = []
        self._event_seq = 0
        self._dirty: list[int] = []
        self._is_dirty = [False] * len(cluster)
        self._outcomes: list[QueryOutcome] = []
        self._admitted: list[tuple[Query, float, float]] = []
        self.calls_moved = 0
        """Queued calls the core moved to another instance (`CallMoved`)."""
        self.calls_done = 0

    def _check_fits(self) -> None:
        biggest = max(self.scheduler.load.kv_tokens)
        for q in self.queries:
            oversized = self.scheduler.oversized_call(q)
            if oversized is not None:
                call = oversized[2]
                raise ConfigError(
                    f"query {q.query_id}: a {call.step} call of "
                    f"{call.input_tokens}+{call.output_tokens} tokens fits no "
                    f"instance's KV cache (largest: {biggest} tokens)"
                )

    @property
    def preemptions(self) -> int:
        """Requests the engine models preempted so far, over all instances."""
        return sum(engine.preemptions for engine in self.engines)

    def slo_of(self, query: Query) -> float:
        return self.scheduler.slo_of(query, self.config.slo_scale)

    def every(self, period_s: float, hook: Callable[[float, Simulation], None]) -> None:
        """Call ``hook(t, self)`` at t = period_s, 2 period_s, ... of simulated time, before
        any event at t or later is handled, for as long as the run has events left: the
        online α tuner's hook (it may hand ``self.core`` an `AlphaChanged`)."""
        if not period_s > 0:
            raise ConfigError(f"the hook period must be > 0, got {period_s}")
        self._every = (period_s, hook)

    @property
    def finished(self) -> Sequence[QueryOutcome]:
        """The queries finished so far, in finishing order (read it, do not change it)."""
        return self._outcomes

    @property
    def admitted(self) -> Sequence[tuple[Query, float, float]]:
        """The queries admitted so far as (query, arrival_s, slo_s), in arrival order: what
        the coordinator's ``admitted`` stream holds (read it, do not change it)."""
        return self._admitted

    # ----------------------------------------------------------------- event handling

    def run(self) -> RunMetrics:
        # A run makes no reference cycles (its objects go by reference counting), so the
        # cyclic garbage collector would only walk the live ones, over and over (about 6 %
        # of a 10,000-query run): it is paused for the run, and resumed if it was on.
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._run()
        finally:
            if collecting:
                gc.enable()

    def _run(self) -> RunMetrics:
        # The loop runs once per event: each dirty instance's admissions
        # (`InstanceScheduler.admit_ready`, with the queue's and the engine's methods bound
        # once, each start an event for the core) and planning its next event (the
        # engine's `next_event_s`, pushed when it moved).
        heap = self._heap
        arrivals = self._arrivals
        gen = self._gen
        planned = self._planned
        engines = self.engines
        admission = [
            (inst.queue.peek, inst.queue.pop, inst.engine.fits, inst.engine.admit, inst.admit_hook)
            for inst in self.instances
        ]
        next_event = [engine.next_event_s for engine in engines]
        advance = [engine.advance for engine in engines]
        dirty, is_dirty = self._dirty, self._is_dirty
        complete = self._complete
        started = self.core.call_started
        heappop, heappush = heapq.heappop, heapq.heappush
        n_arrivals = len(arrivals)
        next_arrival = 0
        inf = float("inf")
        period_s, hook = self._every if self._every is not None else (inf, None)
        next_tick = period_s
        seq = self._event_seq
        arrival_t = arrivals[0][0] if n_arrivals else inf
        while True:
            if heap and heap[0][0] <= arrival_t:
                if hook is not None and heap[0][0] >= next_tick:
                    hook(next_tick, self)
                    next_tick += period_s
                    continue
                now, _, i, g = heappop(heap)
                if g != gen[i]:
                    continue
                planned[i] = inf
                for ticket in advance[i](now):
                    complete(ticket, now)
                if not is_dirty[i]:
                    is_dirty[i] = True
                    dirty.append(i)
            elif next_arrival < n_arrivals:
                if hook is not None and arrival_t >= next_tick:
                    hook(next_tick, self)
                    next_tick += period_s
                    continue
                now, qi = arrivals[next_arrival]
                next_arrival += 1
                arrival_t = arrivals[next_arrival][0] if next_arrival < n_arrivals else inf
                self._arrive(qi, now)
            else:
                break
            for i in dirty:
                is_dirty[i] = False
                peek, pop, fits, admit, on_admit = admission[i]
                while True:  # `admit_ready`, inlined
                    head = peek(now)  # None when empty
                    if head is None or not fits(head):
                        break
                    pop(now)
                    admit(head, now)
                    if on_admit is not None:
                        on_admit(head, now)
                    started(head, now)
                t = next_event[i]()
                if t != planned[i]:
                    gen[i] += 1
                    planned[i] = t
                    if t != inf:
                        heappush(heap, (t, seq, i, gen[i]))
                        seq += 1
            dirty.clear()
        self._event_seq = seq
        return self._metrics()

    def _arrive(self, index: int, now: float) -> None:
        self._start(index, now, self.slo_of(self.queries[index]))

    def planned(self, index: int) -> Query:
        """Query `index` as the scheduler sees it: with the output lengths it believes
        (`SimConfig.output_lengths`), taken when the query arrives."""
        if self.core.lengths is None:
            return self.queries[index]
        believed = self._believed.get(index)
        if believed is None:
            believed = self._believed[index] = self.core.believe(self.queries[index])
        return believed

    def _start(self, index: int, now: float, slo_s: float) -> QueryRun:
        """Submit query `index` at `now` (admitted: its root stages are released)."""
        # The workload's query: the core plans it with the lengths it believes, and its
        # calls ask the engines for what the workload says.
        actions = self.core.handle(Submit(self.queries[index], index, now, slo_s))
        admitted = actions[0]
        assert isinstance(admitted, Admitted)
        self._admitted.append((admitted.run.query, now, slo_s))
        self._apply(actions, now)
        return admitted.run

    def _complete(self, ticket: CallTicket, now: float) -> None:
        self.calls_done += 1
        cost = None
        if self._metered is not None:
            cost = self._metered[ticket.instance].take_cost(ticket)
        actions = self.core.call_done(ticket, now, cost)
        if actions:
            self._apply(actions, now)

    def _apply(self, actions: tuple[Action, ...], now: float) -> None:
        """Carry out the core's actions on the instances' queues, in order."""
        instances, is_dirty, dirty = self.instances, self._is_dirty, self._dirty
        for action in actions:
            if isinstance(action, StageReleased):
                tickets = action.tickets
                for ticket in tickets:
                    i = ticket.instance  # every instance is up: no call is ever parked
                    instances[i].queue.push(ticket, now)
                    if not is_dirty[i]:
                        is_dirty[i] = True
                        dirty.append(i)
            elif isinstance(action, DeadlineChanged | CallMoved):
                ticket = action.ticket
                if isinstance(action, CallMoved):
                    instances[action.source].queue.remove(ticket)
                    self.calls_moved += 1
                else:
                    instances[ticket.instance].queue.remove(ticket)  # re-queued on its new key
                i = ticket.instance
                instances[i].queue.push(ticket, now)
                if not is_dirty[i]:
                    is_dirty[i] = True
                    dirty.append(i)
            elif isinstance(action, Finish):
                run = action.run
                self._believed.pop(run.index, None)
                q = run.query
                self._outcomes.append(
                    QueryOutcome(q.query_id, q.tenant, run.arrival_s, now, run.slo_s)
                )
            elif not isinstance(action, Admitted):  # `_start` took the run
                raise AssertionError(f"the simulator cannot carry out {action!r}")

    def _metrics(self) -> RunMetrics:
        outcomes = sorted(self._outcomes, key=lambda o: (o.arrival_s, o.query_id))
        return RunMetrics(
            policy=self.preset.name,
            alpha=self.preset.alpha,
            qps=self.config.qps,
            num_queries=len(self.queries),
            slo_s=self.config.slo_scale * self.slo_base_s,
            outcomes=tuple(outcomes),
        )


def simulate(
    queries: Sequence[Query],
    cluster: Cluster,
    preset: Preset,
    config: SimConfig,
    *,
    truth: Cluster | None = None,
) -> RunMetrics:
    """Run one simulation and return its metrics (`truth`: see `Simulation`)."""
    return Simulation(queries, cluster, preset, config, truth=truth).run()


def check_same_instances(belief: Cluster, truth: Cluster) -> Cluster:
    """`truth`, when it has the very instances of `belief` (GPU, model, KV cache, batch
    limit, in order) and only their latency models may differ; else ConfigError."""
    if len(belief) != len(truth):
        raise ConfigError(
            f"the planner's cluster has {len(belief)} instances and the engines' {len(truth)}"
        )
    for b, t in zip(belief.instances, truth.instances, strict=True):
        same = (b.gpu, b.model, b.kv_cache_tokens, b.max_batch)
        if same != (t.gpu, t.model, t.kv_cache_tokens, t.max_batch):
            raise ConfigError(
                f"instance {b.index} differs beyond its latency model: the planner has "
                f"{b.gpu} {b.model} ({b.kv_cache_tokens} KV tokens, batch {b.max_batch}), "
                f"the engines {t.gpu} {t.model} ({t.kv_cache_tokens} KV tokens, batch "
                f"{t.max_batch})"
            )
    return truth
