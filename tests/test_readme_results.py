"""README.md's results block: it renders the committed results document, a sample of whose
simulations the code reproduces exactly (`make readme-results` writes both), its renderer and
markers work, and the README's plan measures what the full one does."""

from __future__ import annotations

import dataclasses
import difflib
import json
from pathlib import Path
from typing import Any

import pytest

from hexgen_flow.bench import FULL_PLAN, README_PLAN, BenchPlan, run_bench
from hexgen_flow.bench.plan import LOAD_AWARE, Task, plan_tasks
from hexgen_flow.bench.readme import (
    README_BEGIN,
    README_END,
    readme_block,
    render_readme_block,
    replace_readme_block,
)
from hexgen_flow.bench.tasks import run_task

README = Path(__file__).resolve().parent.parent / "README.md"
RESULTS = README.parent / "benchmarks" / "readme-results.json"
"""What the README's block is rendered from (scripts/readme_results.py writes both)."""
DRIFTED = "README results drifted from the code: run `make readme-results`"


def _committed() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(RESULTS.read_text())
    return doc


def test_the_readme_block_is_what_the_committed_results_render_to() -> None:
    committed = readme_block(README.read_text())
    fresh = render_readme_block(_committed())
    diff = "".join(
        difflib.unified_diff(
            committed.splitlines(keepends=True),
            fresh.splitlines(keepends=True),
            "README.md (results block)",
            "rendered from benchmarks/readme-results.json",
        )
    )
    assert committed == fresh, f"{DRIFTED}\n{diff}"


def _sample(tasks: list[Task]) -> list[Task]:
    """The flagship and the baseline on the first matrix row, and band rows of another
    calibration, caching setting, seed and cluster (a prefix-aware router among them): every
    part of the engine and the policies the figures rest on, in seconds rather than the
    slice's minutes."""
    wanted = [
        ("matrix", "x1", "trace1", 0.5, "hexgen-flow"),
        ("matrix", "x1", "trace1", 0.5, "vllm"),
        ("band", "chess-measured", False, 1, "H100x4", "trace2", 1.0, "least-requests"),
        ("band", "aiconfigurator", True, 2, "x1", "trace3", 1.0, "llm-d"),
    ]
    by_key = {t.key: t for t in tasks}
    return [by_key[k] for k in wanted]


# Every simulation is a pure function of its task, up to the last bits of a float: the
# engine model's numpy sums take machine-dependent SIMD paths (seen: 318.89612576123466 on
# one machine, 318.8961257612412 on another). Nine significant digits is any real drift.
SAME = 1e-9


def _same(committed: object, measured: object) -> bool:
    if isinstance(committed, float) and isinstance(measured, float):
        return committed == pytest.approx(measured, rel=SAME)
    return committed == measured


def test_the_committed_results_are_what_the_code_measures() -> None:
    # Rerun a sample and compare.
    doc = _committed()
    assert doc["meta"]["calibration"] == README_PLAN.calibration
    assert doc["meta"]["engine"] == README_PLAN.engine
    for task in _sample(plan_tasks(README_PLAN)):
        record = run_task(task)
        if task.key[0] == "matrix":
            _, cluster, trace, qps, preset = task.key
            cell = next(
                c
                for c in doc["matrix"]
                if (c["cluster"], c["trace"], c["qps"], c["policy"])
                == (cluster, trace, qps, preset)
            )
            for field in ("p95_s", "mean_s", "slo_attainment", "alpha"):
                assert _same(cell[field], record[field]), (
                    task.key,
                    field,
                    DRIFTED,
                )
        else:
            _, calibration, caching, seed, cluster, trace, qps, preset = task.key
            row = next(
                r
                for r in doc["band"]["rows"]
                if (
                    r["calibration"],
                    r["prefix_caching"],
                    r["seed"],
                    r["cluster"],
                    r["trace"],
                    r["qps"],
                )
                == (calibration, caching, seed, cluster, trace, qps)
            )
            assert _same(row["p95_s"][preset], record["p95_s"]), (
                task.key,
                DRIFTED,
            )


def test_the_readme_plan_is_a_slice_of_the_full_plan() -> None:
    # Every task is a pure function of its key, so a slice that keeps every other setting
    # measures exactly the full benchmark's figures.
    changed = {
        f.name
        for f in dataclasses.fields(BenchPlan)
        if getattr(README_PLAN, f.name) != getattr(FULL_PLAN, f.name)
    }
    assert changed == {"name", "goodput_presets", "parts", "band_clusters"}
    readme_tasks = set(plan_tasks(README_PLAN))
    assert readme_tasks < set(plan_tasks(FULL_PLAN))
    assert {t.key[0] for t in readme_tasks} == {"matrix", "goodput", "band"}
    assert {t.preset for t in readme_tasks if t.kind == "goodput"} == {
        "hexgen-flow",
        "vllm",
        *LOAD_AWARE,
    }


