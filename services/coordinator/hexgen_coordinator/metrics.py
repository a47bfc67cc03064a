"""The coordinator's Prometheus metrics (text format on ``--metrics-listen``, path /metrics).

Counters and histograms are updated where things happen (a query ends, a call is sent, a
call fails, a submission is refused, the coordinator hands out released calls); gauges of
the present (queries running, alpha, each instance's load as its worker last reported it)
are read from the coordinator's state (`ledger.Queries`, `ledger.Slots`) and its scheduler
when Prometheus scrapes, so they cost the hot path nothing.

Times are seconds: query latency and the SLO on the cluster clock (what clients see), the
coordinator's own overhead in wall seconds.

Labels are bounded. An instance is ``gpu_instance`` (its name, e.g. ``A100#0``): not
``instance``, which Prometheus gives every series of a target (its address), so a scrape
with the default ``honor_labels: false`` would move ours to ``exported_instance`` and a
``sum by (instance)`` would add every GPU up. Tenant labels are capped (`TenantLabels`):
the first `DEFAULT_MAX_TENANTS` (100; the coordinator's ``--metrics-max-tenants``) distinct
tenants seen keep a label of their own, every later one is counted under
``tenant="other"``, so that a flood of tenant names cannot grow the scrape without bound;
stage labels (a stage's step type, which clients name) likewise, at `DEFAULT_MAX_STAGES`.
A refusal's ``reason`` is one of `REJECTION_REASONS`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hexgen_flow.cluster import Cluster
from hexgen_flow.scheduler import GlobalScheduler

if TYPE_CHECKING:
    from hexgen_coordinator.ledger import Queries, Slots

__all__ = [
    "DEFAULT_MAX_STAGES",
    "DEFAULT_MAX_TENANTS",
    "INSTANCE_LABEL",
    "OTHER_TENANT",
    "REJECTION_REASONS",
    "CoordinatorMetrics",
    "TenantLabelled",
    "TenantLabels",
]

DEFAULT_MAX_TENANTS = 100
"""Distinct tenants that keep a label of their own (``--metrics-max-tenants``)."""
DEFAULT_MAX_STAGES = 50
"""Distinct stage step types that keep a label of their own (later ones: "other")."""
OTHER_TENANT = "other"
"""The label of every tenant past the cap (a tenant named so shares it); of every stage
step type past its cap too."""
INSTANCE_LABEL = "gpu_instance"
"""The label naming an instance (``A100#0``): never ``instance``, Prometheus's own target
label (see the module docstring)."""
REJECTION_REASONS = (
    "overloaded",  # predicted to miss its SLO, or to push an admitted query past its own
    "infeasible",  # cannot meet its SLO even alone on the whole cluster
    "running_limit",  # --max-running-queries
    "tenant_limit",  # the tenant's running queries (--max-tenant-queries, max_running)
    "rate_limit",  # the tenant's rate (the keys file's rate_qps)
    "quota",  # the tenant's kept prompts or work in flight would pass its quota
    "too_large",  # the query alone is more than the tenant's quota
    "redis_memory",  # Redis above --redis-memory-limit
    "invalid",  # anything else admission refused
)
"""The values of ``hexgen_flow_queries_rejected_total``'s ``reason`` (the ``reason`` of
the `OverloadedError` or `InvalidFieldError` admission raised)."""

_LATENCY_BUCKETS = (5, 10, 20, 30, 60, 90, 120, 180, 240, 300, 450, 600, 900, 1800, 3600)
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
_M = TypeVar("_M", Counter, Histogram)

_STAGE_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class TenantLabels:
    """The tenant label values of the metrics: the first `limit` distinct tenants seen
    keep their own name, every later one is `OTHER_TENANT`; so a scrape carries at most
    ``limit + 1`` values per metric, however many tenants submit.

    The first tenants seen, not the busiest: a counter must stay on the series it started
    on (moving a tenant's count between its own series and "other" would make both go
    backwards to Prometheus), and the first ones are known at once, at no cost per query.
    The set lives in memory: a restarted coordinator starts counting anew (Prometheus
    reads a restart's counters as a reset, as it does for every counter). 0: every tenant
    is "other" (no tenant name in the metrics at all)."""

    def __init__(self, limit: int = DEFAULT_MAX_TENANTS) -> None:
        self.limit = limit
        self._kept: set[str] = set()

    def __call__(self, tenant: str) -> str:
        if tenant in self._kept:
            return tenant
        if len(self._kept) < self.limit:
            self._kept.add(tenant)
            return tenant
        return OTHER_TENANT


class TenantLabelled(Generic[_M]):
    """A counter (or histogram) whose first label is the tenant, passed through
    `TenantLabels` (the cap): ``.labels(tenant, *others)`` as the metric's own."""

    def __init__(self, counter: _M, tenants: TenantLabels) -> None:
        self.counter: _M = counter
        self.tenants = tenants

    def labels(self, tenant: str, *others: str) -> _M:
        child: _M = self.counter.labels(self.tenants(tenant), *others)
        return child


class CoordinatorMetrics:
    """Every metric of one coordinator, in a registry of its own."""

    def __init__(self, max_tenants: int = DEFAULT_MAX_TENANTS) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.tenants = TenantLabels(max_tenants)
        """The cap on tenant labels, shared by every metric with one: its `limit` is the
        coordinator's ``--metrics-max-tenants``."""
        self.queries_finished = TenantLabelled(
            Counter(
                "hexgen_flow_queries_finished",
                "Queries that ended, by tenant and outcome (succeeded, failed, cancelled); "
                'tenants past the cap as tenant="other".',
                ["tenant", "outcome"],
                registry=r,
            ),
            self.tenants,
        )
        self.queries_rejected = TenantLabelled(
            Counter(
                "hexgen_flow_queries_rejected",
                "Submissions refused by admission control, a limit or a quota, by tenant and "
                "reason (overloaded, infeasible, running_limit, tenant_limit, rate_limit, "
                'quota, too_large, redis_memory, invalid); tenants past the cap as tenant="other".',
                ["tenant", "reason"],
                registry=r,
            ),
            self.tenants,
        )
        self.slo_met = TenantLabelled(
            Counter(
                "hexgen_flow_slo_met",
                'Queries that succeeded within their SLO; tenants past the cap as tenant="other".',
                ["tenant"],
                registry=r,
            ),
            self.tenants,
        )
        self.query_latency = TenantLabelled(
            Histogram(
                "hexgen_flow_query_latency_seconds",
                "Arrival to end of the queries that succeeded, by tenant (cluster seconds); "
                'tenants past the cap as tenant="other".',
                ["tenant"],
                buckets=_LATENCY_BUCKETS,
                registry=r,
            ),
            self.tenants,
        )
        self.stages = TenantLabels(DEFAULT_MAX_STAGES)
        """The cap on stage labels (step types, which clients name)."""
        self.stage_latency = Histogram(
            "hexgen_flow_stage_latency_seconds",
            "A stage's release to its last call's end, by the stage's step type (cluster "
            'seconds); step types past the first 50 seen as stage="other".',
            ["stage"],
            buckets=_STAGE_BUCKETS,
            registry=r,
        )
        self.calls_dispatched = Counter(
            "hexgen_flow_calls_dispatched",
            "Calls handed to an instance's worker (redispatches and retries included).",
            [INSTANCE_LABEL],
            registry=r,
        )
        self.calls_failed = Counter(
            "hexgen_flow_calls_failed",
            "Call attempts an engine reported as failed.",
            [INSTANCE_LABEL],
            registry=r,
        )
        self.completion_to_dispatch = Histogram(
            "hexgen_flow_completion_to_dispatch_seconds",
            "Coordinator overhead: a completion received -> the calls it released handed to "
            "their workers' streams (wall seconds).",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self.dispatched_on: list[Counter] = []
        self._noted_tenants: set[str] = set()
        self._noted_stages: set[str] = set()
        """The tenant and stage labels whose series exist (`admitted`)."""
        self.submit_to_dispatch = Histogram(
            "hexgen_flow_submit_to_dispatch_seconds",
            "Coordinator overhead: a query submitted -> its first calls handed out (wall s).",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self.loop_lag = Histogram(
            "hexgen_flow_event_loop_lag_seconds",
            "How late the coordinator's event loop woke from a 50 ms sleep: the time some piece "
            "of work held it (hexgen_service.loop_lag; wall seconds).",
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.gc_pause = Histogram(
            "hexgen_flow_gc_pause_seconds",
            "Python garbage collections, by generation: each one stops the event loop "
            "(hexgen_service.gc_tuning; wall seconds).",
            ["generation"],
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )

    def watch(
        self, queries: Queries, slots: Slots, scheduler: GlobalScheduler, cluster: Cluster
    ) -> None:
        """Report the present state of `queries`, `slots` and `scheduler` at every scrape, and
        keep each instance's labelled counters at hand (a dispatch counts without a label
        lookup)."""
        self.registry.register(_Present(queries, slots, scheduler, cluster))
        names = [inst.name for inst in cluster.instances]
        self.dispatched_on = [self.calls_dispatched.labels(name) for name in names]
        """`calls_dispatched` of each instance, by slot."""
        for name in names:  # every instance's series from the start, at 0: rate() sees them
            self.calls_failed.labels(name)

    def admitted(self, tenant: str, steps: Iterable[str]) -> None:
        """A query of `tenant` whose stages are of `steps` was admitted: the series it will
        count on exist from now on, at 0 (a series that first appears with a count in it
        shows Prometheus's rate() no increase: a tenant whose first queries all end
        between two scrapes would have no latency to plot). Bounded by the caps."""
        label = self.tenants(tenant)
        if label not in self._noted_tenants:
            self._noted_tenants.add(label)
            self.query_latency.counter.labels(label)
            self.slo_met.counter.labels(label)
            for outcome in ("succeeded", "failed", "cancelled"):
                self.queries_finished.counter.labels(label, outcome)
        for step in steps:
            label = self.stages(step)
            if label not in self._noted_stages:
                self._noted_stages.add(label)
                self.stage_latency.labels(label)

    def stage_finished(self, step: str, seconds: float) -> None:
        """Count a stage of step type `step` that took `seconds` (cluster s) to finish."""
        self.stage_latency.labels(self.stages(step)).observe(max(seconds, 0.0))


class _Present(Collector):
    """Gauges read at scrape time."""

    def __init__(
        self, queries: Queries, slots: Slots, scheduler: GlobalScheduler, cluster: Cluster
    ) -> None:
        self.queries = queries
        self.slots = slots
        self.scheduler = scheduler
        self.cluster = cluster

    def collect(self) -> Iterator[Metric]:
        load = self.scheduler.load
        yield GaugeMetricFamily(
            "hexgen_flow_queries_running",
            "Queries admitted and not ended.",
            len(self.queries.active),
        )
        alpha = self.scheduler.alpha
        yield GaugeMetricFamily(
            "hexgen_flow_alpha",
            "The dispatcher's alpha in force (NaN for a policy without one).",
            float("nan") if alpha is None else alpha,
        )
        gauges = {
            "connected": "1 while a worker holds the instance's slot.",
            "in_flight_calls": "Calls dispatched to the instance and not finished (with a "
            "worker shared by coordinator shards, the other shards' too).",
            "others_in_flight_calls": "Of in_flight_calls, those other coordinator shards "
            "dispatched (the worker's last heartbeat).",
            "running_calls": "Calls in the instance's engine (its worker's last heartbeat).",
            "queued_calls": "Calls in the instance's local queue (its last heartbeat).",
            "kv_used_tokens": "KV-cache tokens in use (its last heartbeat).",
            "kv_capacity_tokens": "KV-cache tokens the instance holds.",
            "outstanding_seconds": "Estimated single-request seconds of its calls in flight.",
        }
        families = {
            name: GaugeMetricFamily(f"hexgen_flow_instance_{name}", doc, labels=[INSTANCE_LABEL])
            for name, doc in gauges.items()
        }
        for inst in self.cluster.instances:
            link = self.slots.links[inst.index]
            values = {
                "connected": 1.0 if link is not None else 0.0,
                "in_flight_calls": load.in_flight[inst.index],
                "others_in_flight_calls": load.others_in_flight[inst.index],
                "running_calls": link.running if link else 0,
                "queued_calls": link.queued if link else 0,
                "kv_used_tokens": link.kv_used if link else 0,
                "kv_capacity_tokens": inst.kv_cache_tokens,
                "outstanding_seconds": load.outstanding_s[inst.index],
            }
            for name, value in values.items():
                families[name].add_metric([inst.name], float(value))
        yield from families.values()
        learner = self.scheduler.learner
        if learner is not None:
            factor = GaugeMetricFamily(
                "hexgen_flow_instance_learned_cost_factor",
                "What the instance really costs over what its calibration says, as learned "
                "online from its calls (--learn-costs): part=prefill or decode; 1 = the "
                "calibration is right.",
                labels=[INSTANCE_LABEL, "part"],
            )
            observed = GaugeMetricFamily(
                "hexgen_flow_instance_learned_calls",
                "Calls the instance's cost learner took in (dropped outliers included).",
                labels=[INSTANCE_LABEL],
            )
            for inst, learned in zip(self.cluster.instances, learner.factors(), strict=True):
                factor.add_metric([inst.name, "prefill"], learned.prefill)
                factor.add_metric([inst.name, "decode"], learned.decode)
                observed.add_metric([inst.name], float(learned.calls))
            yield factor
            yield observed
