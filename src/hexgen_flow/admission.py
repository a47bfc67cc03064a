"""Admission control's prediction: can a new query still finish within its SLO?

Overloading a deadline-driven cluster makes every query late: the urgency queues keep all
of them in progress, so at 20 q/s on two A100s every query misses. Admission control
refuses (or demotes) a query predicted to miss, so that the ones admitted keep their SLO.

The prediction is a fluid model in the scheduler's own estimates:

- **work**: a call's *saturated work*, the share of an instance's time it takes once the
  instance is busy: its prefill (serial) plus its decode steps' cost per sequence at the
  batch it would decode in (``a / B + b + c x context`` per decode step from the
  instance's fitted decode step, B its max batch or as many such calls as its KV cache
  holds), as the cluster mean;
- **backlog**: the saturated work of every unfinished call of the running queries a driver
  tracks (the coordinator tracks all but the best-effort queries still held back);
- **critical path**: the longest path of single-request estimates through the query's
  DAG, each call on the instance fastest for it;
- **capacity**: the instances taking calls, each weighted by its speed relative to the
  cluster mean, in saturated work (n available instances of a homogeneous cluster drain n
  seconds of work per second; a fast GPU among slow ones more than its share);
- a running query shares its instances with everything admitted: it finishes after its
  critical path *plus* the time the whole backlog needs to drain (``drain = (backlog +
  work) / capacity``, the new query admitted), and the part of its path run while the
  instances are busy runs about half as slow again (its decodes share steps with the other
  calls' prefill chunks and decode in a bigger batch): ``finish = critical_path +
  min(critical_path, drain) / 2 + drain``.

A query is admitted when it meets its own deadline (``finish <= slack x SLO``, or as soon
as it could finish on an idle cluster when even that is later) and does not push an
admitted query past its deadline (``own <= headroom``: ``own = work / capacity``, the
newcomer's own share of the instances' time, against the least time any admitted query has
left after its own remaining critical path; queries with no time left are not
protected, or one straggler would block every admission). The newcomer delays an admitted
query by its own work, not by the whole backlog: the backlog is there whether it is
admitted or not, and the urgency queues serve the admitted query's calls, whose deadlines
are earlier, first.

Measured in the simulator (docs/admission.md, `benchmarks/admission_predictor.py`; 52
settings of trace1-3 on six clusters from 0.1 to 20 q/s, two seeds): at least 94 % of the
admitted queries meet their SLO, and 15 % more queries meet it than when the whole backlog
counted against every admitted query and the busy path ran twice as slow (which refused a
third of the queries on H100 x 4 at 0.5 q/s that would all have met their SLO).

**Fair and local.** What a newcomer is judged by is the work that can compete with it
while it runs, not one global backlog:

- *within its window*: a tracked query whose remaining critical path is longer than the
  newcomer's window (``slack x SLO``) cannot do all its work within it; only the share
  ``window / path`` of its work counts (one call of 100,000 output tokens decodes for
  an hour: it is not a backlog that drains before a small query can run);
- *each tenant within its share*: another tenant's windowed backlog counts at most its
  weighted share of the capacity over the window (``weight / sum of the weights of the
  tenants with work in flight, the newcomer's included``); a tenant over its share is not
  protected against the newcomers of tenants within theirs, so one tenant's flood cannot
  make another's feasible query infeasible beyond that tenant's share;
- *best-effort apart*: the work of best-effort queries is served last and is not counted
  against queries admitted at normal urgency (only against other best-effort ones).

A query that cannot meet its SLO even alone on the whole cluster (``idle_s``) is refused
for good (`Verdict.INFEASIBLE`: no wait can help), or run best-effort when the driver says
so; `decide` is that rule, shared by the coordinator and the simulator.

`predict_finish` is the pure function; `AdmissionModel` derives its inputs from a cluster
and the queries a driver runs (the coordinator's admission, or a simulator).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hexgen_flow.cluster import Cluster
from hexgen_flow.estimate import REPRESENTATIVE_TOKENS, Estimator, WorkflowPlan
from hexgen_flow.latency import decode_steps
from hexgen_flow.runtime import QueryRun
from hexgen_flow.workload import DEFAULT_TENANT, STANDARD_TEMPLATE, LLMCall, Workflow

__all__ = [
    "BEST_EFFORT_DELAY_S",
    "AdmissionDecision",
    "AdmissionMode",
    "AdmissionModel",
    "Prediction",
    "Verdict",
    "decide",
    "is_best_effort",
    "predict_finish",
]

BEST_EFFORT_DELAY_S = 1e7
"""Cluster seconds a best-effort query's deadline is pushed out by (about four months):
behind every query admitted at normal urgency in a deadline-ordered queue."""


def is_best_effort(run: QueryRun) -> bool:
    """Whether `run` was admitted best-effort (`hexgen_flow.protocol.Submit`), whose
    deadline the core pushed out by `BEST_EFFORT_DELAY_S`."""
    return run.best_effort


@dataclass(frozen=True, slots=True)
class Prediction:
    """What admitting a query now is predicted to do (seconds from now)."""

    finish_s: float
    """When the query's last call finishes (inf: nothing can run it)."""
    alone_s: float
    """When it would finish on an idle cluster (its least time)."""
    drain_s: float
    """When the backlog, the query's own work included, has drained."""
    headroom_s: float = math.inf
    """The least time an admitted query can still be delayed (inf: none to protect)."""
    delay_s: float = 0.0
    """How long the query's own work delays the admitted queries: its saturated work over
    the capacity."""
    idle_s: float = math.nan
    """When it would finish alone on the whole cluster, every instance up (nan: as
    `alone_s`): later than its SLO, no wait can help."""

    @property
    def least_s(self) -> float:
        """Its least time on this cluster: `idle_s`, or `alone_s` when not given."""
        return self.alone_s if math.isnan(self.idle_s) else self.idle_s

    def meets(self, slo_s: float, slack: float = 1.0) -> bool:
        """Whether the query finishes within `slack` x `slo_s` (or as soon as it could on
        an idle cluster, when even that is later) and every admitted query still meets its
        own deadline."""
        return (
            math.isfinite(self.finish_s)
            and self.finish_s <= max(slack * slo_s, self.alone_s)
            and self.delay_s <= self.headroom_s
        )

    def retry_after_s(self, slo_s: float, slack: float = 1.0) -> float:
        """How long until the backlog has drained enough to admit the query (0 if it fits
        now, inf if nothing can run it). The backlog drains one second per second, which
        brings the finish at least as far forward; a query that would push an admitted one
        late waits about as long as that one still has before its deadline."""
        if self.meets(slo_s, slack):
            return 0.0
        if not math.isfinite(self.finish_s):
            return math.inf
        own = max(self.finish_s - max(slack * slo_s, self.alone_s), 0.0)
        if self.delay_s <= self.headroom_s:
            return own
        return max(own, self.headroom_s)