# ------------------------------------------------------------------- renderer and markers


def _doc(p95: dict[tuple[str, float, str], float] | None = None) -> dict[str, Any]:
    """A hand-made results document: the table's three presets and two load-aware routers, one
    trace, two rates, with `p95` overriding P95s by (trace, rate, preset). The best router is
    picked as `_assemble` picks it (lowest P95, ties: plan order)."""
    presets = ["hexgen-flow", "hexgen-flow-paper", "vllm", "llf", "least-requests"]
    routers = ["llf", "least-requests"]
    base = {
        "hexgen-flow": 100.0,
        "hexgen-flow-paper": 150.0,
        "vllm": 400.0,
        "llf": 300.0,
        "least-requests": 125.0,
    }
    cells = []
    rows = []
    for qps in (0.5, 1.0):
        values = {p: base[p] * (1 + qps) for p in presets}
        values.update({k[2]: v for k, v in (p95 or {}).items() if k[:2] == ("trace1", qps)})
        cells += [
            {"cluster": "x1", "trace": "trace1", "qps": qps, "policy": p, "p95_s": values[p]}
            for p in presets
        ]
        best = min(presets, key=lambda p: values[p])
        router = min(routers, key=lambda p: values[p])
        rows.append(
            {
                "cluster": "x1",
                "trace": "trace1",
                "qps": qps,
                "best": best,
                "speedup_vs_vllm": {p: values["vllm"] / values[p] for p in presets},
                "best_router": router,
                "best_router_p95_s": values[router],
                "speedup_vs_best_router": values[router] / values["hexgen-flow"],
            }
        )
    return {
        "meta": {
            "presets": presets,
            "load_aware": routers,
            "calibration": "aiconfigurator",
            "engine": "vllm-v1",
            "prefix_caching": False,
        },
        "matrix": cells,
        "matrix_rows": rows,
        "goodput": {
            "cluster": "x1",
            "num_queries": 1000,
            "target_attainment": 0.95,
            "slo_scale": 3.0,
            "results": [
                {
                    "trace": "trace1",
                    "policy": "hexgen-flow",
                    "ratio_vs_vllm": 3.38,
                    "ratio_vs_best_router": 1.234,
                },
                {"trace": "trace1", "policy": "vllm", "ratio_vs_vllm": 1.0},
            ],
            "best_router": {"trace1": {"policy": "llf", "goodput_qps": 0.5}},
        },
    }


def test_the_block_renders_a_results_document() -> None:
    assert render_readme_block(_doc()) == (
        "**Simulated** with calibration `aiconfigurator` and engine model `vllm-v1`\n"
        "(docs/hardware.md, docs/design.md): the figures compare schedulers on a model of the "
        "engine;\nthey are not measurements.\n"
        "\n"
        "Best router: the lowest P95 of the load-aware routers `llf` and `least-requests` on "
        "that\nrow; the last two columns are `hexgen-flow`'s speedup over `vllm` (round-robin + "
        "FCFS) and\nover that router.\n"
        "\n"
        "| trace | λ (q/s) | P95 `vllm` | P95 best router | P95 `hexgen-flow-paper` "
        "| P95 `hexgen-flow` | speedup over vLLM | speedup over best router |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|\n"
        "| trace1 | 0.5 | 600.0 s | 187.5 s (`least-requests`) | 225.0 s | 150.0 s "
        "| 4.00× | 1.25× |\n"
        "| trace1 | 1.0 | 800.0 s | 250.0 s (`least-requests`) | 300.0 s | 200.0 s "
        "| 4.00× | 1.25× |\n"
        "\n"
        "Goodput (the highest steady rate at which ≥ 95 % of 1,000 queries meet SLO scale 3):\n"
        "`hexgen-flow` sustains 3.4× the rate of `vllm` and 1.23× (`llf`) the rate of the best\n"
        "load-aware router on trace1, and `hexgen-flow` is the best of the five presets on "
        "every row\nof the matrix.\n"
    )
    # The engine's prefix caching is named when it is on.
    cached = _doc()
    cached["meta"]["prefix_caching"] = True
    assert "engine model `vllm-v1` with prefix caching (vLLM V1's default)" in " ".join(
        render_readme_block(cached).split()
    )
    # When another preset wins a row, the claim says on how many rows hexgen-flow is best.
    lost = render_readme_block(_doc({("trace1", 1.0, "llf"): 199.0}))
    assert "best of the five presets on 1 of the 2 rows of the matrix." in " ".join(lost.split())
    # ... and the best router of that row is named with its P95.
    assert "| 800.0 s | 199.0 s (`llf`) | 300.0 s | 200.0 s | 4.00× | 0.99× |" in lost


