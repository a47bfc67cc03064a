"""The benchmark's plots (PNG, matplotlib), drawn from its results document."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hexgen_flow.bench.plan import BenchPlan

__all__ = ["PLOTS", "plot", "plot_files"]

PLOTS = ("p95_matrix.png", "goodput.png", "p95_vs_load.png", "attainment_vs_slo.png")
_PLOT_PARTS = {"p95_vs_load.png": "load_sweep", "attainment_vs_slo.png": "slo_sweep"}
"""The plots of optional parts, drawn only when `doc` has that part."""


def plot_files(doc: dict[str, Any]) -> tuple[str, ...]:
    """The names of the plots `plot` draws for `doc`, in `PLOTS` order."""
    return tuple(name for name in PLOTS if _PLOT_PARTS.get(name, "matrix") in doc)


def plot(plan: BenchPlan, doc: dict[str, Any], out: Path) -> tuple[str, ...]:
    """Draw the plots of `doc` into `out`; returns their file names (`plot_files`)."""
    import matplotlib  # noqa: PLC0415 - heavy; imported only when plotting

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - must follow matplotlib.use

    presets = list(plan.presets)
    # tab10 while it has a color per preset; past ten presets it would repeat one.
    palette = plt.get_cmap("tab10" if len(presets) <= 10 else "tab20")
    colors = {p: palette(i % palette.N) for i, p in enumerate(presets)}
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
    policies = plan.goodput_policies
    gp_width = 0.8 / len(policies)
    for j, p in enumerate(policies):
        xs = [g + (j - (len(policies) - 1) / 2) * gp_width for g in range(len(plan.traces))]
        ax.bar(xs, [gp[(t, p)] for t in plan.traces], gp_width, label=p, color=colors[p])
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
    if "load_sweep" in doc:
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
    if "slo_sweep" in doc:
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
    return plot_files(doc)
