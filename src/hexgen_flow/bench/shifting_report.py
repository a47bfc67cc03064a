"""The shifting-load benchmark's report: the markdown tables and the α-over-time plot of
what `hexgen_flow.bench.shifting.run_shifting_load` returns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hexgen_flow.bench.report import fmt, md_table
from hexgen_flow.bench.shifting import PLOT_FILE

__all__ = ["plot_shifting", "render_markdown"]


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
        f"{sc['tuning']['window']} admitted queries, tolerance "
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
