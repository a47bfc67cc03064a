"""The shifting-load benchmark's report: the markdown tables and the α-over-time plot of
what `hexgen_flow.bench.shifting.run_shifting_load` returns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hexgen_flow.bench.markdown import fmt, md_table
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
    draws = sc["draws"]
    starts = ", ".join(_alpha(d["alpha"]) for d in draws)
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
        f"{100 * sc['tuning']['tolerance']:g} %. Static and online: means over "
        f"{len(draws)} samples of the first phase the static α was tuned on (α {starts}).",
        "",
    ]
    variants = [
        (f"static (tuned on {phases[0]['label']})", sc["static"], starts),
        (
            "online re-tuning",
            sc["online"],
            f"from each; {sum(d['alpha_changes'] for d in draws)} changes in all",
        ),
        ("best fixed in hindsight", sc["best_fixed"], _alpha(sc["best_fixed"]["alpha"])),
    ]
    rows = [
        [name, alpha, f"{fmt(rec['p95_s'])} s", _pct(rec["slo_attainment"])]
        + [_cell(p) for p in rec["phases"]]
        for name, rec, alpha in variants
    ]
    header = ["variant", "α", "P95", "attainment", *(f"{p['label']}: P95 (att.)" for p in phases)]
    lines += md_table(header, rows, left=2)
    lines += [
        "",
        "Each sample: the static α, and the online tuner started from it (whole run):",
        "",
    ]
    rows = [
        [
            str(d["seed"]),
            _alpha(d["alpha"]),
            _cell(d["static"]),
            _cell(d["online"]),
            str(d["alpha_changes"]),
            ", ".join(f"{a['mean']:.2f} ({a['min']:g}-{a['max']:g})" for a in d["alpha_by_phase"]),
        ]
        for d in draws
    ]
    lines += md_table(
        ["sample", "static α", "static P95 (att.)", "online P95 (att.)", "changes",
         "online α by phase: mean (range)"],
        rows,
        left=1,
    )  # fmt: skip
    checks = sc["checks"]
    lines += [
        "",
        "Every fixed α, whole run: "
        + ", ".join(f"{_alpha(r['alpha'])}: {_cell(r)}" for r in sc["fixed"])
        + ".",
        "",
        f"Goal: online P95 / best fixed = {fmt(checks['online_p95_over_best'], '.3f')} "
        f"({'within' if checks['online_within_5pct_of_best'] else 'NOT within'} 5 %; the "
        f"worst sample {fmt(checks['worst_online_p95_over_best'], '.3f')}); online P95 / "
        f"static = {fmt(checks['online_p95_over_static'], '.3f')} "
        f"({'below' if checks['online_p95_below_static'] else 'NOT below'}), attainment "
        f"{'at least' if checks['online_attainment_at_least_static'] else 'BELOW'} static's.",
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
    """`PLOT_FILE` in `out`: per scenario, the online α over time from each static α (dots)
    beside the best fixed α (phases shaded), and P95 per phase of static and online (means
    over the samples) and the best fixed α; returns the file names."""
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
    labels = {"static": "static (mean)", "online": "online (mean)", "best_fixed": "best fixed"}
    for row, sc in zip(axes, scenarios, strict=True):
        ax, bars = row
        # The tuner runs on while queries are in flight, past the last phase's end.
        end = max(
            [
                sc["phases"][-1]["end_s"],
                *(s["time_s"] for d in sc["draws"] for s in d["trajectory"]),
            ]
        )
        for k, p in enumerate(sc["phases"]):
            ax.axvspan(p["start_s"], p["end_s"], color="0.9" if k % 2 else "0.97", zorder=0)
            ax.text((p["start_s"] + p["end_s"]) / 2, 1.04, p["label"], ha="center", fontsize=8)
        for k, d in enumerate(sc["draws"]):
            times = [0.0] + [s["time_s"] for s in d["trajectory"]] + [end]
            alphas = [d["alpha"]] + [s["alpha"] for s in d["trajectory"]]
            ax.step(
                times,
                [*alphas, alphas[-1]],
                where="post",
                color=colors["online"],
                alpha=0.35 + 0.65 / (k + 1),
                label="online α, from each static α" if k == 0 else None,
            )
            ax.plot([0.0], [d["alpha"]], "o", color=colors["static"], ms=4)
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
