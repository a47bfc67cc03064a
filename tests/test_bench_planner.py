"""`hexgen-flow bench` with a planner apart from the engines (``--planner-calibration``,
``--planner-error``) and with online cost learning (``--learn-costs``): each benchmark task
plans with the belief and runs the truth, exactly as `simulate` does, and the report says
what the planner believed."""

from __future__ import annotations

import dataclasses

from cli_runner import one_error_line, run_cli
from hexgen_flow.bench.plan import Task
from hexgen_flow.bench.report import _planner_lines
from hexgen_flow.bench.tasks import cached_queries, run_task
from hexgen_flow.cluster import parse_cluster
from hexgen_flow.lengths import OutputLengths
from hexgen_flow.policies.presets import PRESETS
from hexgen_flow.sim.simulator import SimConfig, simulate

CLUSTER = "A100,A100,A6000,L40S"
EXACT = Task(
    "run",
    ("matrix",),
    "trace1",
    CLUSTER,
    "least-work",  # reads the estimator, has no alpha to tune
    0.3,
    60,
    seed=2,
    slo_scale=3.0,
    arrival_cv=1.0,
    prefix_caching=True,
)


def test_a_task_plans_with_the_belief_and_runs_the_truth() -> None:
    wrong = dataclasses.replace(
        EXACT, planner_calibration="chess-measured", planner_error=(("L40S", 3.0, 1.0),)
    )
    got = run_task(wrong)
    queries = cached_queries("trace1", 60, False)
    belief = parse_cluster(CLUSTER, calibration="chess-measured").misjudged({"L40S": (3.0, 1.0)})
    truth = parse_cluster(CLUSTER, calibration="aiconfigurator")
    config = SimConfig(qps=0.3, seed=2, prefix_caching=True)
    expected = simulate(queries, belief, PRESETS["least-work"], config, truth=truth)
    assert got["p95_s"] == expected.latency_summary()["p95"]
    assert got["p95_s"] != run_task(EXACT)["p95_s"]
    # A router blind to latency runs the same run whatever it believes.
    blind = dataclasses.replace(EXACT, preset="vllm")
    assert run_task(dataclasses.replace(blind, planner_calibration="chess-measured")) == (
        run_task(blind)
    )


def test_a_task_can_learn_costs() -> None:
    wrong = dataclasses.replace(EXACT, planner_error=(("L40S", 3.0, 1.0), ("A6000", 3.0, 1.0)))
    learning = dataclasses.replace(wrong, learn_costs=True)
    assert run_task(learning)["p95_s"] != run_task(wrong)["p95_s"]


def test_the_report_names_the_planner_only_when_it_is_not_exact() -> None:
    exact = {"calibration": "aiconfigurator", "planner_calibration": "aiconfigurator"}
    assert _planner_lines({**exact, "planner_error": {}, "learn_costs": False}) == []
    assert _planner_lines({"calibration": "aiconfigurator"}) == []  # results before the field
    lines = _planner_lines(
        {**exact, "planner_error": {"L40S": {"prefill": 3.0, "decode": 1.0}}, "learn_costs": True}
    )
    assert "L40S prefill x3 decode x1" in lines[0] and "--learn-costs" in lines[0]


def test_a_bad_planner_calibration_fails_before_anything_runs() -> None:
    proc = run_cli("bench", "--quick", "--planner-calibration", "nonsense", "--out", "/dev/null/x")
    assert "--planner-calibration" in one_error_line(proc)


def test_a_task_can_predict_output_lengths() -> None:
    learned = dataclasses.replace(EXACT, output_lengths="learned")
    got = run_task(learned)
    queries = cached_queries("trace1", 60, False)
    cluster = parse_cluster(CLUSTER, calibration="aiconfigurator")
    config = SimConfig(qps=0.3, seed=2, prefix_caching=True, output_lengths=OutputLengths.LEARNED)
    expected = simulate(queries, cluster, PRESETS["least-work"], config)
    assert got["p95_s"] == expected.latency_summary()["p95"] != run_task(EXACT)["p95_s"]