def test_the_band_is_one_sentence_over_both_kinds_of_cluster() -> None:
    doc = _doc()
    span = {"min": 1.0, "max": 1.0}

    def band(calibration: str, homogeneous: bool, low: float, high: float) -> dict[str, Any]:
        return {
            "calibration": calibration,
            "homogeneous": homogeneous,
            "speedup_vs_vllm": span,
            "speedup_vs_best_router": {"min": low, "max": high},
        }

    doc["band"] = {
        "calibrations": ["aiconfigurator", "chess-measured"],
        "prefix_caching": [True, False],
        "seeds": [0, 1, 2],
        "bands": [
            band("aiconfigurator", False, 1.1, 1.3),
            band("chess-measured", False, 1.05, 1.4),
            band("aiconfigurator", True, 0.978, 1.01),  # rounded down: not 0.98
            band("chess-measured", True, 0.99, 1.024),
        ],
    }
    text = " ".join(render_readme_block(doc).split())
    assert (
        "**Band** (min-max over the calibrations `aiconfigurator` and `chess-measured`, prefix "
        "caching on and off, arrival seeds 0, 1 and 2, every trace and rate): on the "
        "heterogeneous clusters `hexgen-flow`'s P95 is 1.00-1.00× lower than `vllm`'s and "
        "1.05-1.40× lower than the best load-aware router's; on homogeneous clusters its "
        "speedup over the best router is 0.97-1.02×."
    ) in text
    assert "**Band**" not in render_readme_block(_doc())


def _readme(block: str) -> str:
    return f"# Title\n\n## Results\n\nProse.\n\n{README_BEGIN}\n{block}{README_END}\n\nMore.\n"


def test_a_changed_figure_is_detected_and_rewritten() -> None:
    text = _readme(render_readme_block(_doc()))
    assert readme_block(text) == render_readme_block(_doc())
    drifted = render_readme_block(_doc({("trace1", 0.5, "hexgen-flow"): 151.0}))
    assert readme_block(text) != drifted
    assert "| trace1 | 0.5 | 600.0 s | 187.5 s (`least-requests`) | 225.0 s | 151.0 s " in drifted
    rewritten = replace_readme_block(text, drifted)
    assert readme_block(rewritten) == drifted
    # Only the lines between the markers change.
    assert rewritten == _readme(drifted)


@pytest.mark.parametrize(
    "text",
    [
        "no markers\n",
        f"{README_BEGIN}\nblock\n",
        f"{README_END}\nblock\n{README_BEGIN}\n",
        f"{README_BEGIN}\n{README_BEGIN}\nblock\n{README_END}\n",
    ],
)
def test_broken_markers_are_an_error(text: str) -> None:
    with pytest.raises(ValueError, match="results:begin"):
        readme_block(text)
    with pytest.raises(ValueError, match="results:begin"):
        replace_readme_block(text, "block\n")


def test_a_plan_without_the_optional_parts_writes_its_report(tmp_path: Path) -> None:
    # A plan of only the matrix and goodput (no band, no sweeps): `run_bench` still reports.
    plan = BenchPlan(
        name="tiny",
        presets=("hexgen-flow", "llf", "vllm"),
        traces=("trace1",),
        clusters=(("x1", "A100,A100,A6000,L40S"),),
        qps=(0.5,),
        goodput_presets=("hexgen-flow", "vllm"),
        goodput_queries=30,
        goodput_resolution=0.1,
        parts=(),
    )
    outcome = run_bench(plan, tmp_path, workers=1)
    assert outcome.files == ("results.md", "results.json", "p95_matrix.png", "goodput.png")
    assert {"slo_sweep", "load_sweep", "multi_tenant", "simulator_speed"}.isdisjoint(outcome.doc)
    assert [g["policy"] for g in outcome.doc["goodput"]["results"]] == ["hexgen-flow", "vllm"]
    md = (tmp_path / "results.md").read_text()
    assert "## Goodput" in md and "## Simulator speed" not in md
    assert md.endswith("Plots: `p95_matrix.png`, `goodput.png`\n")
    for name in outcome.files:
        assert (tmp_path / name).stat().st_size > 0
