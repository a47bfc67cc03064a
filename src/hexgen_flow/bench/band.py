"""The sensitivity band: the matrix's headline ratios under every shipped calibration and
several arrival seeds, reported as a range, not as one number.

One calibration and one seed give one figure, and the figure moves with both: the same code
gave 0.9x to 4.9x over round-robin depending on latency assumptions nobody had measured. The
band runs `FLAGSHIP`, `BASELINE` and the load-aware routers on every (calibration, prefix
caching on or off, seed, cluster, trace, rate) and keeps, per calibration, caching and
cluster, the lowest and highest ratio
of `FLAGSHIP` over `BASELINE` and over the best load-aware router of that very row and seed.
Homogeneous clusters are part of it: there the claim is only "never worse" (a ratio >= 0.98).
"""

from __future__ import annotations

import itertools
from typing import Any

from hexgen_flow.bench.plan import BAND_PRESETS, BASELINE, FLAGSHIP, LOAD_AWARE, BenchPlan

__all__ = ["assemble_band", "band_lines"]


def _presets(plan: BenchPlan) -> list[str]:
    return [p for p in BAND_PRESETS if p in plan.presets]


def _span(values: list[float]) -> dict[str, float | None]:
    return {"min": min(values), "max": max(values)} if values else {"min": None, "max": None}


def assemble_band(
    plan: BenchPlan, results: dict[tuple[Any, ...], dict[str, Any]]
) -> dict[str, Any]:
    """results.json's "band": per calibration and cluster the min-max of `FLAGSHIP`'s P95
    ratios over every trace, rate and seed, and every row they come from."""
    presets = _presets(plan)
    routers = [p for p in presets if p in LOAD_AWARE]
    rows = []
    spans = []
    for calibration, caching, (label, spec) in itertools.product(
        plan.band_calibration_list, plan.band_caching_list, plan.band_clusters
    ):
        over_vllm: list[float] = []
        over_router: list[float] = []
        for seed, trace, qps in itertools.product(plan.band_seeds, plan.traces, plan.qps):
            key = ("band", calibration, caching, seed, label, trace, qps)
            p95 = {p: results[(*key, p)]["p95_s"] for p in presets}
            router = min(routers, key=lambda p: (p95[p], routers.index(p)))
            ours = p95[FLAGSHIP]
            row = {
                "calibration": calibration,
                "prefix_caching": caching,
                "seed": seed,
                "cluster": label,
                "trace": trace,
                "qps": qps,
                "p95_s": p95,
                "best_router": router,
                "speedup_vs_vllm": p95[BASELINE] / ours,
                "speedup_vs_best_router": p95[router] / ours,
            }
            rows.append(row)
            over_vllm.append(row["speedup_vs_vllm"])
            over_router.append(row["speedup_vs_best_router"])
        spans.append(
            {
                "calibration": calibration,
                "prefix_caching": caching,
                "cluster": label,
                "gpus": spec,
                "homogeneous": len(set(spec.split(","))) == 1,
                "speedup_vs_vllm": _span(over_vllm),
                "speedup_vs_best_router": _span(over_router),
            }
        )
    return {
        "calibrations": list(plan.band_calibration_list),
        "prefix_caching": list(plan.band_caching_list),
        "seeds": list(plan.band_seeds),
        "traces": list(plan.traces),
        "qps": list(plan.qps),
        "presets": presets,
        "bands": spans,
        "rows": rows,
    }


def _range(span: dict[str, float | None]) -> str:
    low, high = span["min"], span["max"]
    if low is None or high is None:
        return "n/a"
    return f"{low:.2f}-{high:.2f}x"


def band_lines(band: dict[str, Any]) -> list[str]:
    """results.md's band section."""
    seeds = ", ".join(str(s) for s in band["seeds"])
    lines = [
        "",
        "## Sensitivity band: every calibration, prefix caching on and off, several seeds",
        "",
        f"`{FLAGSHIP}`'s P95 speedup as a range (min-max) over traces "
        f"{', '.join(band['traces'])}, rates {', '.join(f'{q:g}' for q in band['qps'])} q/s and "
        f"arrival seeds {seeds}; the best load-aware router is chosen per row and seed among "
        f"{', '.join(f'`{p}`' for p in band['presets'] if p in LOAD_AWARE)}. On a homogeneous "
        "cluster the claim is only that it is never worse (>= 0.98x).",
        "",
        "| calibration | prefix caching | cluster | GPUs | over `vllm` | over best router |",
        "|---|---|---|---|---:|---:|",
    ]
    for span in band["bands"]:
        kind = " (homogeneous)" if span["homogeneous"] else ""
        caching = "on" if span["prefix_caching"] else "off"
        lines.append(
            f"| `{span['calibration']}` | {caching} | {span['cluster']}{kind} | {span['gpus']} | "
            f"{_range(span['speedup_vs_vllm'])} | {_range(span['speedup_vs_best_router'])} |"
        )
    return lines
