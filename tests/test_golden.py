"""Golden trace: a small simulated run pinned to the microsecond.

tests/golden/small_run.json holds the settings and the per-query latencies (rounded to
1e-6 s) of trace1's first 30 queries on A100,A100,A6000,L40S at 0.5 queries/s, seed 0,
under vllm, hexgen-flow-paper (α 0.5) and hexgen-flow (α 0.5). Any change of simulated
behaviour shows up here. When the change is intended, regenerate the file with
``.venv/bin/python tests/golden/regenerate.py`` and review its diff.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hexgen_flow.cluster import parse_cluster
from hexgen_flow.policies.presets import PRESETS, Preset
from hexgen_flow.sim.simulator import SimConfig, simulate
from hexgen_flow.traces import load_trace

GOLDEN_FILE = Path(__file__).parent / "golden" / "small_run.json"
GOLDEN: dict[str, Any] = json.loads(GOLDEN_FILE.read_text())
SETTINGS: dict[str, Any] = GOLDEN["settings"]
RUNS: list[dict[str, Any]] = GOLDEN["runs"]
REGENERATE = "if the change is intended, run .venv/bin/python tests/golden/regenerate.py"


def _preset(run: dict[str, Any]) -> Preset:
    preset = PRESETS[run["preset"]]
    return preset if run["alpha"] is None else preset.with_alpha(run["alpha"])


def test_golden_file_covers_the_pinned_settings() -> None:
    assert SETTINGS == {
        "trace": "trace1",
        "num_queries": 30,
        "cluster": "A100,A100,A6000,L40S",
        "qps": 0.5,
        "seed": 0,
        "calibration": "chess-measured",
        "engine": "prefill-first",
    }
    assert [(r["preset"], r["alpha"]) for r in RUNS] == [
        ("vllm", None),
        ("hexgen-flow-paper", 0.5),
        ("hexgen-flow", 0.5),
    ]
    for run in RUNS:
        assert len(run["latencies_s"]) == SETTINGS["num_queries"]
        assert all(lat > 0 for lat in run["latencies_s"].values())
    # The three policies really differ on this run.
    assert len({json.dumps(r["latencies_s"]) for r in RUNS}) == len(RUNS)


@pytest.mark.parametrize("run", RUNS, ids=[r["preset"] for r in RUNS])
def test_small_run_matches_the_golden_latencies(run: dict[str, Any]) -> None:
    preset = _preset(run)
    composition = {
        part: {"name": ref.name, "params": {k: ref.params[k] for k in sorted(ref.params)}}
        for part, ref in (
            ("dispatch", preset.dispatch),
            ("queue", preset.queue),
            ("budget", preset.budget),
        )
    }
    assert composition == run["composition"], (
        f"preset {run['preset']!r} is no longer made of what the golden run recorded; {REGENERATE}"
    )
    queries = load_trace(SETTINGS["trace"])[: SETTINGS["num_queries"]]
    metrics = simulate(
        queries,
        parse_cluster(SETTINGS["cluster"], calibration=SETTINGS["calibration"]),
        preset,
        SimConfig(qps=SETTINGS["qps"], seed=SETTINGS["seed"], engine=SETTINGS["engine"]),
    )
    got = {o.query_id: round(o.latency_s, 6) for o in metrics.outcomes}
    expected: dict[str, float] = run["latencies_s"]
    assert list(got) == list(expected), "queries finished in a different arrival order"
    changed = {q: (expected[q], got[q]) for q in expected if got[q] != expected[q]}
    assert not changed, (
        f"{len(changed)} of {len(expected)} latencies changed under {run['preset']}: "
        f"{dict(list(changed.items())[:5])} ...; {REGENERATE}"
    )
