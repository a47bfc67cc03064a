"""The benchmark behind ``hexgen-flow bench``: the paper's evaluation, re-run in the simulator.

Parts (each a list of independent simulation tasks, run in a process pool):

- **matrix**: traces x clusters x arrival rates x presets; P95 / mean latency and SLO
  attainment, speedup over ``vllm``.
- **goodput**: per trace and preset, the highest steady arrival rate at which at least 95 %
  of the queries meet their SLO (bracketing, then bisection).
- **SLO sweep**: attainment vs SLO scale; **load sweep**: P95 vs arrival rate.
- **multi-tenant**: half the queries at a tight SLO, half at a loose one; attainment per
  tenant.
- **simulator speed**: LLM calls simulated per second of wall time, and the time of one
  full alpha tuning. Run alone in this process after the pool, so that nothing competes.

Presets with an alpha run with it auto-tuned (`hexgen_flow.tuning.auto_tune`, as
``--alpha auto``), at every setting they are measured at.

Everything but the wall-clock timings is deterministic: every task is a pure function of
its key, and results are assembled in plan order, never in completion order.

Outputs in the ``--out`` folder: ``results.md`` (summary, then tables), ``results.json``
(the same, machine-readable), and the plots ``p95_matrix.png``, ``goodput.png``,
``p95_vs_load.png`` and ``attainment_vs_slo.png``.
"""

from __future__ import annotations

import json
import math
import signal
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hexgen_flow.cluster import Cluster, parse_cluster
from hexgen_flow.metrics import RunMetrics, json_safe
from hexgen_flow.policies.presets import PRESETS
from hexgen_flow.sim.simulator import SimConfig, simulate
from hexgen_flow.traces import load_traces, take_queries
from hexgen_flow.tuning import TuningResult, auto_tune, tune_alpha
from hexgen_flow.workload import Query

__all__ = [
    "FULL_PLAN",
    "QUICK_PLAN",
    "BenchPlan",
    "Task",
    "find_goodput",
    "run_bench",
    "run_task",
]

BASELINE = "vllm"
"""The preset every speedup and goodput ratio is measured against."""
FLAGSHIP = "hexgen-flow"
"""The preset the summary is about."""
NEAR_BEST = 0.02
"""`FLAGSHIP` counts as tied with the best preset when its P95 is within this fraction."""
TENANTS: tuple[tuple[str, float], ...] = (("strict", 1.0), ("relaxed", 2.0))
"""Multi-tenant run: (tenant, SLO scale), assigned to the queries alternately."""
PLOTS = ("p95_matrix.png", "goodput.png", "p95_vs_load.png", "attainment_vs_slo.png")


@dataclass(frozen=True, slots=True)
class BenchPlan:
    """What the benchmark runs. Every field has the full benchmark's value as default."""

    name: str = "full"
    presets: tuple[str, ...] = tuple(PRESETS)
    """Presets compared everywhere; must include `BASELINE`."""
    traces: tuple[str, ...] = ("trace1", "trace2", "trace3")
    clusters: tuple[tuple[str, str], ...] = (
        ("x1", "A100,A100,A6000,L40S"),
        ("x2", "A100,A100,A6000,L40S,A100,A100,A6000,L40S"),
    )
    """(label, cluster spec); the first is the cluster of the goodput and sweep parts."""
    qps: tuple[float, ...] = (0.5, 1.0)
    """Arrival rates of the matrix (queries/s)."""
    seed: int = 0
    slo_scale: float = 3.0
    arrival_cv: float = 1.0
    goodput_queries: int = 1000
    goodput_target: float = 0.95
    """Share of queries that must meet the SLO."""
    goodput_max_qps: float = 2.0
    goodput_resolution: float = 0.005
    sweep_trace: str = "trace3"
    slo_sweep_scales: tuple[float, ...] = (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0)
    slo_sweep_queries: int = 1000
    slo_sweep_qps: float = 0.15
    load_sweep_qps: tuple[float, ...] = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0)
    load_sweep_queries: int = 500
    tenant_queries: int = 1000
    tenant_qps: float = 0.15
    speed_queries: int = 2000
    speed_qps: float = 0.5
    speed_alpha: float = 0.5

    def __post_init__(self) -> None:
        if BASELINE not in self.presets:
            raise ValueError(f"a bench plan must include the {BASELINE!r} preset")