def predict_finish(
    *,
    critical_path_s: float,
    work_s: float,
    backlog_s: float,
    capacity: float,
    headroom_s: float = math.inf,
    full_capacity: float | None = None,
) -> Prediction:
    """The prediction for a query with critical path `critical_path_s` and saturated work
    `work_s`, behind `backlog_s` of saturated work, on `capacity` instances' worth of
    throughput (seconds of work drained per second), with admitted queries that can be
    delayed by at most `headroom_s`; `full_capacity`: the whole cluster's throughput, every
    instance up (for `Prediction.idle_s`; None: `capacity`). All in seconds of one clock."""

    def finish(drain: float) -> float:
        # The part of its path run while the instances are busy runs about 1.5x as slow
        # (twice as slow refused queries that met their SLO without admission control).
        return critical_path_s + 0.5 * min(critical_path_s, drain) + drain

    whole = capacity if full_capacity is None else full_capacity
    idle = finish(work_s / whole) if whole > 0.0 else math.inf
    if capacity <= 0.0:
        return Prediction(math.inf, math.inf, math.inf, headroom_s, math.inf, idle)
    own = work_s / capacity
    drain = max(backlog_s, 0.0) / capacity + own
    return Prediction(finish(drain), finish(own), drain, headroom_s, own, idle)


class AdmissionMode(enum.Enum):
    """What a driver does with a query predicted to miss its SLO."""

    REJECT = "reject"
    """Refuse it: retry later (the load may drain), or for good when it cannot meet its
    SLO even alone on the whole cluster."""
    BEST_EFFORT = "best-effort"
    """Admit it at the lowest urgency, held back until it would be admitted."""
    OFF = "off"
    """Admit everything."""

    @classmethod
    def parse(cls, text: str) -> AdmissionMode:
        try:
            return cls(text)
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise ValueError(f"admission mode {text!r} is not one of {names}") from None


