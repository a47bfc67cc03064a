"""Regenerate tests/golden/small_run.json, the pinned small simulated run of test_golden.py.

Run it ONLY when a change of simulated behaviour is intended (a policy, the engine model,
the latency model, a preset's composition or the arrival process changed on purpose), and
say so in the change's description; review the diff of the JSON like code:

    .venv/bin/python tests/golden/regenerate.py

The settings live in the JSON file next to the numbers, so the test reruns exactly what
was recorded. To change the settings, edit SETTINGS below and regenerate.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hexgen_flow.cluster import parse_cluster
from hexgen_flow.policies.presets import PRESETS, Preset
from hexgen_flow.sim.simulator import SimConfig, simulate
from hexgen_flow.traces import load_trace

GOLDEN = Path(__file__).with_name("small_run.json")

SETTINGS: dict[str, Any] = {
    "trace": "trace1",
    "num_queries": 30,
    "cluster": "A100,A100,A6000,L40S",
    "qps": 0.5,
    "seed": 0,
    # Pinned, so a change of the defaults does not move the golden run.
    "calibration": "chess-measured",
    "engine": "prefill-first",
    "runs": [
        {"preset": "vllm", "alpha": None},
        {"preset": "hexgen-flow-paper", "alpha": 0.5},
        {"preset": "hexgen-flow", "alpha": 0.5},
    ],
}
DIGITS = 6
"""Latencies are stored and compared rounded to 1e-6 s."""


def preset_for(name: str, alpha: float | None) -> Preset:
    preset = PRESETS[name]
    return preset if alpha is None else preset.with_alpha(alpha)


def composition(preset: Preset) -> dict[str, Any]:
    """What the preset is made of, so a failure can tell a preset edit from a behaviour
    change."""
    return {
        part: {"name": ref.name, "params": {k: ref.params[k] for k in sorted(ref.params)}}
        for part, ref in (
            ("dispatch", preset.dispatch),
            ("queue", preset.queue),
            ("budget", preset.budget),
        )
    }


def run_one(settings: dict[str, Any], name: str, alpha: float | None) -> dict[str, float]:
    """query_id -> latency rounded to DIGITS, in the run's outcome (arrival) order."""
    queries = load_trace(settings["trace"])[: settings["num_queries"]]
    cluster = parse_cluster(settings["cluster"], calibration=settings["calibration"])
    config = SimConfig(qps=settings["qps"], seed=settings["seed"], engine=settings["engine"])
    metrics = simulate(queries, cluster, preset_for(name, alpha), config)
    return {o.query_id: round(o.latency_s, DIGITS) for o in metrics.outcomes}


def build(settings: dict[str, Any]) -> dict[str, Any]:
    runs = []
    for spec in settings["runs"]:
        preset = preset_for(spec["preset"], spec["alpha"])
        runs.append(
            {
                **spec,
                "composition": composition(preset),
                "latencies_s": run_one(settings, spec["preset"], spec["alpha"]),
            }
        )
    return {"settings": {k: v for k, v in settings.items() if k != "runs"}, "runs": runs}


def main() -> None:
    GOLDEN.write_text(json.dumps(build(SETTINGS), indent=1) + "\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