FULL_PLAN = BenchPlan()
QUICK_PLAN = BenchPlan(
    name="quick",
    presets=(FLAGSHIP, "llf", BASELINE),
    traces=("trace1",),
    clusters=(("x1", "A100,A100,A6000,L40S"),),
    qps=(0.5,),
    goodput_queries=200,
    goodput_resolution=0.02,
    slo_sweep_scales=(1.0, 3.0),
    slo_sweep_queries=100,
    load_sweep_qps=(0.1, 0.5),
    load_sweep_queries=100,
    tenant_queries=100,
    speed_queries=300,
)


# ------------------------------------------------------------------------------------ tasks


@dataclass(frozen=True, slots=True)
class Task:
    """One unit of work for a pool worker: a pure function of its fields."""

    kind: str
    """"run" (one simulation, alpha auto-tuned first if the preset has one) or "goodput"."""
    key: tuple[Any, ...]
    """Where the result goes: (part, ...)."""
    trace: str
    cluster: str
    preset: str
    qps: float
    num_queries: int | None
    seed: int
    slo_scale: float
    arrival_cv: float
    tenants: bool = False
    """Assign `TENANTS` to the queries alternately."""
    goodput: tuple[float, float, float] = (0.95, 2.0, 0.005)
    """(target attainment, highest rate, resolution) of a goodput search."""


@lru_cache(maxsize=32)
def _cluster(spec: str) -> Cluster:
    return parse_cluster(spec)


@lru_cache(maxsize=32)
def _queries(trace: str, num_queries: int | None, tenants: bool) -> tuple[Query, ...]:
    queries = take_queries(load_traces([trace]), num_queries)
    if tenants:
        queries = [
            replace(q, tenant=TENANTS[i % len(TENANTS)][0], slo_scale=TENANTS[i % len(TENANTS)][1])
            for i, q in enumerate(queries)
        ]
    return tuple(queries)


def _run_once(
    queries: Sequence[Query], cluster: Cluster, preset_name: str, config: SimConfig
) -> tuple[RunMetrics, TuningResult | None, int]:
    """One simulation (alpha auto-tuned first when the preset has one); also the number of
    simulations it took."""
    preset = PRESETS[preset_name]
    tuning = None
    sims = 1
    if preset.has_alpha:
        tuning = auto_tune(queries, cluster, preset, config)
        preset = preset.with_alpha(tuning.alpha)
        sims += len(tuning.curve)
    return simulate(queries, cluster, preset, config), tuning, sims


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
    cluster = _cluster(task.cluster)
    queries = _queries(task.trace, task.num_queries, task.tenants)

    def config(qps: float) -> SimConfig:
        return SimConfig(
            qps=qps, slo_scale=task.slo_scale, seed=task.seed, arrival_cv=task.arrival_cv
        )

    if task.kind == "run":
        metrics, tuning, sims = _run_once(queries, cluster, task.preset, config(task.qps))
        return {**_run_record(metrics, tuning), "sims": sims}
    if task.kind == "goodput":
        target, max_qps, resolution = task.goodput
        alphas: dict[float, float | None] = {}
        total = 0

        def attainment(qps: float) -> float:
            nonlocal total
            metrics, _, sims = _run_once(queries, cluster, task.preset, config(qps))
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


