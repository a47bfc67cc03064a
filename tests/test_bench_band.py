"""The benchmark's sensitivity band: every calibration, prefix-caching setting and seed it
names is run, the ranges are the extremes of the rows they summarise, the best router is
chosen per row and seed, and results.md shows it."""

from __future__ import annotations

from pathlib import Path

from hexgen_flow.bench import BenchPlan, run_bench
from hexgen_flow.bench.plan import plan_tasks

PLAN = BenchPlan(
    name="band",
    presets=("hexgen-flow", "vllm", "least-requests", "llf"),
    traces=("trace1",),
    clusters=(("x1", "A100,A100,A6000,L40S"),),
    qps=(1.0,),
    goodput_presets=("vllm", "hexgen-flow"),
    goodput_queries=20,
    goodput_resolution=0.5,
    parts=("band",),
    band_calibrations=("chess-measured",),
    band_seeds=(0, 3),
    band_clusters=(("x1", "A100,A100,A6000,L40S"), ("A100x2", "A100,A100")),
)


def test_the_band_spans_every_calibration_caching_seed_and_cluster(tmp_path: Path) -> None:
    outcome = run_bench(PLAN, tmp_path, workers=1)
    band = outcome.doc["band"]
    assert band["calibrations"] == ["aiconfigurator", "chess-measured"]  # the plan's first
    assert band["seeds"] == [0, 3]
    assert band["prefix_caching"] == [True, False]  # the plan's own setting first
    rows = band["rows"]
    assert len(rows) == 2 * 2 * 2 * 2  # calibrations x caching x seeds x clusters
    # Caching changes the engine: the same row with it off is another run.
    by_caching = {
        r["prefix_caching"]: r["p95_s"]["hexgen-flow"]
        for r in rows
        if (r["calibration"], r["seed"], r["cluster"]) == ("aiconfigurator", 0, "x1")
    }
    assert len(set(by_caching.values())) == 2
    for row in rows:
        p95 = row["p95_s"]
        routers = {p: p95[p] for p in ("least-requests", "llf")}
        assert row["best_router"] == min(routers, key=lambda p: routers[p])
        assert row["speedup_vs_best_router"] == min(routers.values()) / p95["hexgen-flow"]
        assert row["speedup_vs_vllm"] == p95["vllm"] / p95["hexgen-flow"]
    # Seeds change the arrivals: the same row under another seed is another run.
    by_seed = {
        r["seed"]: r["p95_s"]["vllm"] for r in rows if r["cluster"] == "x1" and r["prefix_caching"]
    }
    assert len(set(by_seed.values())) == 2
    assert len(band["bands"]) == 8
    for span in band["bands"]:
        mine = [
            r["speedup_vs_best_router"]
            for r in rows
            if (r["calibration"], r["prefix_caching"], r["cluster"])
            == (span["calibration"], span["prefix_caching"], span["cluster"])
        ]
        assert span["speedup_vs_best_router"] == {"min": min(mine), "max": max(mine)}
        assert span["homogeneous"] == (span["cluster"] == "A100x2")
    # The band's run of the plan's own calibration and seed is the matrix's run.
    matrix = {c["policy"]: c["p95_s"] for c in outcome.doc["matrix"]}
    own = next(
        r
        for r in rows
        if (r["calibration"], r["prefix_caching"], r["seed"], r["cluster"])
        == ("aiconfigurator", True, 0, "x1")
    )
    assert own["p95_s"] == {p: matrix[p] for p in own["p95_s"]}
    text = (tmp_path / "results.md").read_text()
    assert "## Sensitivity band" in text
    assert "| `chess-measured` | off | A100x2 (homogeneous) | A100,A100 |" in text


def test_no_band_without_a_load_aware_router() -> None:
    plan = BenchPlan(presets=("hexgen-flow", "vllm"), parts=("band",))
    assert not plan.runs_band
    assert not [t for t in plan_tasks(plan) if t.key[0] == "band"]