class Verdict(enum.Enum):
    """What admission control decided about a query."""

    ADMIT = "admit"
    """Run it at normal urgency."""
    BEST_EFFORT = "best-effort"
    """Run it at the lowest urgency, when it would be admitted (`AdmissionMode.BEST_EFFORT`)."""
    RETRY = "retry"
    """Refused for now: retry after `AdmissionDecision.retry_after_s`."""
    INFEASIBLE = "infeasible"
    """Refused for good: even alone on the whole cluster it would miss its SLO."""

    @property
    def admitted(self) -> bool:
        return self in (Verdict.ADMIT, Verdict.BEST_EFFORT)


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    """The decision about one query, and why."""

    verdict: Verdict
    prediction: Prediction
    """What admitting it now is predicted to do."""
    retry_after_s: float = 0.0
    """For `Verdict.RETRY`: seconds (of the prediction's clock) until the backlog has
    drained enough to admit it; 0 otherwise."""


def decide(
    prediction: Prediction, slo_s: float, *, mode: AdmissionMode, slack: float = 1.0
) -> AdmissionDecision:
    """The admission rule: admit a query that `meets` its SLO; one whose least time on the
    whole cluster exceeds ``max(slack, 1) x slo_s`` is `Verdict.INFEASIBLE` (no wait can
    help), the others wait (`Verdict.RETRY`); in `AdmissionMode.BEST_EFFORT` both run
    best-effort instead; `AdmissionMode.OFF` admits everything."""
    if mode is AdmissionMode.OFF:
        return AdmissionDecision(Verdict.ADMIT, prediction)
    if prediction.least_s > max(slack, 1.0) * slo_s:
        verdict = Verdict.BEST_EFFORT if mode is AdmissionMode.BEST_EFFORT else Verdict.INFEASIBLE
        return AdmissionDecision(verdict, prediction)
    if prediction.meets(slo_s, slack):
        return AdmissionDecision(Verdict.ADMIT, prediction)
    if mode is AdmissionMode.BEST_EFFORT:
        return AdmissionDecision(Verdict.BEST_EFFORT, prediction)
    return AdmissionDecision(Verdict.RETRY, prediction, prediction.retry_after_s(slo_s, slack))