def plan_tasks(plan: BenchPlan) -> list[Task]:
    """Every task of `plan`, the slow goodput searches first (better packing in the pool)."""
    x1 = plan.clusters[0][1]
    tasks: list[Task] = []

    def add(
        kind: str,
        key: tuple[Any, ...],
        *,
        preset: str,
        qps: float,
        num_queries: int | None,
        trace: str = plan.sweep_trace,
        cluster: str = x1,
        slo_scale: float = plan.slo_scale,
        tenants: bool = False,
    ) -> None:
        tasks.append(
            Task(
                kind,
                key,
                trace,
                cluster,
                preset,
                qps,
                num_queries,
                seed=plan.seed,
                slo_scale=slo_scale,
                arrival_cv=plan.arrival_cv,
                tenants=tenants,
                goodput=(plan.goodput_target, plan.goodput_max_qps, plan.goodput_resolution),
            )
        )

    for trace in plan.traces:
        for preset in plan.presets:
            add(
                "goodput",
                ("goodput", trace, preset),
                preset=preset,
                trace=trace,
                qps=plan.goodput_max_qps,
                num_queries=plan.goodput_queries,
            )
    for label, spec in plan.clusters:
        for trace in plan.traces:
            for qps in plan.qps:
                for preset in plan.presets:
                    add(
                        "run",
                        ("matrix", label, trace, qps, preset),
                        preset=preset,
                        trace=trace,
                        cluster=spec,
                        qps=qps,
                        num_queries=None,
                    )
    for preset in plan.presets:
        for scale in plan.slo_sweep_scales:
            add(
                "run",
                ("slo", preset, scale),
                preset=preset,
                qps=plan.slo_sweep_qps,
                num_queries=plan.slo_sweep_queries,
                slo_scale=scale,
            )
        for qps in plan.load_sweep_qps:
            add(
                "run",
                ("load", preset, qps),
                preset=preset,
                qps=qps,
                num_queries=plan.load_sweep_queries,
            )
        add(
            "run",
            ("tenant", preset),
            preset=preset,
            qps=plan.tenant_qps,
            num_queries=plan.tenant_queries,
            tenants=True,
        )
    return tasks


def _ignore_sigint() -> None:
    # Ctrl-C is the parent's to handle: it cancels the pool; workers just finish and exit.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run_tasks(tasks: Sequence[Task], workers: int) -> dict[tuple[Any, ...], dict[str, Any]]:
    results: dict[tuple[Any, ...], dict[str, Any]] = {}
    sims = 0
    bar = tqdm(total=len(tasks), desc="bench", unit="task", file=sys.stderr, smoothing=0.1)

    def done(task: Task, record: dict[str, Any]) -> None:
        nonlocal sims
        sims += record.pop("sims")
        results[task.key] = record
        bar.set_postfix_str(f"{sims:,} simulations", refresh=False)
        bar.update()

    try:
        if workers <= 1:
            for task in tasks:
                done(task, run_task(task))
            return results
        with ProcessPoolExecutor(max_workers=workers, initializer=_ignore_sigint) as pool:
            pending: dict[Future[dict[str, Any]], Task] = {
                pool.submit(run_task, task): task for task in tasks
            }
            try:
                while pending:
                    finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for future in finished:
                        done(pending.pop(future), future.result())
            except BaseException:
                # Ctrl-C or a failed task: stop now, not after the running tasks (a goodput
                # search runs for many seconds). The pool has no public way to stop a
                # running task, hence its private process table.
                for process in list(pool._processes.values()):
                    process.terminate()
                pool.shutdown(wait=True, cancel_futures=True)
                raise
        return results
    finally:
        bar.close()


# --------------------------------------------------------------------------------- assembly


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or not (math.isfinite(num) and math.isfinite(den)):
        return None
    if den == 0:
        return None
    return num / den


