"""The benchmark's Markdown report (results.md), rendered from its results document."""

from __future__ import annotations

import math
from typing import Any

from hexgen_flow.bench.band import band_lines
from hexgen_flow.bench.markdown import fmt, md_table
from hexgen_flow.bench.plan import BASELINE, FLAGSHIP, NEAR_BEST, BenchPlan
from hexgen_flow.bench.plots import plot_files
from hexgen_flow.bench.shifting_report import render_markdown as render_shifting
from hexgen_flow.policies.presets import PRESETS

__all__ = ["render_markdown"]


def _vs_router(ratio: float | None, router: str | None) -> str:
    """A ratio over the best load-aware router, naming it."""
    if router is None:
        return "n/a (no load-aware router in the plan)"
    return f"{fmt(ratio, '.2f', 'x')} over `{router}`"


def _planner_lines(meta: dict[str, Any]) -> list[str]:
    """What the planner believed, when it was not simply the engines' table."""
    planner = meta.get("planner_calibration", meta["calibration"])
    errors = meta.get("planner_error") or {}
    learn = meta.get("learn_costs", False)
    lengths = meta.get("output_lengths", "known")
    if planner == meta["calibration"] and not errors and not learn and lengths == "known":
        return []
    text = f"Planner: every policy, the alpha tuner and admission believe `{planner}`"
    if errors:
        text += " with " + ", ".join(
            f"{gpu} prefill x{e['prefill']:g} decode x{e['decode']:g}" for gpu, e in errors.items()
        )
    text += " while the engines run the calibration above"
    if learn:
        text += "; every scheduler learns each instance's costs online (`--learn-costs`)"
    if lengths != "known":
        text += f"; output lengths: `{lengths}` (the engines generate the workload's)"
    return [text + ' (docs/design.md, "Truth, belief and learning what each instance costs").', ""]


