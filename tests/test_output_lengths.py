"""Output lengths the scheduler is not told (`hexgen_flow.lengths`, ``--output-lengths``):
the predictor's cold start, quantile, window and cap; a query as the scheduler believes it;
and the simulator, where the scheduler plans with the belief and the engines generate the
workload's lengths."""

from __future__ import annotations

import pytest

from cli_runner import one_error_line, run_cli, run_json
from hexgen_flow.cluster import parse_cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.lengths import (
    DEFAULT_PRIOR_TOKENS,
    MaxTokensBelief,
    OutputLengthPredictor,
    OutputLengths,
    believed_query,
)
from hexgen_flow.policies.presets import PRESETS
from hexgen_flow.sim.admitting import AdmittingSimulation
from hexgen_flow.sim.simulator import SimConfig, Simulation
from hexgen_flow.traces import load_trace, take_queries
from hexgen_flow.workload import LLMCall, Query, Stage, Workflow

L40S = parse_cluster("L40S")


def test_the_predictor_starts_from_the_prior_and_learns_the_quantile() -> None:
    predictor = OutputLengthPredictor(quantile=0.75, window=8)
    assert predictor.predict("generate_candidate") == 678  # the typical CHESS output
    assert predictor.predict("some_new_step") == DEFAULT_PRIOR_TOKENS
    for tokens in (10, 20, 30):  # fewer than it trusts: still the prior
        predictor.observe("revise", tokens)
    assert predictor.predict("revise") == 79
    predictor.observe("revise", 40)
    assert predictor.predict("revise") == 30  # the 75th percentile of 10, 20, 30, 40
    for tokens in (500,) * 8:  # the window keeps the latest 8
        predictor.observe("revise", tokens)
    assert predictor.predict("revise") == 500
    capped = OutputLengthPredictor(cap=100)
    assert capped.predict("generate_candidate") == 100
    with pytest.raises(ConfigError, match="quantile"):
        OutputLengthPredictor(quantile=0.0)


def test_a_believed_query_changes_only_output_lengths() -> None:
    query = Query(
        "q",
        Workflow(
            (
                Stage("extract_keywords", (LLMCall("extract_keywords", 700, 33),)),
                Stage("revise", (LLMCall("revise", 900, 5), LLMCall("revise", 901, 7)), (0,)),
            )
        ),
        tenant="t",
        slo_s=50.0,
    )
    believed = believed_query(query, MaxTokensBelief(1234))
    assert believed.query_id == "q" and believed.tenant == "t" and believed.slo_s == 50.0
    assert [s.after for s in believed.workflow.stages] == [(), (0,)]
    calls = [c for s in believed.workflow.stages for c in s.calls]
    assert [(c.step, c.input_tokens, c.output_tokens) for c in calls] == [
        ("extract_keywords", 700, 1234),
        ("revise", 900, 1234),
        ("revise", 901, 1234),
    ]


@pytest.mark.parametrize("lengths", [OutputLengths.MAX_TOKENS, OutputLengths.LEARNED])
def test_the_scheduler_believes_while_the_engine_generates_the_truth(
    lengths: OutputLengths,
) -> None:
    call = LLMCall("revise", 3000, 500)
    query = Query("one", Workflow.chain([(call,)]))
    config = SimConfig(qps=1.0, engine="prefill-first", output_lengths=lengths, max_tokens=4000)
    sim = Simulation([query], L40S, PRESETS["hexgen-flow"], config)
    (outcome,) = sim.run().outcomes
    truth = L40S.instances[0].latency.single_s(3000, 500)
    assert outcome.latency_s == pytest.approx(truth, rel=1e-6)
    believed = 4000 if lengths is OutputLengths.MAX_TOKENS else 79  # revise's prior
    assert sim.planned(0).workflow.stages[0].calls[0].output_tokens == believed


def test_learned_lengths_follow_the_finished_calls() -> None:
    queries = take_queries(load_trace("trace1"), 60)
    config = SimConfig(qps=0.2, output_lengths=OutputLengths.LEARNED)
    sim = Simulation(queries, parse_cluster("A100,A100,A6000,L40S"), PRESETS["hexgen-flow"], config)
    sim.run()
    seen = sorted(
        c.output_tokens
        for q in queries
        for s in q.workflow.stages
        for c in s.calls
        if c.step == "generate_candidate"
    )
    belief = sim.core.lengths  # what it learned by the end
    assert isinstance(belief, OutputLengthPredictor)
    window = seen  # fewer calls than the window: all of them
    assert len(window) <= belief.window
    predicted = belief.predict("generate_candidate")
    assert min(seen) <= predicted <= max(seen)
    below = sum(1 for t in seen if t <= predicted) / len(seen)
    assert 0.7 <= below <= 0.85  # the 75th percentile, give or take a call


def test_admission_plans_with_the_belief() -> None:
    queries = take_queries(load_trace("trace1"), 40)
    cluster = parse_cluster("A100,A100,A6000,L40S")
    config = SimConfig(qps=0.5, output_lengths=OutputLengths.MAX_TOKENS, max_tokens=8000)
    capped = AdmittingSimulation(queries, cluster, PRESETS["hexgen-flow"], config)
    capped.run()
    known = AdmittingSimulation(queries, cluster, PRESETS["hexgen-flow"], SimConfig(qps=0.5))
    known.run()
    assert capped.rejected > known.rejected  # 8,000-token outputs everywhere look infeasible


def test_the_cli_takes_the_option() -> None:
    args = ("simulate", "--num-queries", "40", "--qps", "0.3", "--alpha", "0.5")
    known = run_json(*args)
    assert known["output_lengths"] == "known"
    capped = run_json(*args, "--output-lengths", "max-tokens", "--max-tokens", "3000")
    assert capped["output_lengths"] == "max-tokens" and capped["slo_s"] == known["slo_s"]
    assert capped["queries"] != known["queries"]
    bad = run_cli("simulate", "--output-lengths", "psychic")
    assert "--output-lengths" in one_error_line(bad)


def test_the_belief_carries_on_from_its_kept_state() -> None:
    before = OutputLengthPredictor()
    for n in (10, 20, 30, 40, 50):
        before.observe("revise", n)
    kept = before.state()
    after = OutputLengthPredictor()
    after.observe("revise", 60)  # seen since the restart: newer than what was kept
    restored = after.restore({**kept, "bad": "[1, -2]", "worse": "{not json"})
    assert restored == ["revise"]
    assert after.state() == {"revise": "[10, 20, 30, 40, 50, 60]"}
    assert after.predict("revise") == 50 and after.predict("bad") == after.predict("worse")