def _assemble(plan: BenchPlan, results: dict[tuple[Any, ...], dict[str, Any]]) -> dict[str, Any]:
    matrix = []
    rows = []
    for label, _spec in plan.clusters:
        for trace in plan.traces:
            for qps in plan.qps:
                cells = {p: results[("matrix", label, trace, qps, p)] for p in plan.presets}
                for preset, cell in cells.items():
                    matrix.append(
                        {"cluster": label, "trace": trace, "qps": qps, "policy": preset, **cell}
                    )
                best = min(plan.presets, key=lambda p: (cells[p]["p95_s"], plan.presets.index(p)))
                base = cells[BASELINE]["p95_s"]
                row: dict[str, Any] = {
                    "cluster": label,
                    "trace": trace,
                    "qps": qps,
                    "best": best,
                    "best_p95_s": cells[best]["p95_s"],
                    "speedup_vs_vllm": {p: _ratio(base, cells[p]["p95_s"]) for p in plan.presets},
                }
                if FLAGSHIP in cells:
                    row["hexgen_flow_within_2pct"] = (
                        cells[FLAGSHIP]["p95_s"] <= (1 + NEAR_BEST) * cells[best]["p95_s"]
                    )
                rows.append(row)

    goodput = []
    for trace in plan.traces:
        base = results[("goodput", trace, BASELINE)]["goodput_qps"]
        for preset in plan.presets:
            rec = results[("goodput", trace, preset)]
            goodput.append(
                {
                    "trace": trace,
                    "policy": preset,
                    "goodput_qps": rec["goodput_qps"],
                    "ratio_vs_vllm": _ratio(rec["goodput_qps"], base),
                    "probes": rec["probes"],
                }
            )

    def sweep(part: str, xs: Sequence[float], metric: str) -> dict[str, list[Any]]:
        return {p: [results[(part, p, x)][metric] for x in xs] for p in plan.presets}

    x1_label = plan.clusters[0][0]
    doc: dict[str, Any] = {
        "meta": {
            "plan": plan.name,
            "presets": list(plan.presets),
            "traces": list(plan.traces),
            "clusters": {label: spec.split(",") for label, spec in plan.clusters},
            "qps": list(plan.qps),
            "seed": plan.seed,
            "slo_scale": plan.slo_scale,
            "arrival_cv": plan.arrival_cv,
            "baseline": BASELINE,
            "alpha": "auto-tuned per setting (tuning arrivals: seed + 1)",
        },
        "matrix": matrix,
        "matrix_rows": rows,
        "goodput": {
            "cluster": x1_label,
            "num_queries": plan.goodput_queries,
            "target_attainment": plan.goodput_target,
            "slo_scale": plan.slo_scale,
            "max_qps": plan.goodput_max_qps,
            "resolution_qps": plan.goodput_resolution,
            "results": goodput,
        },
        "slo_sweep": {
            "cluster": x1_label,
            "trace": plan.sweep_trace,
            "qps": plan.slo_sweep_qps,
            "num_queries": plan.slo_sweep_queries,
            "slo_scales": list(plan.slo_sweep_scales),
            "slo_attainment": sweep("slo", plan.slo_sweep_scales, "slo_attainment"),
            "alpha": sweep("slo", plan.slo_sweep_scales, "alpha"),
        },
        "load_sweep": {
            "cluster": x1_label,
            "trace": plan.sweep_trace,
            "slo_scale": plan.slo_scale,
            "num_queries": plan.load_sweep_queries,
            "qps": list(plan.load_sweep_qps),
            "p95_s": sweep("load", plan.load_sweep_qps, "p95_s"),
            "mean_s": sweep("load", plan.load_sweep_qps, "mean_s"),
            "slo_attainment": sweep("load", plan.load_sweep_qps, "slo_attainment"),
            "alpha": sweep("load", plan.load_sweep_qps, "alpha"),
        },
        "multi_tenant": {
            "cluster": x1_label,
            "trace": plan.sweep_trace,
            "qps": plan.tenant_qps,
            "num_queries": plan.tenant_queries,
            "tenants": {name: scale for name, scale in TENANTS},
            "results": {
                p: {
                    "tenant_attainment": results[("tenant", p)].get("tenant_attainment", {}),
                    "slo_attainment": results[("tenant", p)]["slo_attainment"],
                    "p95_s": results[("tenant", p)]["p95_s"],
                    "alpha": results[("tenant", p)]["alpha"],
                }
                for p in plan.presets
            },
        },
    }
    doc["headline"] = _headline(plan, doc)
    return doc


def _headline(plan: BenchPlan, doc: dict[str, Any]) -> dict[str, Any]:
    x1_label = plan.clusters[0][0]
    speedup: dict[str, dict[str, float | None]] = {}
    for row in doc["matrix_rows"]:
        if row["cluster"] == x1_label:
            speedup.setdefault(row["trace"], {})[f"{row['qps']:g}"] = row["speedup_vs_vllm"].get(
                FLAGSHIP
            )
    ratios = {
        r["trace"]: r["ratio_vs_vllm"] for r in doc["goodput"]["results"] if r["policy"] == FLAGSHIP
    }
    rows = doc["matrix_rows"]
    return {
        "policy": FLAGSHIP,
        "baseline": BASELINE,
        "p95_speedup_vs_vllm_x1": speedup,
        "goodput_ratio_vs_vllm": ratios,
        "rows_best_or_within_2pct": sum(bool(r.get("hexgen_flow_within_2pct")) for r in rows),
        "rows_best": sum(r["best"] == FLAGSHIP for r in rows),
        "rows": len(rows),
    }


