"""``hexgen-flow bench``: every output file of the quick benchmark, the goodput search, and
results that do not depend on the number of worker processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hexgen_flow.bench import FULL_PLAN, PLOTS, QUICK_PLAN, BenchPlan, find_goodput, run_bench
from hexgen_flow.bench.plan import LOAD_AWARE
from hexgen_flow.policies.presets import PRESETS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RESULT_KEYS = {
    "meta",
    "headline",
    "matrix",
    "matrix_rows",
    "goodput",
    "slo_sweep",
    "load_sweep",
    "multi_tenant",
    "simulator_speed",
}


def test_quick_bench_writes_every_output(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "hexgen_cli", "bench", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""  # progress and the final message go to stderr
    assert f"to {out}/" in proc.stderr

    for name in PLOTS:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC), name
        assert len(data) > 10_000, name

    doc = json.loads((out / "results.json").read_text())
    assert set(doc) >= RESULT_KEYS
    presets = doc["meta"]["presets"]
    assert "vllm" in presets and "hexgen-flow" in presets
    assert len(doc["matrix"]) == len(presets) * len(doc["matrix_rows"])
    for cell in doc["matrix"]:
        assert 0 <= cell["slo_attainment"] <= 1
        assert cell["p50_s"] <= cell["p95_s"] <= cell["p99_s"]
        assert cell["completed"] == cell["num_queries"]
        assert (cell["alpha"] is None) == ("alpha_curve" not in cell)
    routers = doc["meta"]["load_aware"]
    assert routers and set(routers) <= set(presets) - {"vllm", "hexgen-flow"}
    p95 = {(c["cluster"], c["trace"], c["qps"], c["policy"]): c["p95_s"] for c in doc["matrix"]}
    for row in doc["matrix_rows"]:
        assert row["speedup_vs_vllm"]["vllm"] == pytest.approx(1.0)
        assert row["best"] in presets
        # The second baseline: the load-aware router with the lowest P95 on the row.
        key = (row["cluster"], row["trace"], row["qps"])
        assert row["best_router_p95_s"] == min(p95[(*key, p)] for p in routers)
        assert row["best_router_p95_s"] == p95[(*key, row["best_router"])]
        assert row["speedup_vs_best_router"] == pytest.approx(
            row["best_router_p95_s"] / p95[(*key, "hexgen-flow")]
        )
    goodput = doc["goodput"]["results"]
    assert {(g["trace"], g["policy"]) for g in goodput} == {
        (t, p) for t in doc["meta"]["traces"] for p in presets
    }
    assert all(0 <= g["goodput_qps"] <= doc["goodput"]["max_qps"] for g in goodput)
    for trace, best in doc["goodput"]["best_router"].items():
        rates = {g["policy"]: g["goodput_qps"] for g in goodput if g["trace"] == trace}
        assert best["goodput_qps"] == max(rates[p] for p in routers) == rates[best["policy"]]
    head = doc["headline"]
    assert set(head["p95_speedup_vs_best_router_x1"]) == set(head["goodput_ratio_vs_best_router"])
    assert set(doc["slo_sweep"]["slo_attainment"]) == set(presets)
    assert set(doc["load_sweep"]["p95_s"]) == set(presets)
    tenants = doc["multi_tenant"]["results"]["vllm"]["tenant_attainment"]
    assert set(tenants) == set(doc["multi_tenant"]["tenants"])
    speed = doc["simulator_speed"]
    assert speed["llm_calls_per_s"] > 0 and speed["tune_alpha_values"] >= 11
    assert set(doc["headline"]["p95_speedup_vs_vllm_x1"]) == set(doc["meta"]["traces"])

    md = (out / "results.md").read_text()
    assert md.startswith("# HexGen-Flow benchmark")
    summary = md[md.index("## Summary") : md.index("## Matrix")]
    assert "over `vllm`" in summary and "over the best load-aware router" in summary
    assert "| best router | hexgen-flow over it |" in md
    assert md.index("## Summary") < md.index("## Matrix")
    for section in (
        "## Goodput",
        "## SLO attainment",
        "## P95 latency (s) vs load",
        "## Multi-tenant",
        "## Simulator speed",
    ):
        assert section in md


def _without_timings(doc: dict[str, Any]) -> dict[str, Any]:
    doc = json.loads(json.dumps(doc))
    for key in ("wall_s", "workers"):
        doc["meta"].pop(key)
    for key in ("simulate_wall_s", "llm_calls_per_s", "tune_alpha_wall_s"):
        doc["simulator_speed"].pop(key)
    return doc


def test_results_do_not_depend_on_the_worker_count(tmp_path: Path) -> None:
    plan = BenchPlan(
        name="tiny",
        presets=("hexgen-flow", "vllm"),
        traces=("trace1",),
        clusters=(("x1", "A100,A100,A6000,L40S"),),
        qps=(0.5,),
        goodput_queries=40,
        goodput_resolution=0.1,
        slo_sweep_scales=(3.0,),
        slo_sweep_queries=30,
        load_sweep_qps=(0.5,),
        load_sweep_queries=30,
        tenant_queries=30,
        speed_queries=30,
        # Every part but the shifting-load scenarios (minutes, serial in the parent process
        # whatever the worker count; tests/test_shifting_load.py runs a small one).
        parts=QUICK_PLAN.parts,
    )
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    serial = run_bench(plan, tmp_path / "a", workers=1)
    pooled = run_bench(plan, tmp_path / "b", workers=2)
    assert _without_timings(serial.doc) == _without_timings(pooled.doc)


def test_the_plans_measure_against_load_aware_routers() -> None:
    assert set(LOAD_AWARE) <= set(PRESETS)
    # The new routers come last, so every earlier preset keeps its place (and its colour).
    assert FULL_PLAN.presets[-6:] == (
        "least-requests",
        "least-work",
        "llm-d",
        "dynamo",
        "llm-d-predicted",
        "autellix",
    )
    assert set(LOAD_AWARE) <= set(FULL_PLAN.goodput_policies)
    quick = [p for p in QUICK_PLAN.presets if p in LOAD_AWARE]
    assert any(PRESETS[p].queue.name == "fcfs" for p in quick)


# ---------------------------------------------------------------------------- goodput search


@pytest.mark.parametrize("capacity", [0.003, 0.05, 0.37, 1.234, 1.999])
def test_goodput_search_finds_the_threshold(capacity: float) -> None:
    goodput, probes = find_goodput(lambda qps: 1.0 if qps <= capacity else 0.5, resolution=0.005)
    if capacity < 0.005:
        assert goodput == 0.0
    else:
        assert capacity - 0.005 <= goodput <= capacity
    assert len(probes) <= 20
    assert probes[0][0] == 2.0


def test_goodput_search_at_the_top_and_with_no_passing_rate() -> None:
    assert find_goodput(lambda qps: 1.0)[0] == 2.0
    assert find_goodput(lambda qps: 0.0)[0] == 0.0
    assert find_goodput(lambda qps: 0.96, target=0.95)[0] == 2.0


def test_the_full_plan_runs_the_shifting_load_scenarios_and_the_quick_one_does_not() -> None:
    # The scenarios take minutes even when small: tests/test_shifting_load.py runs a small one
    # through the very functions `run_plan` calls.
    assert "shifting_load" in FULL_PLAN.parts
    assert "shifting_load" not in QUICK_PLAN.parts
    assert set(QUICK_PLAN.parts) | {"shifting_load"} == set(FULL_PLAN.parts)