class AdmissionModel:
    """The inputs of `predict_finish` for one cluster, from the queries a driver runs at
    normal urgency (`track` each when it is admitted).

    Each tracked query's remaining work and critical path are recomputed from its
    `QueryRun` only when its progress changed; queries that finished, or that `alive` says
    are gone (cancelled, failed), are dropped.
    """

    def __init__(
        self,
        cluster: Cluster,
        estimator: Estimator | None = None,
        *,
        weight_of: Callable[[str], float] | None = None,
    ) -> None:
        self.cluster = cluster
        self.estimator = estimator or Estimator(cluster)
        self.weight_of = weight_of or (lambda tenant: 1.0)
        """A tenant's weight in fair admission (> 0; default 1 for every tenant)."""
        instances = cluster.instances
        self._n = len(instances)
        self._models = [inst.latency for inst in instances]
        self._kv = [inst.kv_cache_tokens for inst in instances]
        self._max_batch = [inst.max_batch for inst in instances]
        self._fits = [
            inst.latency.decode_step_fit(inst.max_batch, inst.kv_cache_tokens) for inst in instances
        ]
        template = [
            sum(
                self._work_on(i, LLMCall(step, *REPRESENTATIVE_TOKENS[step]))
                for step in STANDARD_TEMPLATE
            )
            for i in range(self._n)
        ]
        mean = sum(template) / self._n
        self.speed = tuple(mean / t for t in template)
        """Each instance's throughput in cluster-mean seconds of saturated work per second
        (on the standard template's calls)."""
        self._call_work: dict[tuple[int, int], float] = {}
        self._call_time: dict[tuple[int, int], float] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._backlog_s = 0.0

    # ------------------------------------------------------------------ per call, per query

    def _work_on(self, i: int, call: LLMCall) -> float:
        """The call's saturated work on instance `i` (its own seconds)."""
        tokens = call.input_tokens + call.output_tokens
        context = call.input_tokens + call.output_tokens / 2
        prefill = self._models[i].split(call.input_tokens, call.output_tokens)[0]
        batch = max(1, min(self._max_batch[i], self._kv[i] // max(tokens, 1)))
        fit = self._fits[i]
        per_token = fit.a_s / batch + fit.b_s + fit.c_s * context
        return prefill + decode_steps(call.output_tokens) * per_token

    def call_work_s(self, call: LLMCall) -> float:
        """The call's saturated work (cluster mean, single-request seconds)."""
        key = (call.input_tokens, call.output_tokens)
        cached = self._call_work.get(key)
        if cached is None:
            total = sum(self._work_on(i, call) for i in range(self._n))
            cached = self._call_work[key] = total / self._n
        return cached

    def stage_work_s(self, workflow: Workflow) -> tuple[float, ...]:
        """Saturated work of each stage (all its calls)."""
        return tuple(sum(map(self.call_work_s, stage.calls)) for stage in workflow.stages)

    def call_time_s(self, call: LLMCall) -> float:
        """The call's single-request time on the fastest instance for it (where the
        dispatcher sends a query's calls while they are urgent)."""
        key = (call.input_tokens, call.output_tokens)
        cached = self._call_time.get(key)
        if cached is None:
            fastest = min(self.estimator.call_time(i, call) for i in range(self._n))
            cached = self._call_time[key] = fastest
        return cached

    def tail_s(self, workflow: Workflow) -> tuple[float, ...]:
        """Per stage, the longest path of `call_time_s` from it (included) to the end."""
        stage_s = [max(map(self.call_time_s, stage.calls)) for stage in workflow.stages]
        return WorkflowPlan(workflow, stage_s).tail_s

    def critical_path_s(self, workflow: Workflow) -> float:
        """The query's least time: its longest path of `call_time_s` through the DAG."""
        tail = self.tail_s(workflow)
        return max(tail[k] for k in workflow.roots)

    def capacity(self, available: Sequence[bool]) -> float:
        """Throughput of the available instances, in cluster-mean seconds per second."""
        return sum(s for s, up in zip(self.speed, available, strict=True) if up)

    @property
    def full_capacity(self) -> float:
        """Throughput of the whole cluster, every instance up."""
        return sum(self.speed)

    # -------------------------------------------------------------------------- backlog

    def track(
        self,
        run: QueryRun,
        slack: float = 1.0,
        *,
        protect: bool = True,
        best_effort: bool = False,
    ) -> None:
        """Count `run`'s unfinished calls in the backlog from now on and, with `protect`,
        its deadline (`slack` x its SLO after its arrival): no query is admitted that would
        push it late. A `best_effort` query is counted only against other best-effort
        queries (it is served last) and never protected."""
        workflow = run.query.workflow
        # Tracking a query again replaces it (the coordinator tracks a provisional run while
        # it stores the query, then the stored one): its work counts once. Counted twice, it
        # stayed in the backlog after the query ended, for as long as any query ran, and
        # the backlog grew with every admission until the cluster refused most queries.
        self.forget(run.query.query_id)
        entry = _Tracked(
            run,
            workflow,
            self.stage_work_s(workflow),
            self.tail_s(workflow),
            run.arrival_s + slack * run.slo_s if protect and not best_effort else math.inf,
            best_effort=best_effort,
        )
        self._tracked[run.query.query_id] = entry
        self._refresh(entry)

    def forget(self, query_id: str) -> None:
        """Stop counting a query (it ended, or is no longer served at normal urgency)."""
        entry = self._tracked.pop(query_id, None)
        if entry is not None:
            self._backlog_s -= entry.remaining_s

    def __len__(self) -> int:
        return len(self._tracked)

    def tracked(self) -> list[QueryRun]:
        """The queries counted in the backlog."""
        return [entry.run for entry in self._tracked.values()]

    def backlog_s(self, alive: Callable[[QueryRun], bool] | None = None) -> float:
        """Saturated work of the tracked queries' unfinished calls."""
        self._update(alive)
        return self._backlog_s

    def tenant_work_s(self, tenant: str, alive: Callable[[QueryRun], bool] | None = None) -> float:
        """Saturated work of `tenant`'s tracked queries' unfinished calls (its work in
        flight, best-effort included: what a tenant's quota counts)."""
        self._update(alive)
        return sum(e.remaining_s for e in self._tracked.values() if e.run.query.tenant == tenant)

    def _update(self, alive: Callable[[QueryRun], bool] | None) -> None:
        gone: list[str] = []
        for query_id, entry in self._tracked.items():
            run = entry.run
            if run.calls_left <= 0 or (alive is not None and not alive(run)):
                gone.append(query_id)
            elif run.calls_left != entry.calls_left or run.query.workflow is not entry.workflow:
                self._refresh(entry)
        for query_id in gone:
            self.forget(query_id)
        if not self._tracked or self._backlog_s < 0.0:
            self._backlog_s = 0.0 if not self._tracked else max(self._backlog_s, 0.0)

    def _refresh(self, entry: _Tracked) -> None:
        run = entry.run
        workflow = run.query.workflow
        if workflow is not entry.workflow:
            # A workflow session grew (a call joined a stage, or named a new one): its
            # stages' work and paths are those of the workflow it runs now.
            entry.workflow = workflow
            entry.stage_work = self.stage_work_s(workflow)
            entry.tail = self.tail_s(workflow)
        stages = workflow.stages
        remaining, path = 0.0, 0.0
        for k, left in enumerate(run.stage_calls_left):
            if left:
                remaining += entry.stage_work[k] * left / len(stages[k].calls)
                if run.deps_left[k] == 0 and entry.tail[k] > path:
                    path = entry.tail[k]
        self._backlog_s += remaining - entry.remaining_s
        entry.remaining_s = remaining
        entry.path_s = path
        entry.calls_left = run.calls_left

    # ---------------------------------------------------------------------- prediction

    def predict(
        self,
        workflow: Workflow,
        now: float,
        available: Sequence[bool],
        alive: Callable[[QueryRun], bool] | None = None,
        *,
        tenant: str = DEFAULT_TENANT,
        window_s: float = math.inf,
        best_effort: bool = False,
    ) -> Prediction:
        """What admitting a query of `tenant` with `workflow` at `now` is predicted to do.

        `window_s`: the time within which it must finish (``slack x SLO``): only the work
        the tracked queries can do within it counts, and another tenant's at most its
        weighted share of the capacity over it (see the module docstring); inf: the whole
        backlog. `best_effort`: the prediction for a best-effort query, which waits for the
        best-effort queries ahead of it too."""
        self._update(alive)
        capacity = self.capacity(available)
        per_tenant: dict[str, float] = {}
        for entry in self._tracked.values():
            if entry.best_effort and not best_effort:
                continue
            work = entry.remaining_s
            if entry.path_s > window_s:
                # It cannot do all its work within the window: its calls take at least
                # its remaining critical path, at about an even rate along it.
                work *= window_s / entry.path_s
            owner = entry.run.query.tenant
            per_tenant[owner] = per_tenant.get(owner, 0.0) + work
        backlog, over_share = self._fair_backlog(per_tenant, tenant, capacity, window_s)
        headroom = math.inf
        for entry in self._tracked.values():
            if entry.run.query.tenant in over_share:
                continue  # over its share: not protected against a tenant within its own
            left = entry.deadline_s - now - entry.path_s
            # A query already late without the newcomer (no time left after its remaining
            # path) is not protected.
            if 0.0 <= left < headroom:
                headroom = left
        return predict_finish(
            critical_path_s=self.critical_path_s(workflow),
            work_s=sum(self.stage_work_s(workflow)),
            backlog_s=backlog,
            capacity=capacity,
            headroom_s=headroom,
            full_capacity=self.full_capacity,
        )

    def _fair_backlog(
        self, per_tenant: dict[str, float], tenant: str, capacity: float, window_s: float
    ) -> tuple[float, set[str]]:
        """The backlog a newcomer of `tenant` is judged by, and the tenants over their
        share: its own tenant's whole (windowed) backlog, every other tenant's up to its
        weighted share of `capacity` over `window_s`."""
        others = [t for t in per_tenant if t != tenant]
        if not others or not math.isfinite(window_s):
            return sum(per_tenant.values()), set()
        weights = {t: self._weight(t) for t in (*others, tenant)}
        total = sum(weights.values())
        backlog = per_tenant.get(tenant, 0.0)
        over: set[str] = set()
        for t in others:
            share = weights[t] / total * capacity * window_s
            if per_tenant[t] > share:
                over.add(t)
                backlog += share
            else:
                backlog += per_tenant[t]
        return backlog, over

    def _weight(self, tenant: str) -> float:
        weight = self.weight_of(tenant)
        return weight if math.isfinite(weight) and weight > 0.0 else 1.0


@dataclass(eq=False, slots=True)
class _Tracked:
    run: QueryRun
    workflow: Workflow
    """The workflow its stage work and tails were computed for."""
    stage_work: tuple[float, ...]
    tail: tuple[float, ...]
    deadline_s: float
    """When it must finish: arrival + slack x SLO."""
    remaining_s: float = 0.0
    path_s: float = 0.0
    """Its remaining critical path (the longest tail of its released, unfinished stages)."""
    calls_left: int = -1
    best_effort: bool = False
    """Served last: counted only against other best-effort queries."""