def _measure_speed(plan: BenchPlan) -> dict[str, Any]:
    """Simulator speed, measured in this process with nothing else running."""
    cluster = _cluster(plan.clusters[0][1])
    queries = _queries(plan.sweep_trace, plan.speed_queries, False)
    preset = PRESETS[FLAGSHIP].with_alpha(plan.speed_alpha)
    config = SimConfig(
        qps=plan.speed_qps, slo_scale=plan.slo_scale, seed=plan.seed, arrival_cv=plan.arrival_cv
    )
    calls = sum(q.workflow.num_calls for q in queries)
    started = time.perf_counter()
    simulate(queries, cluster, preset, config)
    sim_s = time.perf_counter() - started
    started = time.perf_counter()
    tuning = tune_alpha(queries, cluster, PRESETS[FLAGSHIP], config)
    tune_s = time.perf_counter() - started
    return {
        "trace": plan.sweep_trace,
        "num_queries": len(queries),
        "qps": plan.speed_qps,
        "policy": FLAGSHIP,
        "alpha": plan.speed_alpha,
        "llm_calls": calls,
        "simulate_wall_s": sim_s,
        "llm_calls_per_s": calls / sim_s if sim_s > 0 else None,
        "tune_alpha_values": len(tuning.curve),
        "tune_alpha_wall_s": tune_s,
    }


# ---------------------------------------------------------------------------------- report


def _fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    return f"{value:{spec}}{suffix}"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]], *, left: int = 1) -> list[str]:
    """A Markdown table; the first `left` columns are labels, the rest right-aligned numbers."""
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if i < left else "---:" for i in range(len(header))) + "|",
    ]
    lines.extend("| " + " | ".join(row) + " |" for row in rows)
    return lines


def _summary_lines(plan: BenchPlan, doc: dict[str, Any]) -> list[str]:
    head = doc["headline"]
    x1_label, x1 = plan.clusters[0]
    lines = ["## Summary", ""]
    speedups = "; ".join(
        f"{trace}: " + ", ".join(f"{_fmt(v, '.2f', 'x')} at {q} qps" for q, v in by_qps.items())
        for trace, by_qps in head["p95_speedup_vs_vllm_x1"].items()
    )
    lines.append(
        f"- **P95 speedup of `{FLAGSHIP}` over `{BASELINE}`** on {x1_label} ({x1}): {speedups}."
    )
    by_trace: dict[str, dict[str, float]] = {}
    for r in doc["goodput"]["results"]:
        by_trace.setdefault(r["trace"], {})[r["policy"]] = r["goodput_qps"]
    goodputs = "; ".join(
        f"{trace}: {_fmt(g[FLAGSHIP], '.3f')} vs {_fmt(g[BASELINE], '.3f')} qps "
        f"({_fmt(head['goodput_ratio_vs_vllm'][trace], '.2f', 'x')})"
        for trace, g in by_trace.items()
    )
    gp = doc["goodput"]
    lines.append(
        f"- **Goodput of `{FLAGSHIP}` vs `{BASELINE}`** (highest rate with >= "
        f"{100 * gp['target_attainment']:.0f} % of {gp['num_queries']} queries within "
        f"{gp['slo_scale']:g} x SLO_base, on {x1_label}): {goodputs}."
    )
    lines.append(
        f"- `{FLAGSHIP}` has the lowest P95 in {head['rows_best']} of {head['rows']} "
        f"matrix rows, and is best or within {100 * NEAR_BEST:.0f} % of the best in "
        f"{head['rows_best_or_within_2pct']}."
    )
    speed = doc["simulator_speed"]
    lines.append(
        f"- Simulator: {_fmt(speed['llm_calls_per_s'], ',.0f')} LLM calls/s "
        f"({speed['llm_calls']:,} calls, {speed['num_queries']:,} queries of "
        f"{speed['trace']}); `tune_alpha` over {speed['num_queries']:,} queries "
        f"({speed['tune_alpha_values']} alpha values): "
        f"{speed['tune_alpha_wall_s']:.1f} s."
    )
    lines.append(
        f"- Benchmark wall time: {doc['meta']['wall_s']:.0f} s "
        f"({doc['meta']['workers']} worker processes)."
    )
    return lines


