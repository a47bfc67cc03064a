"""Truth and belief apart: the simulated engines run one calibration (``--calibration``)
while every policy, the α tuner and admission plan with another (``--planner-calibration``).

What the split must keep: a call takes what the engines' numbers say, whatever the planner
believes; a query's SLO comes from the engines' numbers; a policy that reads no latency
figure (round-robin + FCFS) runs the very same run under any belief; one that does
(`hexgen-flow`) plans with the belief; and a planner with the engines' numbers is the
exact planner, byte for byte.
"""

from __future__ import annotations

import pytest

from cli_runner import one_error_line, run_cli, run_json
from hexgen_flow.cluster import parse_cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.policies.presets import PRESETS
from hexgen_flow.sim.admitting import AdmittingSimulation
from hexgen_flow.sim.simulator import SimConfig, Simulation
from hexgen_flow.traces import load_trace, take_queries
from hexgen_flow.tuning import tune_alpha
from hexgen_flow.workload import LLMCall, Query, Workflow

GPUS = "A100,A100,A6000,L40S"
AICONFIG = parse_cluster(GPUS, calibration="aiconfigurator")
CHESS = parse_cluster(GPUS, calibration="chess-measured")
QUERIES = take_queries(load_trace("trace1"), 120)
CONFIG = SimConfig(qps=0.3, seed=3)
HEXGEN = PRESETS["hexgen-flow"].with_alpha(0.5)


def outcomes(sim: Simulation) -> list[tuple[str, float, float]]:
    return [(o.query_id, o.latency_s, o.slo_s) for o in sim.run().outcomes]


def test_the_two_calibrations_differ_where_it_matters() -> None:
    """Otherwise every test below would pass without any split at all."""
    call = (8000, 300)
    for a, c in zip(AICONFIG.instances, CHESS.instances, strict=True):
        assert a.latency.single_s(*call) != pytest.approx(c.latency.single_s(*call), rel=0.05)


@pytest.mark.parametrize("engine", ["prefill-first", "vllm-v1"])
def test_a_call_alone_takes_the_engines_time_whatever_the_planner_believes(engine: str) -> None:
    truth, belief = (
        parse_cluster("L40S", calibration="aiconfigurator"),
        parse_cluster("L40S", calibration="chess-measured"),
    )
    call = LLMCall("generate_candidate", 6000, 200)
    query = Query("one", Workflow.chain([(call,)]))
    config = SimConfig(qps=1.0, engine=engine, prefix_caching=False)
    sim = Simulation([query], belief, PRESETS["hexgen-flow"], config, truth=truth)
    (outcome,) = sim.run().outcomes
    exact = truth.instances[0].latency.single_s(6000, 200)
    assert outcome.latency_s == pytest.approx(exact, rel=0.02)
    assert outcome.latency_s != pytest.approx(
        belief.instances[0].latency.single_s(6000, 200), rel=0.1
    )
    # The scheduler estimates with the belief, the engine runs the truth.
    assert sim.estimator.call_time(0, call) == belief.instances[0].latency.single_s(6000, 200)
    # The SLO is the engines' (truth's) SLO_base, not the planner's.
    alone = Simulation([query], truth, PRESETS["hexgen-flow"], config)
    assert sim.slo_base_s == alone.slo_base_s
    assert Simulation([query], belief, PRESETS["hexgen-flow"], config).slo_base_s != (
        pytest.approx(alone.slo_base_s, rel=0.05)
    )


def test_a_policy_blind_to_latency_runs_the_same_run_under_any_belief() -> None:
    """Round-robin + FCFS reads no latency figure: only the truth moves its run."""
    vllm = PRESETS["vllm"]
    exact = outcomes(Simulation(QUERIES, AICONFIG, vllm, CONFIG))
    believing_chess = outcomes(Simulation(QUERIES, CHESS, vllm, CONFIG, truth=AICONFIG))
    assert believing_chess == exact
    other_truth = outcomes(Simulation(QUERIES, CHESS, vllm, CONFIG))
    assert other_truth != exact


def test_hexgen_flow_plans_with_the_belief() -> None:
    exact = outcomes(Simulation(QUERIES, AICONFIG, HEXGEN, CONFIG))
    wrong = outcomes(Simulation(QUERIES, CHESS, HEXGEN, CONFIG, truth=AICONFIG))
    assert [o[2] for o in wrong] == [o[2] for o in exact]  # the same SLOs
    assert wrong != exact  # other plans, other latencies
    # ...and it is not simply the run on the other engines either.
    assert wrong != outcomes(Simulation(QUERIES, CHESS, HEXGEN, CONFIG))


def test_a_planner_with_the_engines_numbers_is_the_exact_planner() -> None:
    again = parse_cluster(GPUS, calibration="aiconfigurator")  # another object, same numbers
    exact = outcomes(Simulation(QUERIES, AICONFIG, HEXGEN, CONFIG))
    assert outcomes(Simulation(QUERIES, again, HEXGEN, CONFIG, truth=AICONFIG)) == exact


def test_admission_and_the_tuner_take_the_split_too() -> None:
    admitting = AdmittingSimulation(QUERIES, CHESS, HEXGEN, CONFIG, truth=AICONFIG)
    assert admitting.truth is AICONFIG
    assert admitting.slo_base_s == Simulation(QUERIES, AICONFIG, HEXGEN, CONFIG).slo_base_s
    assert admitting.run().outcomes
    curve = tune_alpha(QUERIES[:40], CHESS, HEXGEN, CONFIG, grid=(0.2, 0.8), refine=False)
    split = tune_alpha(
        QUERIES[:40], CHESS, HEXGEN, CONFIG, grid=(0.2, 0.8), refine=False, truth=AICONFIG
    )
    assert [p.p95_s for p in split.curve] != [p.p95_s for p in curve.curve]


def test_truth_must_have_the_same_instances() -> None:
    with pytest.raises(ConfigError, match="4 instances and the engines' 3"):
        Simulation(QUERIES, AICONFIG, HEXGEN, CONFIG, truth=parse_cluster("A100,A100,A6000"))
    with pytest.raises(ConfigError, match="instance 3 differs beyond its latency model"):
        Simulation(QUERIES, AICONFIG, HEXGEN, CONFIG, truth=parse_cluster("A100,A100,A6000,H100"))


def test_the_cli_names_the_planner_and_keeps_the_slo() -> None:
    args = ("simulate", "--num-queries", "60", "--qps", "0.3", "--alpha", "0.5")
    exact = run_json(*args)
    same = run_json(*args, "--planner-calibration", "aiconfigurator")
    assert exact == same and exact["planner_calibration"] == "aiconfigurator"
    wrong = run_json(*args, "--planner-calibration", "chess-measured")
    assert wrong["calibration"] == "aiconfigurator"
    assert wrong["planner_calibration"] == "chess-measured"
    assert wrong["slo_s"] == exact["slo_s"]
    assert wrong["queries"] != exact["queries"]
    table = run_cli(*args, "--planner-calibration", "chess-measured")
    assert table.returncode == 0, table.stderr
    assert "chess-measured (the engines run the calibration above)" in table.stdout
    tuned = run_json(
        "tune", "--num-queries", "40", "--qps", "0.3", "--planner-calibration", "chess-measured"
    )
    assert tuned["planner_calibration"] == "chess-measured" and tuned["curve"]


def test_a_bad_planner_calibration_is_one_line_naming_the_option() -> None:
    proc = run_cli("simulate", "--planner-calibration", "nonsense")
    assert proc.returncode == 2
    assert "--planner-calibration" in one_error_line(proc)
