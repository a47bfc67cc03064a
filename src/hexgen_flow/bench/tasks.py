"""The benchmark's simulation tasks, as run by a pool worker: one simulation, or one goodput
search (`find_goodput`). Clusters and query lists are cached per worker process."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import lru_cache
from typing import Any

from hexgen_flow.bench.plan import TENANTS, Task
from hexgen_flow.cluster import Cluster, parse_cluster
from hexgen_flow.lengths import OutputLengths
from hexgen_flow.metrics import RunMetrics
from hexgen_flow.policies.presets import PRESETS
from hexgen_flow.sim.simulator import SimConfig, simulate
from hexgen_flow.traces import load_traces, take_queries
from hexgen_flow.tuning import TuningResult, auto_tune
from hexgen_flow.workload import Query

__all__ = ["cached_cluster", "cached_queries", "find_goodput", "run_task"]


# A pool worker runs many tasks on the same few clusters and traces: parse each once.
@lru_cache(maxsize=32)
def cached_cluster(spec: str, calibration: str | None = None) -> Cluster:
    return parse_cluster(spec, calibration=calibration)


@lru_cache(maxsize=32)
def cached_planner(
    spec: str,
    calibration: str,
    planner_calibration: str | None,
    planner_error: tuple[tuple[str, float, float], ...],
) -> Cluster:
    """What the planner believes of `spec` (the engines' cluster itself when exact)."""
    belief = cached_cluster(spec, planner_calibration or calibration)
    errors = {gpu: (p, d) for gpu, p, d in planner_error if gpu in belief.gpus}
    return belief.misjudged(errors) if errors else belief


@lru_cache(maxsize=32)
def cached_queries(trace: str, num_queries: int | None, tenants: bool) -> tuple[Query, ...]:
    queries = take_queries(load_traces([trace]), num_queries)
    if tenants:
        queries = [
            replace(q, tenant=TENANTS[i % len(TENANTS)][0], slo_scale=TENANTS[i % len(TENANTS)][1])
            for i, q in enumerate(queries)
        ]
    return tuple(queries)


def _run_once(
    queries: Sequence[Query],
    cluster: Cluster,
    preset_name: str,
    config: SimConfig,
    truth: Cluster | None = None,
) -> tuple[RunMetrics, TuningResult | None, int]:
    """One simulation (alpha auto-tuned first when the preset has one, on what the planner
    believes: `cluster`; the engines run `truth`, default `cluster`); also the number of
    simulations it took."""
    preset = PRESETS[preset_name]
    tuning = None
    sims = 1
    if preset.has_alpha:
        tuning = auto_tune(queries, cluster, preset, config)
        preset = preset.with_alpha(tuning.alpha)
        sims += len(tuning.curve)
    return simulate(queries, cluster, preset, config, truth=truth), tuning, sims


def _run_record(metrics: RunMetrics, tuning: TuningResult | None) -> dict[str, Any]:
    lat = metrics.latency_summary()
    record: dict[str, Any] = {
        "alpha": metrics.alpha,
        "p95_s": lat["p95"],
        "mean_s": lat["mean"],
        "p50_s": lat["p50"],
        "p99_s": lat["p99"],
        "slo_attainment": metrics.slo_attainment,
        "throughput_qps": metrics.throughput_qps,
        "completed": metrics.completed,
        "num_queries": metrics.num_queries,
    }
    tenants = metrics.tenant_attainment()
    if len(tenants) > 1:
        record["tenant_attainment"] = tenants
    if tuning is not None:
        record["alpha_curve"] = [
            {"alpha": p.alpha, "p95_s": p.p95_s, "slo_attainment": p.slo_attainment}
            for p in tuning.curve
        ]
    return record


def find_goodput(
    attainment: Callable[[float], float],
    *,
    target: float = 0.95,
    max_qps: float = 2.0,
    resolution: float = 0.005,
) -> tuple[float, list[tuple[float, float]]]:
    """The highest rate in (0, `max_qps`] whose attainment is >= `target`, to `resolution`.

    Bracketing: try `max_qps`, then halve until a rate passes (0.0 if none does above
    `resolution`); then bisect between the highest passing and the lowest failing rate until
    they are `resolution` apart. Assumes attainment does not rise with load (so one passing
    rate vouches for every lower one). Returns the goodput and every (rate, attainment)
    probed, in probing order.
    """
    probes: list[tuple[float, float]] = []

    def passes(qps: float) -> bool:
        value = attainment(qps)
        probes.append((qps, value))
        return value >= target

    hi = max_qps
    if passes(hi):
        return hi, probes
    lo = hi / 2
    while not passes(lo):
        hi = lo
        lo /= 2
        if lo < resolution:
            return 0.0, probes
    while hi - lo > resolution:
        mid = (lo + hi) / 2
        if passes(mid):
            lo = mid
        else:
            hi = mid
    return lo, probes


def run_task(task: Task) -> dict[str, Any]:
    """Run one task; returns its result record (plus "sims": simulations run)."""
    truth = cached_cluster(task.cluster, task.calibration)
    cluster = cached_planner(
        task.cluster, task.calibration, task.planner_calibration, task.planner_error
    )
    engines = None if cluster is truth else truth
    queries = cached_queries(task.trace, task.num_queries, task.tenants)

    def config(qps: float) -> SimConfig:
        return SimConfig(
            qps=qps,
            slo_scale=task.slo_scale,
            seed=task.seed,
            arrival_cv=task.arrival_cv,
            engine=task.engine,
            prefix_caching=task.prefix_caching,
            learn_costs=task.learn_costs,
            output_lengths=OutputLengths.parse(task.output_lengths),
        )

    if task.kind == "run":
        metrics, tuning, sims = _run_once(queries, cluster, task.preset, config(task.qps), engines)
        return {**_run_record(metrics, tuning), "sims": sims}
    if task.kind == "goodput":
        target, max_qps, resolution = task.goodput
        alphas: dict[float, float | None] = {}
        total = 0

        def attainment(qps: float) -> float:
            nonlocal total
            metrics, _, sims = _run_once(queries, cluster, task.preset, config(qps), engines)
            alphas[qps] = metrics.alpha
            total += sims
            return metrics.slo_attainment

        goodput, probes = find_goodput(
            attainment, target=target, max_qps=max_qps, resolution=resolution
        )
        return {
            "goodput_qps": goodput,
            "probes": [{"qps": q, "slo_attainment": a, "alpha": alphas[q]} for q, a in probes],
            "sims": total,
        }
    raise ValueError(f"unknown task kind {task.kind!r}")
