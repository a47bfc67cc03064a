"""Shifting load and the online tuner: does re-tuning α online keep up when the load and the
workload mix change, and does the scheduler hold up at 30 queries/s?

Scenarios (`shift_scenarios`), each a `PhaseSchedule` on the paper's cluster under
`hexgen-flow`, each run under

- **static**: α tuned offline on the first phase (`tune_alpha` on a fresh arrival sample of
  that phase, seed + 1, as ``--alpha auto`` does) and kept;
- **online**: the same start, then the mesh tuner's loop inside the simulation
  (`hexgen_flow.tuning.OnlineTuner`: every period, `retune` on the last finished queries);
- **fixed α**: every α of the tuner's grid for the whole run; the **best fixed α in
  hindsight** is the one with the lowest P95 (then higher attainment).

A static α is one draw: tuned on another sample of the first phase it may land elsewhere on
a flat curve. `static_draws` shows the α that five samples give (quick: three) and what
each would have done over the whole run.

**High load** (`HighLoad`): 30 queries/s of the paper's trace mix on a cluster of
Qwen3-30B-A3B instances sized for it; `hexgen-flow` (α tuned on another arrival sample, as
``--alpha auto`` does) against round-robin `vllm`, `llf` and `least-requests`.

`run_shifting_load` returns one JSON-able document; `render_markdown` and `plot_shifting`
render it. Everything but the wall times is a pure function of the seed.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hexgen_flow.bench.report import fmt, md_table
from hexgen_flow.cluster import Cluster, parse_cluster
from hexgen_flow.metrics import RunMetrics, json_safe, percentile
from hexgen_flow.policies.presets import PRESETS
from hexgen_flow.sim.schedule import Phase, PhaseSchedule, ScheduledRun
from hexgen_flow.sim.simulator import SimConfig, simulate
from hexgen_flow.tuning import (
    ALPHA_GRID,
    AlphaPoint,
    AlphaStep,
    OnlineSettings,
    run_online,
    tune_alpha,
)

__all__ = [
    "HIGH_LOAD",
    "PLOT_FILE",
    "HighLoad",
    "ShiftScenario",
    "plot_shifting",
    "render_markdown",
    "run_shifting_load",
    "shift_scenarios",
]

PRESET = "hexgen-flow"
PAPER_CLUSTER = "A100,A100,A6000,L40S"
MIX = ("trace1", "trace2", "trace3")
STATIC_DRAWS = 5
"""First-phase samples the static α is tuned on (the first is the static α itself), to show
how much it depends on the one sample (quick: 3)."""
WITHIN = 0.05
"""The goal: online P95 within this fraction of the best fixed α's."""
PLOT_FILE = "shifting_load.png"

ONLINE = OnlineSettings(period_s=180.0, window=200, min_queries=20, tolerance=0.05)
"""The online tuner's settings in every scenario: the mesh tuner's window, min-queries and
tolerance, and a run every 180 simulated seconds (the mesh's 30 wall seconds are 30 to 600
cluster seconds at time scales 1 to 20); docs/design.md, "Shifting load and online tuning",
explains them."""
QUICK_ONLINE = OnlineSettings(period_s=200.0, window=100, min_queries=20, tolerance=0.05)
"""The quick plan's: fewer, smaller replays (a smoke run, not a measurement)."""


@dataclass(frozen=True, slots=True)
class ShiftScenario:
    key: str
    title: str
    cluster: str
    phases: tuple[Phase, ...]
    tuning: OnlineSettings = ONLINE
    preset: str = PRESET


def shift_scenarios(quick: bool = False) -> tuple[ShiftScenario, ...]:
    """λ low -> high -> low on the paper's trace mix, and a switch from the light financial
    trace to the heavy trace3 at one rate; `quick`: phases a third as long, `QUICK_ONLINE`."""
    d = 600.0 if quick else 1800.0
    tuning = QUICK_ONLINE if quick else ONLINE
    return (
        ShiftScenario(
            "load",
            "load: λ 0.04 -> 0.14 -> 0.04 q/s (trace1-3 interleaved)",
            PAPER_CLUSTER,
            (
                Phase(0.04, MIX, duration_s=d, label="low"),
                Phase(0.14, MIX, duration_s=d, label="high"),
                Phase(0.04, MIX, duration_s=d, label="low again"),
            ),
            tuning,
        ),
        ShiftScenario(
            "mix",
            "mix: financial -> trace3 at λ 0.12 q/s",
            PAPER_CLUSTER,
            (
                Phase(0.12, ("financial",), duration_s=d, label="financial"),
                Phase(0.12, ("trace3",), duration_s=d, label="trace3"),
            ),
            tuning,
        ),
    )