def render_markdown(plan: BenchPlan, doc: dict[str, Any]) -> str:
    meta = doc["meta"]
    presets = list(plan.presets)
    lines = [
        f"# HexGen-Flow benchmark ({plan.name})",
        "",
        f"Simulated, seed {meta['seed']}, Poisson arrivals (cv {meta['arrival_cv']:g}), SLO "
        f"{meta['slo_scale']:g} x SLO_base unless stated; presets with alpha are auto-tuned at "
        "every setting (on other arrivals, seed + 1). Latencies in seconds; rates in "
        "queries/s.",
        "",
        *_summary_lines(plan, doc),
    ]
    cells = {(c["cluster"], c["trace"], c["qps"], c["policy"]): c for c in doc["matrix"]}
    row_info = {(r["cluster"], r["trace"], r["qps"]): r for r in doc["matrix_rows"]}
    for label, spec in plan.clusters:
        keys = [(label, t, q) for t in plan.traces for q in plan.qps]
        lines += [
            "",
            f"## Matrix on {label}: {spec}",
            "",
            f"### P95 latency (s); **bold** = best; last column: `{FLAGSHIP}` best or "
            f"within {100 * NEAR_BEST:.0f} %",
            "",
        ]
        rows = []
        for key in keys:
            info = row_info[key]
            vals = []
            for p in presets:
                text = _fmt(cells[(*key, p)]["p95_s"])
                vals.append(f"**{text}**" if p == info["best"] else text)
            within = info.get("hexgen_flow_within_2pct")
            rows.append(
                [
                    key[1],
                    f"{key[2]:g}",
                    *vals,
                    info["best"],
                    "n/a" if within is None else ("yes" if within else "no"),
                ]
            )
        lines += _table(["trace", "λ", *presets, "best", f"{FLAGSHIP} ≤2 %"], rows, left=2)
        lines += ["", f"### P95 speedup over `{BASELINE}` ({BASELINE} P95 / preset P95)", ""]
        lines += _table(
            ["trace", "λ", *presets],
            (
                [
                    k[1],
                    f"{k[2]:g}",
                    *(_fmt(row_info[k]["speedup_vs_vllm"][p], ".2f", "x") for p in presets),
                ]
                for k in keys
            ),
            left=2,
        )
        lines += ["", "### SLO attainment (%)", ""]
        lines += _table(
            ["trace", "λ", *presets],
            (
                [
                    k[1],
                    f"{k[2]:g}",
                    *(_fmt(100 * cells[(*k, p)]["slo_attainment"], ".1f") for p in presets),
                ]
                for k in keys
            ),
            left=2,
        )
        lines += ["", "### Mean latency (s)", ""]
        lines += _table(
            ["trace", "λ", *presets],
            ([k[1], f"{k[2]:g}", *(_fmt(cells[(*k, p)]["mean_s"]) for p in presets)] for k in keys),
            left=2,
        )
        alpha_presets = [p for p in presets if PRESETS[p].has_alpha]
        if alpha_presets:
            lines += ["", "### Tuned alpha", ""]
            lines += _table(
                ["trace", "λ", *alpha_presets],
                (
                    [
                        k[1],
                        f"{k[2]:g}",
                        *(_fmt(cells[(*k, p)]["alpha"], "g") for p in alpha_presets),
                    ]
                    for k in keys
                ),
                left=2,
            )

    gp = doc["goodput"]
    lines += [
        "",
        f"## Goodput on {gp['cluster']}",
        "",
        f"Highest steady λ (queries/s) in (0, {gp['max_qps']:g}] with >= "
        f"{100 * gp['target_attainment']:.0f} % of {gp['num_queries']} queries within "
        f"{gp['slo_scale']:g} x SLO_base, bracketing + bisection to "
        f"{gp['resolution_qps']:g} qps; in parentheses: ratio over `{BASELINE}`.",
        "",
    ]
    by_key = {(r["trace"], r["policy"]): r for r in gp["results"]}
    lines += _table(
        ["trace", *presets],
        (
            [
                t,
                *(
                    f"{_fmt(by_key[(t, p)]['goodput_qps'], '.3f')} "
                    f"({_fmt(by_key[(t, p)]['ratio_vs_vllm'], '.2f', 'x')})"
                    for p in presets
                ),
            ]
            for t in plan.traces
        ),
    )

    ss = doc["slo_sweep"]
    lines += [
        "",
        f"## SLO attainment (%) vs SLO scale: {ss['trace']}, {ss['num_queries']} "
        f"queries, λ {ss['qps']:g}, {ss['cluster']}",
        "",
    ]
    lines += _table(
        ["policy", *(f"{s:g}x" for s in ss["slo_scales"])],
        ([p, *(_fmt(100 * a, ".1f") for a in ss["slo_attainment"][p])] for p in presets),
    )

    ls = doc["load_sweep"]
    lines += [
        "",
        f"## P95 latency (s) vs load: {ls['trace']}, {ls['num_queries']} queries, {ls['cluster']}",
        "",
    ]
    lines += _table(
        ["policy", *(f"λ {q:g}" for q in ls["qps"])],
        ([p, *(_fmt(v) for v in ls["p95_s"][p])] for p in presets),
    )

    mt = doc["multi_tenant"]
    tenants = list(mt["tenants"])
    lines += [
        "",
        f"## Multi-tenant: {mt['trace']}, {mt['num_queries']} queries alternating "
        + ", ".join(f"{t} ({s:g} x SLO_base)" for t, s in mt["tenants"].items())
        + f", λ {mt['qps']:g}, {mt['cluster']}",
        "",
    ]
    lines += _table(
        ["policy", *(f"{t} attainment (%)" for t in tenants), "overall (%)", "P95 (s)"],
        (
            [
                p,
                *(
                    _fmt(100 * mt["results"][p]["tenant_attainment"].get(t, math.nan), ".1f")
                    for t in tenants
                ),
                _fmt(100 * mt["results"][p]["slo_attainment"], ".1f"),
                _fmt(mt["results"][p]["p95_s"]),
            ]
            for p in presets
        ),
    )

    sp = doc["simulator_speed"]
    lines += [
        "",
        "## Simulator speed",
        "",
        f"- `simulate`: {sp['num_queries']:,} queries of {sp['trace']} ({sp['llm_calls']:,} "
        f"LLM calls) at λ {sp['qps']:g} with `{sp['policy']}` (alpha {sp['alpha']:g}): "
        f"{sp['simulate_wall_s']:.2f} s = {_fmt(sp['llm_calls_per_s'], ',.0f')} calls/s",
        f"- `tune_alpha` on the same queries ({sp['tune_alpha_values']} alpha values): "
        f"{sp['tune_alpha_wall_s']:.2f} s",
        "",
        "Plots: " + ", ".join(f"`{p}`" for p in PLOTS),
        "",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- plots


def _plot(plan: BenchPlan, doc: dict[str, Any], out: Path) -> None:
    import matplotlib  # noqa: PLC0415 - heavy; imported only when plotting

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - must follow matplotlib.use

    presets = list(plan.presets)
    colors = {p: plt.get_cmap("tab10")(i % 10) for i, p in enumerate(presets)}
    width = 0.8 / len(presets)

    # P95 matrix: grouped bars, one panel per cluster.
    cells = {(c["cluster"], c["trace"], c["qps"], c["policy"]): c for c in doc["matrix"]}
    fig, axes = plt.subplots(
        1, len(plan.clusters), figsize=(6.5 * len(plan.clusters), 4.8), squeeze=False, sharey=True
    )
    for ax, (label, spec) in zip(axes[0], plan.clusters, strict=True):
        groups = [(t, q) for t in plan.traces for q in plan.qps]
        for j, p in enumerate(presets):
            xs = [g + (j - (len(presets) - 1) / 2) * width for g in range(len(groups))]
            ys = [cells[(label, t, q, p)]["p95_s"] for t, q in groups]
            ax.bar(xs, ys, width, label=p, color=colors[p])
        ax.set_xticks(range(len(groups)), [f"{t}\nλ {q:g}" for t, q in groups])
        ax.set_title(f"{label}: {spec.replace(',', ', ')}", fontsize=9)
        ax.set_xlabel("trace, arrival rate λ (queries/s)")
        ax.set_yscale("log")
    axes[0][0].set_ylabel("P95 end-to-end latency (s, log scale)")
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.suptitle("P95 latency by policy (lower is better)")
    fig.tight_layout()
    fig.savefig(out / "p95_matrix.png", dpi=110)
    plt.close(fig)

    # Goodput: grouped bars per trace.
    gp = {(r["trace"], r["policy"]): r["goodput_qps"] for r in doc["goodput"]["results"]}
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for j, p in enumerate(presets):
        xs = [g + (j - (len(presets) - 1) / 2) * width for g in range(len(plan.traces))]
        ax.bar(xs, [gp[(t, p)] for t in plan.traces], width, label=p, color=colors[p])
    ax.set_xticks(range(len(plan.traces)), list(plan.traces))
    ax.set_xlabel("trace")
    ax.set_ylabel("goodput (queries/s)")
    g = doc["goodput"]
    ax.set_title(
        f"Goodput: highest λ with >= {100 * g['target_attainment']:.0f} % within "
        f"{g['slo_scale']:g} x SLO_base ({g['cluster']}, higher is better)",
        fontsize=10,
    )
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "goodput.png", dpi=110)
    plt.close(fig)

    # P95 vs load.
    ls = doc["load_sweep"]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for p in presets:
        ax.plot(ls["qps"], ls["p95_s"][p], marker="o", label=p, color=colors[p])
    ax.set_yscale("log")
    ax.set_xlabel("arrival rate λ (queries/s)")
    ax.set_ylabel("P95 end-to-end latency (s, log scale)")
    ax.set_title(
        f"P95 latency vs load ({ls['trace']}, {ls['num_queries']} queries, {ls['cluster']})"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "p95_vs_load.png", dpi=110)
    plt.close(fig)

    # Attainment vs SLO scale.
    ss = doc["slo_sweep"]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for p in presets:
        ax.plot(
            ss["slo_scales"],
            [100 * a for a in ss["slo_attainment"][p]],
            marker="o",
            label=p,
            color=colors[p],
        )
    ax.set_xlabel("SLO scale (x SLO_base)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(-2, 102)
    ax.set_title(
        f"SLO attainment vs SLO scale ({ss['trace']}, {ss['num_queries']} queries, "
        f"λ {ss['qps']:g}, {ss['cluster']})"
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "attainment_vs_slo.png", dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------- run


@dataclass(frozen=True, slots=True)
class BenchOutcome:
    out: Path
    wall_s: float
    files: tuple[str, ...] = field(default=())
    doc: dict[str, Any] = field(default_factory=dict)


def run_bench(plan: BenchPlan, out: Path, *, workers: int = 2) -> BenchOutcome:
    """Run `plan`, write its report into `out` (which must exist), print where on stderr."""
    started = time.perf_counter()
    tasks = plan_tasks(plan)
    print(
        f"hexgen-flow bench ({plan.name}): {len(tasks)} tasks on {workers} worker "
        f"process{'es' if workers > 1 else ''}",
        file=sys.stderr,
    )
    results = _run_tasks(tasks, workers)
    doc = _assemble(plan, results)
    doc["simulator_speed"] = _measure_speed(plan)
    doc["meta"]["workers"] = workers
    doc["meta"]["wall_s"] = time.perf_counter() - started
    (out / "results.json").write_text(json.dumps(json_safe(doc), indent=1, allow_nan=False) + "\n")
    (out / "results.md").write_text(render_markdown(plan, doc))
    _plot(plan, doc, out)
    wall_s = time.perf_counter() - started
    files = ("results.md", "results.json", *PLOTS)
    print(
        f"hexgen-flow bench: wrote {', '.join(files)} to {out}/ in {wall_s:.1f} s", file=sys.stderr
    )
    return BenchOutcome(out, wall_s, files, doc)