def _summary_lines(plan: BenchPlan, doc: dict[str, Any]) -> list[str]:
    head = doc["headline"]
    x1_label, x1 = plan.clusters[0]
    routers = ", ".join(f"`{p}`" for p in head["load_aware"]) or "none in this plan"
    lines = ["## Summary", ""]
    # Both baselines, always side by side: round-robin vLLM is the paper's baseline, the best
    # load-aware router is what people actually run.
    speedups = "; ".join(
        f"{trace}: "
        + ", ".join(
            f"{fmt(v, '.2f', 'x')} over `{BASELINE}` and "
            f"{_vs_router(over[q]['speedup'], over[q]['router'])} at {q} qps"
            for q, v in by_qps.items()
        )
        for (trace, by_qps), over in zip(
            head["p95_speedup_vs_vllm_x1"].items(),
            head["p95_speedup_vs_best_router_x1"].values(),
            strict=True,
        )
    )
    lines.append(
        f"- **P95 speedup of `{FLAGSHIP}`** on {x1_label} ({x1}) over `{BASELINE}` "
        f"(round-robin + FCFS, the paper's baseline) and over the best load-aware router of "
        f"the row (lowest P95 of {routers}): {speedups}."
    )
    gp = doc["goodput"]
    by_trace: dict[str, dict[str, float]] = {}
    for r in gp["results"]:
        by_trace.setdefault(r["trace"], {})[r["policy"]] = r["goodput_qps"]
    goodputs = "; ".join(
        f"{trace}: {fmt(g[FLAGSHIP], '.3f')} qps, "
        f"{fmt(head['goodput_ratio_vs_vllm'][trace], '.2f', 'x')} `{BASELINE}` "
        f"({fmt(g[BASELINE], '.3f')}) and "
        + _vs_router(
            head["goodput_ratio_vs_best_router"][trace]["ratio"],
            gp["best_router"][trace]["policy"],
        )
        + f" ({fmt(gp['best_router'][trace]['goodput_qps'], '.3f')})"
        for trace, g in by_trace.items()
    )
    lines.append(
        f"- **Goodput of `{FLAGSHIP}`** over `{BASELINE}` and over the best load-aware "
        f"router (highest rate with >= {100 * gp['target_attainment']:.0f} % of "
        f"{gp['num_queries']} queries within {gp['slo_scale']:g} x SLO_base, on "
        f"{x1_label}): {goodputs}."
    )
    lines.append(
        f"- `{FLAGSHIP}` has the lowest P95 in {head['rows_best']} of {head['rows']} "
        f"matrix rows, and is best or within {100 * NEAR_BEST:.0f} % of the best in "
        f"{head['rows_best_or_within_2pct']}."
    )
    if "simulator_speed" in doc:
        speed = doc["simulator_speed"]
        lines.append(
            f"- Simulator: {fmt(speed['llm_calls_per_s'], ',.0f')} LLM calls/s "
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
    """results.md: the summary, then one section per part in `doc`."""
    meta = doc["meta"]
    lines = [
        f"# HexGen-Flow benchmark ({plan.name})",
        "",
        f"Simulated, seed {meta['seed']}, Poisson arrivals (cv {meta['arrival_cv']:g}), SLO "
        f"{meta['slo_scale']:g} x SLO_base unless stated; presets with alpha are auto-tuned at "
        "every setting (on other arrivals, seed + 1). Latencies in seconds; rates in "
        "queries/s.",
        "",
        f"Latency calibration: `{meta['calibration']}` (`hexgen-flow calibrations` lists its "
        f"source and caveats); engine model: `{meta['engine']}`"
        f"{' with prefix caching' if meta['prefix_caching'] else ''} (docs/design.md, "
        '"Simulated engine"); every figure below rests on both.',
        "",
        *_planner_lines(meta),
        *_summary_lines(plan, doc),
        *_matrix_lines(plan, doc),
        *_goodput_lines(plan, doc),
    ]
    optional = {
        "band": lambda _plan, doc: band_lines(doc["band"]),
        "slo_sweep": _slo_sweep_lines,
        "load_sweep": _load_sweep_lines,
        "multi_tenant": _tenant_lines,
        "simulator_speed": _speed_lines,
        "shifting_load": _shifting_lines,
    }
    for part, section in optional.items():
        if part in doc:
            lines += section(plan, doc)
    plots = [*plot_files(doc), *(["shifting_load.png"] if "shifting_load" in doc else [])]
    lines += ["", "Plots: " + ", ".join(f"`{p}`" for p in plots), ""]
    return "\n".join(lines)


def _shifting_lines(plan: BenchPlan, doc: dict[str, Any]) -> list[str]:
    return ["", render_shifting(doc["shifting_load"])]


def _matrix_lines(plan: BenchPlan, doc: dict[str, Any]) -> list[str]:
    presets = list(plan.presets)
    lines: list[str] = []
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
                text = fmt(cells[(*key, p)]["p95_s"])
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
        lines += md_table(["trace", "λ", *presets, "best", f"{FLAGSHIP} ≤2 %"], rows, left=2)
        lines += [
            "",
            f"### P95 speedup over `{BASELINE}` ({BASELINE} P95 / preset P95); last columns: "
            f"the best load-aware router (lowest P95) and `{FLAGSHIP}`'s speedup over it",
            "",
        ]
        lines += md_table(
            ["trace", "λ", *presets, "best router", f"{FLAGSHIP} over it"],
            (
                [
                    k[1],
                    f"{k[2]:g}",
                    *(fmt(row_info[k]["speedup_vs_vllm"][p], ".2f", "x") for p in presets),
                    row_info[k]["best_router"] or "n/a",
                    fmt(row_info[k]["speedup_vs_best_router"], ".2f", "x"),
                ]
                for k in keys
            ),
            left=2,
        )
        lines += ["", "### SLO attainment (%)", ""]
        lines += md_table(
            ["trace", "λ", *presets],
            (
                [
                    k[1],
                    f"{k[2]:g}",
                    *(fmt(100 * cells[(*k, p)]["slo_attainment"], ".1f") for p in presets),
                ]
                for k in keys
            ),
            left=2,
        )
        lines += ["", "### Mean latency (s)", ""]
        lines += md_table(
            ["trace", "λ", *presets],
            ([k[1], f"{k[2]:g}", *(fmt(cells[(*k, p)]["mean_s"]) for p in presets)] for k in keys),
            left=2,
        )
        alpha_presets = [p for p in presets if PRESETS[p].has_alpha]
        if alpha_presets:
            lines += ["", "### Tuned alpha", ""]
            lines += md_table(
                ["trace", "λ", *alpha_presets],
                (
                    [
                        k[1],
                        f"{k[2]:g}",
                        *(fmt(cells[(*k, p)]["alpha"], "g") for p in alpha_presets),
                    ]
                    for k in keys
                ),
                left=2,
            )
    return lines


def _goodput_lines(plan: BenchPlan, doc: dict[str, Any]) -> list[str]:
    presets = list(plan.goodput_policies)
    gp = doc["goodput"]
    lines = [
        "",
        f"## Goodput on {gp['cluster']}",
        "",
        f"Highest steady λ (queries/s) in (0, {gp['max_qps']:g}] with >= "
        f"{100 * gp['target_attainment']:.0f} % of {gp['num_queries']} queries within "
        f"{gp['slo_scale']:g} x SLO_base, bracketing + bisection to "
        f"{gp['resolution_qps']:g} qps; in parentheses: ratio over `{BASELINE}`. Last "
        f"columns: the best load-aware router (highest goodput) and `{FLAGSHIP}`'s ratio over "
        "it.",
        "",
    ]
    by_key = {(r["trace"], r["policy"]): r for r in gp["results"]}

    def over_router(t: str) -> str:
        mine = by_key.get((t, FLAGSHIP))
        return "n/a" if mine is None else fmt(mine["ratio_vs_best_router"], ".2f", "x")

    lines += md_table(
        ["trace", *presets, "best router", f"{FLAGSHIP} over it"],
        (
            [
                t,
                *(
                    f"{fmt(by_key[(t, p)]['goodput_qps'], '.3f')} "
                    f"({fmt(by_key[(t, p)]['ratio_vs_vllm'], '.2f', 'x')})"
                    for p in presets
                ),
                gp["best_router"][t]["policy"] or "n/a",
                over_router(t),
            ]
            for t in plan.traces
        ),
    )
    return lines


def _slo_sweep_lines(plan: BenchPlan, doc: dict[str, Any]) -> list[str]:
    presets = list(plan.presets)
    ss = doc["slo_sweep"]
    lines = [
        "",
        f"## SLO attainment (%) vs SLO scale: {ss['trace']}, {ss['num_queries']} "
        f"queries, λ {ss['qps']:g}, {ss['cluster']}",
        "",
    ]
    lines += md_table(
        ["policy", *(f"{s:g}x" for s in ss["slo_scales"])],
        ([p, *(fmt(100 * a, ".1f") for a in ss["slo_attainment"][p])] for p in presets),
    )
    return lines


def _load_sweep_lines(plan: BenchPlan, doc: dict[str, Any]) -> list[str]:
    presets = list(plan.presets)
    ls = doc["load_sweep"]
    lines = [
        "",
        f"## P95 latency (s) vs load: {ls['trace']}, {ls['num_queries']} queries, {ls['cluster']}",
        "",
    ]
    lines += md_table(
        ["policy", *(f"λ {q:g}" for q in ls["qps"])],
        ([p, *(fmt(v) for v in ls["p95_s"][p])] for p in presets),
    )
    return lines


def _tenant_lines(plan: BenchPlan, doc: dict[str, Any]) -> list[str]:
    presets = list(plan.presets)
    mt = doc["multi_tenant"]
    tenants = list(mt["tenants"])
    lines = [
        "",
        f"## Multi-tenant: {mt['trace']}, {mt['num_queries']} queries alternating "
        + ", ".join(f"{t} ({s:g} x SLO_base)" for t, s in mt["tenants"].items())
        + f", λ {mt['qps']:g}, {mt['cluster']}",
        "",
    ]
    lines += md_table(
        ["policy", *(f"{t} attainment (%)" for t in tenants), "overall (%)", "P95 (s)"],
        (
            [
                p,
                *(
                    fmt(100 * mt["results"][p]["tenant_attainment"].get(t, math.nan), ".1f")
                    for t in tenants
                ),
                fmt(100 * mt["results"][p]["slo_attainment"], ".1f"),
                fmt(mt["results"][p]["p95_s"]),
            ]
            for p in presets
        ),
    )
    return lines


def _speed_lines(plan: BenchPlan, doc: dict[str, Any]) -> list[str]:
    sp = doc["simulator_speed"]
    return [
        "",
        "## Simulator speed",
        "",
        f"- `simulate`: {sp['num_queries']:,} queries of {sp['trace']} ({sp['llm_calls']:,} "
        f"LLM calls) at λ {sp['qps']:g} with `{sp['policy']}` (alpha {sp['alpha']:g}): "
        f"{sp['simulate_wall_s']:.2f} s = {fmt(sp['llm_calls_per_s'], ',.0f')} calls/s",
        f"- `tune_alpha` on the same queries ({sp['tune_alpha_values']} alpha values): "
        f"{sp['tune_alpha_wall_s']:.2f} s",
    ]