@dataclass(frozen=True, slots=True)
class HighLoad:
    """The 30 q/s run."""

    cluster: str = "H100x64,H200x96,A100x48,L40Sx32"
    """Qwen3-30B-A3B at its profiled tp: 1 GPU per H100/H200/A100 instance, 2 per L40S (240
    instances, 272 GPUs): the smallest of the sizes tried at which `hexgen-flow` meets the
    SLO for at least 95 % of the queries at 30 q/s (docs/design.md)."""
    model: str = "qwen3-30b-a3b"
    qps: float = 30.0
    num_queries: int = 2000
    """67 s of arrivals: P95 by thirds of the run is flat, a steady state."""
    tune_queries: int = 400
    tune_grid: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    """A coarse grid (plus the refining midpoints): α moves P95 by a few % here, and each
    replay costs seconds on 240 instances."""
    presets: tuple[str, ...] = (PRESET, "vllm", "llf", "least-requests")


HIGH_LOAD = HighLoad()
QUICK_HIGH_LOAD = HighLoad(num_queries=400, tune_queries=150, tune_grid=(0.3, 0.7))


def _log(progress: bool, text: str) -> None:
    if progress:
        print(f"shifting: {text}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ records


def _record(metrics: RunMetrics, run: ScheduledRun) -> dict[str, Any]:
    """P95, mean and attainment of the whole run and of each phase."""
    lat = metrics.latency_summary()
    phase = run.phase_by_id()
    per: list[list[float]] = [[] for _ in run.bounds_s]
    met = [0] * len(run.bounds_s)
    for o in metrics.outcomes:
        per[phase[o.query_id]].append(o.latency_s)
        met[phase[o.query_id]] += o.met_slo
    counts = [run.phase_of.count(k) for k in range(len(run.bounds_s))]
    return {
        "p95_s": lat["p95"],
        "mean_s": lat["mean"],
        "slo_attainment": metrics.slo_attainment,
        "completed": metrics.completed,
        "phases": [
            {
                "p95_s": percentile(per[k], 95),
                "slo_attainment": met[k] / counts[k] if counts[k] else float("nan"),
            }
            for k in range(len(counts))
        ],
    }


def _rank(rec: dict[str, Any]) -> tuple[float, float, float]:
    # The tuner's own ranking (AlphaPoint.rank): P95, then attainment, then the smaller α.
    return AlphaPoint(rec["alpha"], rec["p95_s"], rec["mean_s"], rec["slo_attainment"]).rank()


def _alpha_by_phase(
    start: float, steps: Sequence[AlphaStep], bounds: Sequence[tuple[float, float]]
) -> list[dict[str, float]]:
    """The α in force over each phase: time-weighted mean, lowest and highest."""
    changes = [(0.0, start)] + [(s.time_s, s.alpha) for s in steps if s.changed]
    out = []
    for lo, hi in bounds:
        spans: list[tuple[float, float]] = []  # (seconds, α)
        for k, (t, alpha) in enumerate(changes):
            t_end = changes[k + 1][0] if k + 1 < len(changes) else float("inf")
            overlap = min(hi, t_end) - max(lo, t)
            if overlap > 0:
                spans.append((overlap, alpha))
        total = sum(w for w, _ in spans)
        out.append(
            {
                "mean": sum(w * a for w, a in spans) / total,
                "min": min(a for _, a in spans),
                "max": max(a for _, a in spans),
            }
        )
    return out


# ---------------------------------------------------------------------------- scenarios


def _static(sc: ShiftScenario, cluster: Cluster, seed: int) -> tuple[float, tuple[AlphaPoint, ...]]:
    """α tuned on a fresh sample (`seed`) of the first phase alone."""
    first = PhaseSchedule(sc.phases[:1]).build(seed)
    config = SimConfig(qps=sc.phases[0].qps, seed=seed)
    result = tune_alpha(first.queries, cluster, PRESETS[sc.preset], config)
    return result.alpha, result.curve


def run_scenario(
    sc: ShiftScenario,
    *,
    seed: int = 0,
    draws: int = STATIC_DRAWS,
    from_worst: bool = True,
    calibration: str | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """One scenario: static, online and every fixed α of the grid (module docstring);
    `from_worst`: also the online tuner started from the worst of the `draws` static α."""
    started = time.perf_counter()
    cluster = parse_cluster(sc.cluster, calibration=calibration)
    run = PhaseSchedule(sc.phases).build(seed)
    config = SimConfig(qps=run.mean_qps, seed=seed)
    preset = PRESETS[sc.preset]
    runs: dict[float, dict[str, Any]] = {}

    def fixed(alpha: float) -> dict[str, Any]:
        if alpha not in runs:
            metrics = simulate(run.queries, cluster, preset.with_alpha(alpha), config)
            runs[alpha] = {"alpha": alpha, **_record(metrics, run)}
        return runs[alpha]

    for alpha in ALPHA_GRID:
        rec = fixed(alpha)
        _log(progress, f"{sc.key}: fixed alpha {alpha:g}: P95 {rec['p95_s']:.1f} s")
    grid = [runs[a] for a in ALPHA_GRID]
    best = min(grid, key=_rank)

    static_alpha, static_curve = _static(sc, cluster, seed + 1)
    static = fixed(static_alpha)
    static_draws = []
    for k in range(1, draws + 1):
        alpha = static_alpha if k == 1 else _static(sc, cluster, seed + k)[0]
        rec = fixed(alpha)
        static_draws.append(
            {
                "seed": seed + k,
                "alpha": alpha,
                "p95_s": rec["p95_s"],
                "slo_attainment": rec["slo_attainment"],
            }
        )
    _log(
        progress,
        f"{sc.key}: static alpha {static_alpha:g} (draws {[d['alpha'] for d in static_draws]})",
    )

    def online_from(start: float) -> tuple[dict[str, Any], tuple[AlphaStep, ...]]:
        metrics, steps = run_online(
            run.queries, cluster, preset.with_alpha(start), config, sc.tuning
        )
        return {"alpha": start, **_record(metrics, run)}, steps

    online_started = time.perf_counter()
    online, steps = online_from(static_alpha)
    online_wall = time.perf_counter() - online_started
    _log(progress, f"{sc.key}: online P95 {online['p95_s']:.1f} s")
    # The static α is one draw; started from the worst draw instead, does the tuner recover?
    worst_alpha = max(static_draws, key=lambda d: _rank(fixed(d["alpha"])))["alpha"]
    worst: dict[str, Any] | None = None
    if from_worst and worst_alpha != static_alpha:
        worst, worst_steps = online_from(worst_alpha)
        worst["static_p95_s"] = fixed(worst_alpha)["p95_s"]
        worst["static_slo_attainment"] = fixed(worst_alpha)["slo_attainment"]
        worst["alpha_changes"] = sum(s.changed for s in worst_steps)
        worst["trajectory"] = _trajectory(worst_steps)
        worst["alpha_by_phase"] = _alpha_by_phase(worst_alpha, worst_steps, run.bounds_s)
        _log(progress, f"{sc.key}: online from alpha {worst_alpha:g}: P95 {worst['p95_s']:.1f} s")
    draws_p95 = sum(d["p95_s"] for d in static_draws) / len(static_draws)

    return {
        "key": sc.key,
        "title": sc.title,
        "cluster": sc.cluster,
        "calibration": cluster.calibration.name,
        "policy": sc.preset,
        "seed": seed,
        "phases": [
            {
                "label": p.name,
                "qps": p.qps,
                "traces": list(p.traces),
                "start_s": lo,
                "end_s": hi,
                "num_queries": run.phase_of.count(k),
            }
            for k, (p, (lo, hi)) in enumerate(zip(sc.phases, run.bounds_s, strict=True))
        ],
        "tuning": {
            "period_s": sc.tuning.period_s,
            "window": sc.tuning.window,
            "min_queries": sc.tuning.min_queries,
            "tolerance": sc.tuning.tolerance,
        },
        "static": static,
        "static_curve": [
            {"alpha": p.alpha, "p95_s": p.p95_s, "slo_attainment": p.slo_attainment}
            for p in static_curve
        ],
        "static_draws": static_draws,
        "static_draws_mean_p95_s": draws_p95,
        "online": online,
        "online_from_worst_draw": worst,
        "best_fixed": best,
        "fixed": grid,
        "trajectory": _trajectory(steps),
        "alpha_changes": sum(s.changed for s in steps),
        "alpha_by_phase": _alpha_by_phase(static_alpha, steps, run.bounds_s),
        "checks": {
            "online_p95_over_best": online["p95_s"] / best["p95_s"],
            "online_within_5pct_of_best": online["p95_s"] <= (1 + WITHIN) * best["p95_s"],
            "online_p95_below_static": online["p95_s"] < static["p95_s"],
            "online_attainment_at_least_static": (
                online["slo_attainment"] >= static["slo_attainment"]
            ),
            "online_p95_over_static_draws_mean": online["p95_s"] / draws_p95,
            "from_worst_p95_over_best": None if worst is None else worst["p95_s"] / best["p95_s"],
        },
        "online_wall_s": online_wall,
        "wall_s": time.perf_counter() - started,
    }


def _trajectory(steps: Sequence[AlphaStep]) -> list[dict[str, Any]]:
    return [
        {
            "time_s": s.time_s,
            "alpha": s.alpha,
            "changed": s.changed,
            "window": s.window,
            "window_qps": s.window_qps,
            "reason": s.reason,
        }
        for s in steps
    ]


def run_high_load(
    hl: HighLoad = HIGH_LOAD,
    *,
    seed: int = 0,
    calibration: str | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """`hl.presets` at `hl.qps` on the trace mix; `hexgen-flow`'s α tuned first on another
    arrival sample (seed + 1, `hl.tune_queries` queries), as ``--alpha auto`` does."""
    started = time.perf_counter()
    cluster = parse_cluster(hl.cluster, model=hl.model, calibration=calibration)
    run = PhaseSchedule((Phase(hl.qps, MIX, num_queries=hl.num_queries),)).build(seed)
    config = SimConfig(qps=hl.qps, seed=seed)
    results: dict[str, dict[str, Any]] = {}
    curve: list[dict[str, float]] = []
    slo_s = float("nan")
    for name in hl.presets:
        preset = PRESETS[name]
        if preset.has_alpha:
            sample = PhaseSchedule((Phase(hl.qps, MIX, num_queries=hl.tune_queries),)).build(
                seed + 1
            )
            tuning = tune_alpha(
                sample.queries,
                cluster,
                preset,
                SimConfig(qps=hl.qps, seed=seed + 1),
                grid=hl.tune_grid,
            )
            preset = preset.with_alpha(tuning.alpha)
            curve = [
                {"alpha": p.alpha, "p95_s": p.p95_s, "slo_attainment": p.slo_attainment}
                for p in tuning.curve
            ]
        run_started = time.perf_counter()
        metrics = simulate(run.queries, cluster, preset, config)
        lat = metrics.latency_summary()
        slo_s = metrics.slo_s
        results[name] = {
            "alpha": metrics.alpha,
            "p95_s": lat["p95"],
            "mean_s": lat["mean"],
            "slo_attainment": metrics.slo_attainment,
            "throughput_qps": metrics.throughput_qps,
            "wall_s": time.perf_counter() - run_started,
        }
        _log(progress, f"high load: {name}: P95 {lat['p95']:.1f} s")
    base = results["vllm"]["p95_s"] if "vllm" in results else None
    for rec in results.values():
        rec["speedup_vs_vllm"] = base / rec["p95_s"] if base else None
    return {
        "cluster": hl.cluster,
        "model": hl.model,
        "instances": len(cluster),
        "gpus": sum(i.latency.hardware.tensor_parallel for i in cluster.instances),
        "calibration": cluster.calibration.name,
        "qps": hl.qps,
        "num_queries": len(run.queries),
        "slo_s": slo_s,
        "results": results,
        "alpha_curve": curve,
        "wall_s": time.perf_counter() - started,
    }


def run_shifting_load(
    quick: bool = False, progress: bool = False, *, calibration: str | None = None
) -> dict[str, Any]:
    """Every scenario and the high-load run; one JSON-able document (non-finite floats as
    None). `quick` (a smoke run, not a measurement): phases a third as long, smaller replays,
    three static samples and no run from the worst, 400 queries at high load. `calibration`:
    the latency numbers' source (None: the default calibration)."""
    started = time.perf_counter()
    scenarios = [
        run_scenario(
            sc,
            draws=3 if quick else STATIC_DRAWS,
            from_worst=not quick,
            calibration=calibration,
            progress=progress,
        )
        for sc in shift_scenarios(quick)
    ]
    high = run_high_load(
        QUICK_HIGH_LOAD if quick else HIGH_LOAD, calibration=calibration, progress=progress
    )
    doc = {
        "quick": quick,
        "policy": PRESET,
        "goal": f"online P95 within {100 * WITHIN:g} % of the best fixed alpha, and below "
        "the static first-phase alpha's with at least its attainment",
        "scenarios": scenarios,
        "high_load": high,
        "wall_s": time.perf_counter() - started,
    }
    result: dict[str, Any] = json_safe(doc)
    return result


# ------------------------------------------------------------------------------- report


def _pct(value: float | None) -> str:
    return fmt(None if value is None else 100 * value, ".1f", " %")


def _cell(rec: dict[str, Any]) -> str:
    return f"{fmt(rec['p95_s'])} s ({_pct(rec['slo_attainment'])})"


def _alpha(value: float | None) -> str:
    return "n/a" if value is None else f"{value:g}"


def _scenario_lines(sc: dict[str, Any]) -> list[str]:
    phases = sc["phases"]
    lines = [
        f"### {sc['title']}",
        "",
        f"`{sc['policy']}` on {sc['cluster']} (calibration `{sc['calibration']}`), seed "
        f"{sc['seed']}; phases: "
        + "; ".join(
            f"{p['label']} ({p['start_s']:.0f}-{p['end_s']:.0f} s, {p['num_queries']} queries)"
            for p in phases
        )
        + f". Online tuner: every {sc['tuning']['period_s']:g} s, the last "
        f"{sc['tuning']['window']} finished queries, tolerance "
        f"{100 * sc['tuning']['tolerance']:g} %.",
        "",
    ]
    worst = sc["online_from_worst_draw"]
    variants = [
        (f"static (tuned on {phases[0]['label']})", sc["static"], _alpha(sc["static"]["alpha"])),
        (
            "online re-tuning",
            sc["online"],
            f"{_alpha(sc['online']['alpha'])}, {sc['alpha_changes']} changes",
        ),
        ("best fixed in hindsight", sc["best_fixed"], _alpha(sc["best_fixed"]["alpha"])),
    ]
    if worst is not None:
        variants.append(
            (
                "online from the worst static draw",
                worst,
                f"{_alpha(worst['alpha'])}, {worst['alpha_changes']} changes",
            )
        )
    rows = [
        [name, alpha, f"{fmt(rec['p95_s'])} s", _pct(rec["slo_attainment"])]
        + [_cell(p) for p in rec["phases"]]
        for name, rec, alpha in variants
    ]
    header = [
        "variant",
        "α (start)",
        "P95",
        "attainment",
        *(f"{p['label']}: P95 (att.)" for p in phases),
    ]
    lines += md_table(header, rows, left=2)
    checks = sc["checks"]
    by_phase = ", ".join(
        f"{p['label']} {a['mean']:.2f} ({a['min']:g}-{a['max']:g})"
        for p, a in zip(phases, sc["alpha_by_phase"], strict=True)
    )
    lines += [
        "",
        f"Online α by phase, time-weighted mean (range): {by_phase}.",
        "",
        "Every fixed α, whole run: "
        + ", ".join(f"{_alpha(r['alpha'])}: {_cell(r)}" for r in sc["fixed"])
        + ".",
        "",
        "The static α tuned on other first-phase samples, and its whole-run P95: "
        + ", ".join(
            f"seed {d['seed']}: α {_alpha(d['alpha'])}, {fmt(d['p95_s'])} s"
            for d in sc["static_draws"]
        )
        + f"; mean {fmt(sc['static_draws_mean_p95_s'])} s (online: "
        f"{fmt(checks['online_p95_over_static_draws_mean'], '.3f')} of it).",
        "",
        f"Goal: online P95 / best fixed = {fmt(checks['online_p95_over_best'], '.3f')} "
        f"({'within' if checks['online_within_5pct_of_best'] else 'NOT within'} 5 %); "
        f"P95 {'below' if checks['online_p95_below_static'] else 'NOT below'} static, "
        f"attainment {'at least' if checks['online_attainment_at_least_static'] else 'BELOW'} "
        f"static's."
        + (
            ""
            if worst is None
            else f" Started from the worst draw (α {_alpha(worst['alpha'])}, static P95 "
            f"{fmt(worst['static_p95_s'])} s), online ends at "
            f"{fmt(checks['from_worst_p95_over_best'], '.3f')} of the best fixed α."
        ),
        "",
    ]
    return lines


def render_markdown(result: dict[str, Any]) -> str:
    """The document of `run_shifting_load` as Markdown (a section of results.md)."""
    lines = [
        "## Shifting load and online tuning",
        "",
        f"Goal: {result['goal']}. Wall time {fmt(result['wall_s'])} s"
        + (" (quick)." if result["quick"] else "."),
        "",
    ]
    for sc in result["scenarios"]:
        lines += _scenario_lines(sc)
    hl = result["high_load"]
    lines += [
        f"### High load: {hl['qps']:g} q/s",
        "",
        f"{hl['num_queries']} queries of trace1-3 interleaved at {hl['qps']:g} q/s on "
        f"{hl['instances']} `{hl['model']}` instances ({hl['gpus']} GPUs: {hl['cluster']}), "
        f"calibration `{hl['calibration']}`, SLO {fmt(hl['slo_s'])} s.",
        "",
    ]
    rows = [
        [
            f"`{name}`",
            _alpha(rec["alpha"]),
            f"{fmt(rec['p95_s'])} s",
            f"{fmt(rec['mean_s'])} s",
            _pct(rec["slo_attainment"]),
            fmt(rec["speedup_vs_vllm"], ".2f", "x"),
        ]
        for name, rec in hl["results"].items()
    ]
    lines += md_table(["policy", "α", "P95", "mean", "attainment", "P95 speedup over vllm"], rows)
    lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------------- plot


def plot_shifting(result: dict[str, Any], out: Path) -> tuple[str, ...]:
    """`PLOT_FILE` in `out`: per scenario, the online α over time beside the static and the
    best fixed α (phases shaded), and P95 per phase of the three; returns the file names."""
    import matplotlib  # noqa: PLC0415 - heavy; imported only when plotting

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - must follow matplotlib.use

    scenarios = result["scenarios"]
    fig, axes = plt.subplots(
        len(scenarios),
        2,
        figsize=(13, 3.8 * len(scenarios)),
        squeeze=False,
        gridspec_kw={"width_ratios": [2.2, 1]},
    )
    colors = {"static": "tab:orange", "online": "tab:blue", "best_fixed": "tab:green"}
    labels = {"static": "static", "online": "online", "best_fixed": "best fixed"}
    for row, sc in zip(axes, scenarios, strict=True):
        ax, bars = row
        # The tuner runs on while queries are in flight, past the last phase's end.
        end = max([sc["phases"][-1]["end_s"], *(s["time_s"] for s in sc["trajectory"])])
        for k, p in enumerate(sc["phases"]):
            ax.axvspan(p["start_s"], p["end_s"], color="0.9" if k % 2 else "0.97", zorder=0)
            ax.text((p["start_s"] + p["end_s"]) / 2, 1.04, p["label"], ha="center", fontsize=8)
        runs: list[tuple[float, list[dict[str, Any]], str, str]] = [
            (sc["static"]["alpha"], sc["trajectory"], "tab:blue", "online α")
        ]
        worst = sc["online_from_worst_draw"]
        if worst is not None:
            runs.append(
                (worst["alpha"], worst["trajectory"], "tab:purple", "online α, worst start")
            )
        for start, steps, color, label in runs:
            times = [0.0] + [s["time_s"] for s in steps] + [end]
            alphas = [start] + [s["alpha"] for s in steps]
            ax.step(times, [*alphas, alphas[-1]], where="post", color=color, label=label)
        ax.axhline(sc["static"]["alpha"], color=colors["static"], ls="--", label="static α")
        ax.axhline(
            sc["best_fixed"]["alpha"], color=colors["best_fixed"], ls=":", label="best fixed α"
        )
        ax.set_xlim(0, end)
        ax.set_ylim(-0.05, 1.1)
        ax.set_xlabel("simulated time (s)")
        ax.set_ylabel("α")
        ax.set_title(sc["title"], fontsize=10, pad=14)
        ax.legend(fontsize=7, loc="lower right")
        n = len(sc["phases"])
        width = 0.8 / 3
        for j, key in enumerate(("static", "online", "best_fixed")):
            xs = [k + (j - 1) * width for k in range(n)]
            ys = [p["p95_s"] for p in sc[key]["phases"]]
            bars.bar(xs, ys, width, color=colors[key], label=labels[key])
        bars.set_xticks(range(n), [p["label"] for p in sc["phases"]], fontsize=8)
        bars.set_ylabel("P95 latency per phase (s)")
        bars.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / PLOT_FILE, dpi=110)
    plt.close(fig)
    return (PLOT_FILE,)
