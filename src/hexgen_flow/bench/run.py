"""Running a plan: its tasks in a process pool, the results document (results.json) they
are assembled into, the simulator speed, and `run_bench`, which also writes the report and
the plots."""

from __future__ import annotations

import json
import math
import multiprocessing
import signal
import sys
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hexgen_flow.bench.band import assemble_band
from hexgen_flow.bench.plan import (
    BASELINE,
    FLAGSHIP,
    LOAD_AWARE,
    NEAR_BEST,
    TENANTS,
    BenchPlan,
    Task,
    plan_tasks,
)
from hexgen_flow.bench.plots import plot
from hexgen_flow.bench.report import render_markdown
from hexgen_flow.bench.shifting import run_shifting_load
from hexgen_flow.bench.shifting_report import plot_shifting
from hexgen_flow.bench.tasks import cached_cluster, cached_queries, run_task
from hexgen_flow.metrics import json_safe
from hexgen_flow.policies.presets import PRESETS
from hexgen_flow.sim.simulator import SimConfig, simulate
from hexgen_flow.tuning import tune_alpha

__all__ = ["BenchOutcome", "run_bench", "run_plan", "run_tasks"]


def _ignore_sigint() -> None:
    # Ctrl-C is the parent's to handle: it cancels the pool; workers just finish and exit.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def run_tasks(tasks: Sequence[Task], workers: int) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Run `tasks` on `workers` processes (1: in this one), with a progress bar on stderr;
    their results by task key."""
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
        # Workers start from a clean server process, never forked from this one: a caller that
        # has loaded grpc (a test process, the mesh's tuner) may hold its threads' locks, and
        # a fork copies them held, which can hang the child.
        with ProcessPoolExecutor(
            max_workers=workers,
            initializer=_ignore_sigint,
            mp_context=multiprocessing.get_context("forkserver"),
        ) as pool:
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


def _best_of(
    presets: Sequence[str], value: dict[str, float], plan: BenchPlan, *, highest: bool
) -> str | None:
    """The preset of `presets` with the lowest (`highest`: the highest) value; ties: the
    first in plan order. None when `presets` is empty."""
    if not presets:
        return None
    sign = -1.0 if highest else 1.0
    return min(presets, key=lambda p: (sign * value[p], plan.presets.index(p)))


def _assemble(plan: BenchPlan, results: dict[tuple[Any, ...], dict[str, Any]]) -> dict[str, Any]:
    # The second baseline: the best load-aware router of the plan, chosen per row and trace.
    routers = [p for p in plan.presets if p in LOAD_AWARE]
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
                p95 = {p: cells[p]["p95_s"] for p in routers}
                router = _best_of(routers, p95, plan, highest=False)
                row["best_router"] = router
                row["best_router_p95_s"] = None if router is None else p95[router]
                # FLAGSHIP's speedup over the best router: router P95 / FLAGSHIP P95.
                row["speedup_vs_best_router"] = (
                    _ratio(p95[router], cells[FLAGSHIP]["p95_s"])
                    if router is not None and FLAGSHIP in cells
                    else None
                )
                rows.append(row)

    goodput = []
    gp_routers = [p for p in plan.goodput_policies if p in LOAD_AWARE]
    best_routers: dict[str, dict[str, Any]] = {}
    for trace in plan.traces:
        base = results[("goodput", trace, BASELINE)]["goodput_qps"]
        rates = {p: results[("goodput", trace, p)]["goodput_qps"] for p in gp_routers}
        router = _best_of(gp_routers, rates, plan, highest=True)
        router_qps = None if router is None else rates[router]
        best_routers[trace] = {"policy": router, "goodput_qps": router_qps}
        for preset in plan.goodput_policies:
            rec = results[("goodput", trace, preset)]
            goodput.append(
                {
                    "trace": trace,
                    "policy": preset,
                    "goodput_qps": rec["goodput_qps"],
                    "ratio_vs_vllm": _ratio(rec["goodput_qps"], base),
                    "ratio_vs_best_router": _ratio(rec["goodput_qps"], router_qps),
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
            "calibration": plan.calibration,
            "planner_calibration": plan.planner_calibration or plan.calibration,
            "planner_error": {gpu: {"prefill": p, "decode": d} for gpu, p, d in plan.planner_error},
            "learn_costs": plan.learn_costs,
            "output_lengths": plan.output_lengths,
            "engine": plan.engine,
            "prefix_caching": plan.prefix_caching,
            "qps": list(plan.qps),
            "seed": plan.seed,
            "slo_scale": plan.slo_scale,
            "arrival_cv": plan.arrival_cv,
            "baseline": BASELINE,
            "load_aware": routers,
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
            "best_router": best_routers,
        },
    }
    # The optional parts keep their place (and so results.json its key order) when run.
    if plan.runs_band:
        doc["band"] = assemble_band(plan, results)
    if "slo_sweep" in plan.parts:
        doc["slo_sweep"] = {
            "cluster": x1_label,
            "trace": plan.sweep_trace,
            "qps": plan.slo_sweep_qps,
            "num_queries": plan.slo_sweep_queries,
            "slo_scales": list(plan.slo_sweep_scales),
            "slo_attainment": sweep("slo", plan.slo_sweep_scales, "slo_attainment"),
            "alpha": sweep("slo", plan.slo_sweep_scales, "alpha"),
        }
    if "load_sweep" in plan.parts:
        doc["load_sweep"] = {
            "cluster": x1_label,
            "trace": plan.sweep_trace,
            "slo_scale": plan.slo_scale,
            "num_queries": plan.load_sweep_queries,
            "qps": list(plan.load_sweep_qps),
            "p95_s": sweep("load", plan.load_sweep_qps, "p95_s"),
            "mean_s": sweep("load", plan.load_sweep_qps, "mean_s"),
            "slo_attainment": sweep("load", plan.load_sweep_qps, "slo_attainment"),
            "alpha": sweep("load", plan.load_sweep_qps, "alpha"),
        }
    if "multi_tenant" in plan.parts:
        doc["multi_tenant"] = {
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
        }
    doc["headline"] = _headline(plan, doc)
    return doc


def _headline(plan: BenchPlan, doc: dict[str, Any]) -> dict[str, Any]:
    x1_label = plan.clusters[0][0]
    speedup: dict[str, dict[str, float | None]] = {}
    over_router: dict[str, dict[str, dict[str, Any]]] = {}
    for row in doc["matrix_rows"]:
        if row["cluster"] == x1_label:
            qps = f"{row['qps']:g}"
            speedup.setdefault(row["trace"], {})[qps] = row["speedup_vs_vllm"].get(FLAGSHIP)
            over_router.setdefault(row["trace"], {})[qps] = {
                "router": row["best_router"],
                "speedup": row["speedup_vs_best_router"],
            }
    gp = doc["goodput"]
    mine = [r for r in gp["results"] if r["policy"] == FLAGSHIP]
    ratios = {r["trace"]: r["ratio_vs_vllm"] for r in mine}
    router_ratios = {
        r["trace"]: {
            "router": gp["best_router"][r["trace"]]["policy"],
            "ratio": r["ratio_vs_best_router"],
        }
        for r in mine
    }
    rows = doc["matrix_rows"]
    return {
        "policy": FLAGSHIP,
        "baseline": BASELINE,
        "load_aware": doc["meta"]["load_aware"],
        "p95_speedup_vs_vllm_x1": speedup,
        "p95_speedup_vs_best_router_x1": over_router,
        "goodput_ratio_vs_vllm": ratios,
        "goodput_ratio_vs_best_router": router_ratios,
        "rows_best_or_within_2pct": sum(bool(r.get("hexgen_flow_within_2pct")) for r in rows),
        "rows_best": sum(r["best"] == FLAGSHIP for r in rows),
        "rows": len(rows),
    }


def _measure_speed(plan: BenchPlan) -> dict[str, Any]:
    """Simulator speed, measured in this process with nothing else running."""
    cluster = cached_cluster(plan.clusters[0][1], plan.calibration)
    queries = cached_queries(plan.sweep_trace, plan.speed_queries, False)
    preset = PRESETS[FLAGSHIP].with_alpha(plan.speed_alpha)
    config = SimConfig(
        qps=plan.speed_qps,
        slo_scale=plan.slo_scale,
        seed=plan.seed,
        arrival_cv=plan.arrival_cv,
        engine=plan.engine,
        prefix_caching=plan.prefix_caching,
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


# ------------------------------------------------------------------------------------- run


def run_plan(plan: BenchPlan, *, workers: int = 2) -> dict[str, Any]:
    """Run `plan`'s tasks on `workers` processes (1: in this one) and return its results
    document, as in results.json but without the benchmark's wall time."""
    tasks = plan_tasks(plan)
    print(
        f"hexgen-flow bench ({plan.name}): {len(tasks)} tasks on {workers} worker "
        f"process{'es' if workers > 1 else ''}",
        file=sys.stderr,
    )
    doc = _assemble(plan, run_tasks(tasks, workers))
    if "simulator_speed" in plan.parts:
        doc["simulator_speed"] = _measure_speed(plan)
    if "shifting_load" in plan.parts:
        # Serial, in this process: three long scenarios, each a chain of tuning replays.
        doc["shifting_load"] = run_shifting_load(
            quick=plan.name == "quick", progress=True, calibration=plan.calibration
        )
    doc["meta"]["workers"] = workers
    return doc


@dataclass(frozen=True, slots=True)
class BenchOutcome:
    out: Path
    wall_s: float
    files: tuple[str, ...] = field(default=())
    doc: dict[str, Any] = field(default_factory=dict)


def run_bench(plan: BenchPlan, out: Path, *, workers: int = 2) -> BenchOutcome:
    """Run `plan`, write its report into `out` (which must exist), print where on stderr."""
    started = time.perf_counter()
    doc = run_plan(plan, workers=workers)
    doc["meta"]["wall_s"] = time.perf_counter() - started
    (out / "results.json").write_text(json.dumps(json_safe(doc), indent=1, allow_nan=False) + "\n")
    (out / "results.md").write_text(render_markdown(plan, doc))
    plots = plot(plan, doc, out)
    if "shifting_load" in doc:
        plots += plot_shifting(doc["shifting_load"], out)
    wall_s = time.perf_counter() - started
    files = ("results.md", "results.json", *plots)
    print(
        f"hexgen-flow bench: wrote {', '.join(files)} to {out}/ in {wall_s:.1f} s", file=sys.stderr
    )
    return BenchOutcome(out, wall_s, files, doc)
