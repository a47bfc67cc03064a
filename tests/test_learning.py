"""Online self-calibration (`hexgen_flow.learning`): the learner on calls whose cost it can
explain exactly (it must find the factors, through outliers, drift and a table far off,
never below the physical floor), the simulator's measurement of what a call cost
(`MeteredEngine`), the scheduler following what it learned, and the whole loop in the
simulator with a planner whose table is wrong."""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import pytest

from cli_runner import run_json
from hexgen_flow.cluster import parse_cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.learning import (
    CallCost,
    CostLearner,
    CostMeter,
    FirstToken,
    InstanceCostLearner,
    LearnerSettings,
    check_predictions,
    cost_journal_line,
    read_cost_journal,
    within_after,
)
from hexgen_flow.lengths import OutputLengths
from hexgen_flow.policies.dispatch import MarginalLatencyDispatcher
from hexgen_flow.policies.presets import PRESETS
from hexgen_flow.roofline import prefill_floor_s
from hexgen_flow.runtime import CallTicket, QueryRun
from hexgen_flow.scheduler import GlobalScheduler
from hexgen_flow.sim.engine import BatchingEngineModel
from hexgen_flow.sim.metering import MeteredEngine
from hexgen_flow.sim.simulator import SimConfig, Simulation
from hexgen_flow.sim.vllm_v1 import VllmV1EngineModel
from hexgen_flow.traces import load_trace, take_queries
from hexgen_flow.workload import LLMCall, Query, Workflow

L40S = parse_cluster("L40S").instances[0]
SETTINGS = LearnerSettings(prior_calls=2.0, memory_calls=600.0)
"""A light prior and a long memory: the factors of exact calls come out within a few %."""
CLUSTER = parse_cluster("A100,A100,A6000,L40S")


def calls(rng: random.Random, n: int) -> list[CallCost]:
    """Calls of agentic sizes under varied load, their service time still unset."""
    out = []
    for _ in range(n):
        out.append(
            CallCost(
                0,
                rng.randint(500, 14000),
                rng.randint(20, 600),
                0.0,
                rng.uniform(1, 24),
                rng.uniform(2e3, 2e5),
                0,
                rng.randint(0, 4),
                rng.randint(0, 30000),
                2048,
            )
        )
    return out


def served(learner: InstanceCostLearner, cost: CallCost, a: float, b: float) -> CallCost:
    """`cost` as an instance whose prefill is a x and decode b x the calibration serves it."""
    p, x = learner.predict_s(cost)
    return CallCost(
        cost.instance,
        cost.input_tokens,
        cost.output_tokens,
        a * p + b * x,
        cost.mean_batch,
        cost.mean_kv_tokens,
        cost.cached_tokens,
        cost.others_calls,
        cost.others_prompt_tokens,
        cost.step_tokens,
    )


@pytest.mark.parametrize(("a", "b"), [(1.0, 1.0), (2.0, 0.8), (0.5, 1.6), (1.3, 1.3)])
def test_the_learner_finds_the_factors_of_calls_it_can_explain(a: float, b: float) -> None:
    learner = InstanceCostLearner(L40S, SETTINGS)
    for cost in calls(random.Random(1), 400):
        learner.observe(served(learner, cost, a, b))
    assert learner.a == pytest.approx(a, rel=0.05)
    assert learner.b == pytest.approx(b, rel=0.05)


def test_a_few_calls_move_little_and_many_move_all_the_way() -> None:
    learner = InstanceCostLearner(L40S, LearnerSettings(refit_calls=1, min_change=0.0))
    stream = calls(random.Random(2), 300)
    for cost in stream[:3]:
        learner.observe(served(learner, cost, 2.0, 2.0))
    assert 1.0 < learner.a < 1.6 and 1.0 < learner.b < 1.6  # the prior still weighs
    for cost in stream[3:]:
        learner.observe(served(learner, cost, 2.0, 2.0))
    assert learner.a == pytest.approx(2.0, rel=0.05)
    assert learner.b == pytest.approx(2.0, rel=0.05)


def test_calls_that_agree_count_fully_however_far_the_table_is_off() -> None:
    """A server 2.5x slower than its table (a GPU nobody measured): its calls agree with
    each other, so none is down-weighted as odd (judged against the calibration instead,
    each counted about half and a dozen calls left both factors below 1.9)."""
    learner = InstanceCostLearner(L40S, LearnerSettings(refit_calls=1, min_change=0.0))
    for cost in calls(random.Random(11), 12):
        learner.observe(served(learner, cost, 2.5, 2.5))
    assert learner.a >= 1.95 and learner.b >= 1.95
    assert learner.dropped == 0


def test_odd_calls_do_not_move_the_factors_far() -> None:
    rng = random.Random(3)
    learner = InstanceCostLearner(L40S, SETTINGS)
    for cost in calls(rng, 500):
        honest = served(learner, cost, 1.5, 1.0)
        if rng.random() < 0.1:  # preempted and recomputed, or a stalled worker: 20x
            honest = served(learner, cost, 30.0, 20.0)
        learner.observe(honest)
    assert learner.a == pytest.approx(1.5, rel=0.1)
    assert learner.b == pytest.approx(1.0, rel=0.1)
    assert learner.dropped >= 30


def test_the_learner_follows_drift() -> None:
    settings = LearnerSettings(memory_calls=200)
    learner = InstanceCostLearner(L40S, settings)
    stream = calls(random.Random(4), 1400)
    for cost in stream[:600]:
        learner.observe(served(learner, cost, 1.0, 1.0))
    assert learner.b == pytest.approx(1.0, rel=0.05)
    for cost in stream[600:]:  # the GPU throttles: decode 1.8x slower from now on
        learner.observe(served(learner, cost, 1.0, 1.8))
    assert learner.b == pytest.approx(1.8, rel=0.1)


def test_a_table_far_off_is_learned_not_dropped_as_outliers() -> None:
    learner = InstanceCostLearner(L40S, SETTINGS)
    for cost in calls(random.Random(5), 800):
        learner.observe(served(learner, cost, 12.0, 1.0))  # 12x: every call an "outlier"
    assert learner.a == pytest.approx(12.0, rel=0.1)


def test_no_factor_falls_below_the_physical_floor() -> None:
    learner = InstanceCostLearner(L40S, SETTINGS)
    floor_a = learner.floor_prefill
    assert 0 < floor_a < 1  # aiconfigurator's L40S prefill sits far above its FLOP floor
    for cost in calls(random.Random(6), 400):
        learner.observe(served(learner, cost, floor_a / 10, 1.0))  # beyond physics
    assert floor_a <= learner.a < 1.05 * floor_a  # at the floor (the prior lifts it a hair)


def test_the_metered_engine_measures_what_a_worker_can() -> None:
    engine = MeteredEngine(BatchingEngineModel(L40S), 3)
    run = QueryRun(Query("q", Workflow.chain([(LLMCall("a", 4000, 100),)])), 0, 0.0, 1e9)
    first = CallTicket(0, run, 0, LLMCall("a", 4000, 100), 0.0, 1e9)
    second = CallTicket(1, run, 0, LLMCall("b", 1000, 50), 0.0, 1e9)
    engine.admit(first, 0.0)
    engine.admit(second, 1.0)
    finished: list[CallTicket] = []
    while len(finished) < 2:
        finished += engine.advance(engine.next_event_s())
    costs = {t.seq: engine.take_cost(t) for t in finished}
    one, two = costs[0], costs[1]
    assert one is not None and two is not None
    assert one.instance == 3 and one.service_s == pytest.approx(first.finished_s)
    assert one.others_calls == 1 and one.others_prompt_tokens == 1000  # taken while it ran
    assert two.others_calls == 0
    assert 1.0 < one.mean_batch < 2.0 and 1.0 < two.mean_batch <= 2.0
    assert engine.take_cost(first) is None  # once


def test_the_simulator_meters_a_call_at_what_its_engine_was_asked_for() -> None:
    """While a call runs, its driver knows only what the engine was asked to generate: a
    coordinator learning output lengths asks each worker for the declared cap and hears
    what a call generated when it is back. The simulator's meter charges the same, not the
    length its engine model runs (the workload's), or it would learn from a KV load no
    worker can see."""
    call = LLMCall("a", 1000, 4)  # generates 4 tokens, declared at 64
    run = QueryRun(Query("q", Workflow.chain([(call,)])), 0, 0.0, 1e9)
    means = {}
    for declared in (None, 64):
        engine = MeteredEngine(BatchingEngineModel(L40S), 0, declared)
        ticket = CallTicket(0, run, 0, call, 0.0, 1e9)
        engine.admit(ticket, 0.0)
        finished: list[CallTicket] = []
        while not finished:
            finished = engine.advance(engine.next_event_s())
        cost = engine.take_cost(ticket)
        assert cost is not None and cost.output_tokens == 4  # what it generated
        means[declared] = cost.mean_kv_tokens
    assert means == {None: pytest.approx(1000 + 4 / 2), 64: pytest.approx(1000 + 64 / 2)}
    # the coordinator's meter, told the call generated 4 of the 64 asked, charges the same
    meter = CostMeter(0)
    asked = CallTicket(0, run, 0, dataclasses.replace(call, output_tokens=64), 0.0, 1e9)
    meter.taken(asked, 0.0)
    asked.output_tokens = 4
    cost = meter.finished(asked, 1.0)
    assert cost is not None and cost.mean_kv_tokens == pytest.approx(means[64])
    # and each information model sets the simulator's meters to what its engines are asked
    queries = take_queries(load_trace("trace1"), 2)
    for lengths, cap, expected in (
        (OutputLengths.KNOWN, None, None),
        (OutputLengths.LEARNED, None, None),
        (OutputLengths.LEARNED, 32, 32),
        (OutputLengths.MAX_TOKENS, None, 512),
    ):
        config = SimConfig(
            qps=0.2, learn_costs=True, output_lengths=lengths, learned_cap=cap, max_tokens=512
        )
        sim = Simulation(queries, CLUSTER, PRESETS["hexgen-flow"].with_alpha(0.5), config)
        assert sim._metered is not None
        assert {m.declared for m in sim._metered} == {expected}, (lengths, cap)


def test_the_scheduler_follows_what_it_learned() -> None:
    scheduler = GlobalScheduler(CLUSTER, PRESETS["hexgen-flow"])
    learner = scheduler.learn_costs(LearnerSettings(refit_calls=1))
    call = LLMCall("generate_candidate", 8000, 200)
    before = scheduler.estimator.call_time(3, call)
    rng = random.Random(7)
    for drawn in calls(rng, 200):
        cost = dataclasses.replace(drawn, instance=3)
        scheduler.observe_cost(served(learner.instances[3], cost, 3.0, 3.0))
    assert scheduler.estimator.call_time(3, call) == pytest.approx(3 * before, rel=0.05)
    assert scheduler.estimator.call_time(0, call) == CLUSTER.instances[0].latency.single_s(
        8000, 200
    )
    # The dispatcher scores with the new model too.
    dispatcher = scheduler.dispatcher
    assert isinstance(dispatcher, MarginalLatencyDispatcher)
    split = dispatcher._split[3](8000, 200)
    assert split[0] == pytest.approx(3 * CLUSTER.instances[3].latency.split(8000, 200)[0], rel=0.05)


def test_a_cost_learner_needs_a_known_instance() -> None:
    learner = CostLearner(CLUSTER)
    with pytest.raises(Exception, match="no instance 9"):
        learner.observe(CallCost(9, 100, 10, 1.0, 1.0))


def test_the_simulator_learns_a_wrong_table_toward_the_truth() -> None:
    """The planner believes the A6000 and L40S prefill 3x slower than they are."""
    queries = take_queries(load_trace("trace1"), 200)
    belief = CLUSTER.misjudged({"L40S": (3.0, 1.0), "A6000": (3.0, 1.0)})
    config = SimConfig(qps=0.2, seed=1, learn_costs=True)
    sim = Simulation(queries, belief, PRESETS["hexgen-flow"].with_alpha(0.5), config, truth=CLUSTER)
    sim.run()
    assert sim.scheduler.learner is not None
    factors = sim.scheduler.learner.factors()
    for i in (2, 3):  # truth is 1/3 of the belief: learned well below 1
        assert factors[i].prefill < 0.6, factors[i]
        assert factors[i].calls > 50
    exact = Simulation(queries, CLUSTER, PRESETS["hexgen-flow"].with_alpha(0.5), config)
    exact.run()
    assert exact.scheduler.learner is not None
    for f in exact.scheduler.learner.factors():  # with the engines' own table: near 1
        assert 0.5 < f.prefill < 1.5 and 0.6 < f.decode < 1.6, f


def test_a_tuner_replays_the_cluster_as_the_scheduler_learned_it() -> None:
    """`believed_cluster` (what the simulator's online tuner replays; the mesh's builds the
    same from ClusterStatus) runs each instance as its learned model, the one every
    estimate uses."""
    queries = take_queries(load_trace("trace1"), 120)
    belief = CLUSTER.misjudged({"L40S": (3.0, 1.0), "A6000": (3.0, 1.0)})
    config = SimConfig(qps=0.2, seed=1, learn_costs=True)
    sim = Simulation(queries, belief, PRESETS["hexgen-flow"].with_alpha(0.5), config, truth=CLUSTER)
    assert sim.scheduler.believed_cluster() == sim.scheduler.cluster  # nothing learned yet
    sim.run()
    learner = sim.scheduler.learner
    assert learner is not None
    believed = sim.scheduler.believed_cluster()
    for i, inst in enumerate(believed.instances):
        for tokens in ((800, 20), (6_000, 300)):
            assert inst.latency.split(*tokens) == learner.model(i).split(*tokens)
    slow = believed.instances[3].latency.single_s(6_000, 300)
    assert slow < 0.7 * belief.instances[3].latency.single_s(6_000, 300)  # learned faster
    plain = GlobalScheduler(belief, PRESETS["hexgen-flow"])
    assert plain.believed_cluster() is belief  # not learning: the calibration as it is


def test_the_cli_reports_what_it_learned() -> None:
    args = ("simulate", "--num-queries", "60", "--qps", "0.3", "--alpha", "0.5")
    plain = run_json(*args)
    assert plain["learn_costs"] is False and "learned" not in plain
    learning = run_json(*args, "--learn-costs", "--planner-error", "L40S:prefill=3")
    assert learning["learn_costs"] is True
    assert learning["planner_error"] == {"L40S": {"prefill": 3.0, "decode": 1.0}}
    assert [row["instance"] for row in learning["learned"]] == [
        "A100#0",
        "A100#1",
        "A6000#2",
        "L40S#3",
    ]
    assert learning["slo_s"] == plain["slo_s"]


def test_rescaled_models_leave_the_prior_alone() -> None:
    prior = L40S.latency
    before = prior.split(6000, 300)
    scaled = prior.rescaled(0.5, 2.0)
    assert scaled.split(6000, 300) == pytest.approx((before[0] * 0.5, before[1] * 2.0))
    assert scaled.prefill_curve_s(3000) == pytest.approx(prior.prefill_curve_s(3000) * 0.5)
    assert prior.split(6000, 300) == before
    assert prior.rescaled(1.0, 1.0) is prior
    with pytest.raises(ValueError, match="finite and > 0"):
        prior.rescaled(0.0, 1.0)


def test_the_cost_meter_integrates_between_events() -> None:
    """The coordinator's view: calls taken and returned at given times, nothing else."""
    meter = CostMeter(1)
    run = QueryRun(Query("q", Workflow.chain([(LLMCall("a", 1000, 100),)])), 0, 0.0, 1e9)
    a = CallTicket(0, run, 0, LLMCall("a", 1000, 100), 0.0, 1e9)
    b = CallTicket(1, run, 0, LLMCall("b", 500, 50), 0.0, 1e9)
    c = CallTicket(2, run, 0, LLMCall("c", 300, 10), 0.0, 1e9)
    meter.taken(a, 0.0)
    meter.taken(b, 2.0)
    cost_b = meter.finished(b, 4.0)
    cost_a = meter.finished(a, 6.0, service_s=5.5)
    assert cost_a is not None and cost_b is not None
    assert cost_b.mean_batch == pytest.approx(2.0) and cost_b.others_calls == 0
    assert cost_b.service_s == pytest.approx(2.0)
    assert cost_a.mean_batch == pytest.approx(8 / 6)  # 1 call, then 2, then 1: 2 s each
    assert cost_a.others_calls == 1 and cost_a.others_prompt_tokens == 500
    assert cost_a.service_s == 5.5  # as the engine reported it
    assert cost_a.mean_kv_tokens == pytest.approx((1050 * 6 + 525 * 2) / 6)
    meter.taken(c, 6.0)
    meter.dropped(c, 7.0)
    assert meter.finished(c, 8.0) is None and meter.held == 0


def test_a_call_told_what_it_generated_leaves_the_meter_what_it_was_charged() -> None:
    """A coordinator learning output lengths asks each engine for the declared cap and
    sets a call's output tokens to what it generated when it comes back: the KV tokens the
    meter charged the call when it was taken leave with it, or every call that stopped
    before its cap would leave phantom KV tokens behind for the calls after it."""
    meter = CostMeter(0)
    run = QueryRun(Query("q", Workflow.chain([(LLMCall("a", 100, 32),)])), 0, 0.0, 1e9)
    for k in range(50):  # one after another, each asked for 32 tokens and generating 2
        ticket = CallTicket(k, run, 0, LLMCall("a", 100, 32), 0.0, 1e9)
        meter.taken(ticket, 2.0 * k)
        ticket.output_tokens = 2
        cost = meter.finished(ticket, 2.0 * k + 1)
        assert cost is not None and cost.output_tokens == 2
        # alone, it held its own prompt and half the tokens asked of it: nothing left over
        assert cost.mean_kv_tokens == pytest.approx(100 + 32 / 2), k
    dropped = CallTicket(50, run, 0, LLMCall("a", 100, 32), 0.0, 1e9)
    meter.taken(dropped, 100.0)
    dropped.output_tokens = 1
    meter.dropped(dropped, 100.5)
    last = CallTicket(51, run, 0, LLMCall("a", 100, 8), 0.0, 1e9)
    meter.taken(last, 101.0)
    cost = meter.finished(last, 102.0)
    assert cost is not None and cost.mean_kv_tokens == pytest.approx(104.0)


def test_a_learner_carries_on_from_its_kept_state() -> None:
    cluster = parse_cluster("A100,L40S")
    first = CostLearner(cluster, SETTINGS)
    stream = calls(random.Random(8), 300)
    for cost in stream[:200]:
        first.observe(served(first.instances[1], dataclasses.replace(cost, instance=1), 2.0, 1.2))
    kept = first.states(cluster)
    second = CostLearner(cluster, SETTINGS)
    assert second.restore(cluster, kept) == [0, 1]
    assert second.factors() == first.factors()
    for cost in stream[200:]:  # the same calls next: the same factors
        call = dataclasses.replace(cost, instance=1)
        assert first.observe(served(first.instances[1], call, 2.0, 1.2)) == second.observe(
            served(second.instances[1], call, 2.0, 1.2)
        )
    assert second.factors() == first.factors()
    # Kept over other numbers (another calibration, another GPU in the slot): ignored.
    other = parse_cluster("A100,L40S", calibration="chess-measured")
    assert CostLearner(other).restore(other, kept) == []
    swapped = parse_cluster("A100,A6000")
    assert CostLearner(swapped).restore(swapped, kept) == [0]
    # A state that is not one is ignored, not trusted.
    broken = {"A100#0": "{not json", "L40S#1": '{"gpu": "L40S", "a": "x"}'}
    assert CostLearner(cluster).restore(cluster, broken) == []


@pytest.mark.parametrize("gpu", ["A100", "A6000", "L40S"])
def test_the_floor_is_physics_on_the_prefill_curve_not_a_capped_table(gpu: str) -> None:
    """chess-measured's single-request table, measured with cache hits, caps a short call's
    prefill far below its prefill curve (a 4,096-token prompt with one output token: 0.1 s
    on every GPU, against a curve of 0.3-1.6 s). The floor judged against that capped
    figure put the least learned 4,096-token prefill at 1.2 s on an A100, 10.5 s on an
    A6000 and 6.9 s on an L40S: 2.6-18x the physical floor and 1.35-1.85x above what
    aiconfigurator says, so a learner planning with chess-measured could not come down to
    aiconfigurator engines. On the curve, the floor is the physics."""
    spec = parse_cluster(gpu, calibration="chess-measured").instances[0]
    learner = InstanceCostLearner(spec, LearnerSettings())
    prior, floor_s = spec.latency, prefill_floor_s(spec.latency.hardware, 4096)
    least = learner.floor_prefill * prior.prefill_curve_s(4096)
    assert least == pytest.approx(floor_s, rel=1e-9)
    truth = parse_cluster(gpu).instances[0].latency.prefill_s(4096, 200)
    assert least < truth
    # Judged against the capped figure, the least belief would have been above the truth.
    assert floor_s / prior.prefill_s(4096, 1) * prior.prefill_curve_s(4096) > 1.3 * truth


def test_a_learner_planning_with_a_capped_table_comes_down_to_the_engines() -> None:
    """Planner chess-measured, engines aiconfigurator (an L40S): the learned model's
    prefill of long prompts comes within 20 % of the engines' (it was held 1.35x above
    them by the floor of a capped table)."""
    planner = parse_cluster("L40S", calibration="chess-measured").instances[0]
    engines = InstanceCostLearner(L40S, SETTINGS)  # explains the aiconfigurator calls exactly
    learner = InstanceCostLearner(planner, SETTINGS)
    for cost in calls(random.Random(12), 600):
        learner.observe(served(engines, cost, 1.0, 1.0))
    model = CostLearner(parse_cluster("L40S", calibration="chess-measured"))
    model.instances[0] = learner
    for tokens in (4000, 8000, 12000):
        believed = model.model(0).prefill_s(tokens, 300)
        assert believed == pytest.approx(L40S.latency.prefill_s(tokens, 300), rel=0.2)


def test_the_cost_meter_splits_the_others_at_the_first_token() -> None:
    """Calls taken before a call's first token shared its prefill steps, the rest its decode
    steps; a first token the engine did not report (or one outside the service) splits
    nothing."""
    meter = CostMeter(1)
    run = QueryRun(Query("q", Workflow.chain([(LLMCall("a", 1000, 100),)])), 0, 0.0, 1e9)
    a = CallTicket(0, run, 0, LLMCall("a", 1000, 100), 0.0, 1e9)
    b = CallTicket(1, run, 0, LLMCall("b", 500, 50), 0.0, 1e9)
    c = CallTicket(2, run, 0, LLMCall("c", 300, 10), 0.0, 1e9)
    meter.taken(a, 0.0)
    meter.taken(b, 1.0)  # before a's first token at 1.5 s
    meter.taken(c, 2.0)  # after it
    cost_a = meter.finished(a, 6.0, service_s=6.0, first_token_s=1.5)
    assert cost_a is not None
    assert cost_a.first_token_s == 1.5
    assert cost_a.others_calls == 2 and cost_a.others_prompt_tokens == 800
    assert cost_a.others_before_calls == 1 and cost_a.others_before_prompt_tokens == 500
    for reported in (None, 0.0, -1.0, 7.0):  # not said, or not within its 4 s of service
        cost = meter.finished(b, 5.0, service_s=4.0, first_token_s=reported)
        assert cost is not None and cost.first_token_s == 0.0 and cost.others_before_calls == 0
        meter.taken(b, 1.0)


def test_the_cost_meter_sees_the_prompts_still_ahead_of_a_call() -> None:
    """A call taken before another and still prefilling when the other began is ahead of
    it, for the share of its prefill (taken to first token) within the other's service;
    one done prefilling before, one that did not report its first token and one still
    held when the other came back are not."""
    meter = CostMeter(0)
    run = QueryRun(Query("q", Workflow.chain([(LLMCall("a", 1000, 100),)])), 0, 0.0, 1e9)
    tickets = [
        CallTicket(i, run, 0, LLMCall(f"c{i}", 1000 * (i + 1), 10), 0.0, 1e9) for i in range(5)
    ]
    early, ahead, silent, long, late = tickets
    for t, at in zip(tickets, (0.0, 0.0, 0.2, 0.4, 1.0), strict=True):
        meter.taken(t, at)
    assert meter.finished(early, 0.9, service_s=0.9, first_token_s=0.5) is not None  # before 1.0
    assert meter.finished(ahead, 5.0, service_s=5.0, first_token_s=3.0) is not None
    assert meter.finished(silent, 4.0, service_s=3.8) is not None  # no first token said
    cost = meter.finished(late, 6.0, service_s=5.0)
    assert cost is not None
    # `ahead` prefilled over [0, 3]: 2 of its 3 s within late's service [1, 6]
    assert cost.ahead_calls == pytest.approx(2 / 3, abs=1e-3)
    assert cost.ahead_prompt_tokens == pytest.approx(2000 * 2 / 3, abs=0.1)
    assert meter.held == 1  # `long` is still held: not counted, and not forgotten
    assert meter.finished(long, 7.0, service_s=6.6) is not None and meter.held == 0


def test_engine_models_report_the_first_token_to_the_meter() -> None:
    """Both engine models set `CallTicket.first_token_s`; the meter measures it from the
    call's first step, within its service."""
    for model in (BatchingEngineModel(L40S), VllmV1EngineModel(L40S)):
        engine = MeteredEngine(model, 3)
        run = QueryRun(Query("q", Workflow.chain([(LLMCall("a", 4000, 100),)])), 0, 0.0, 1e9)
        ticket = CallTicket(0, run, 0, LLMCall("a", 4000, 300), 0.0, 1e9)
        engine.admit(ticket, 0.0)
        finished: list[CallTicket] = []
        while not finished:
            finished += engine.advance(engine.next_event_s())
        cost = engine.take_cost(ticket)
        assert cost is not None and ticket.first_token_s is not None
        # alone on the engine: its prompt's prefill, then 299 decode steps
        prefill = L40S.latency.prefill_curve_s(4000)
        assert 0.5 * prefill < cost.first_token_s < 2 * prefill, (type(model), cost)
        assert cost.first_token_s < 0.5 * cost.service_s


def _served_in_phases(
    learner: InstanceCostLearner, cost: CallCost, a: float, b: float, rng: random.Random
) -> CallCost:
    """`cost` served with prefill a x and decode b x the calibration, each phase's time off
    by its own noise (lognormal, 30 %), the first token reported."""
    p1, x1, p2, x2 = learner.predict_phases_s(cost)
    first = (a * p1 + b * x1) * rng.lognormvariate(0.0, 0.3)
    rest = (a * p2 + b * x2) * rng.lognormvariate(0.0, 0.3)
    return dataclasses.replace(cost, service_s=first + rest, first_token_s=first)


def _of_one_shape(cost: CallCost, **fields: Any) -> CallCost:
    """`cost` as a call of one shape (a 6,000-token prompt, nothing cached, 200 output
    tokens, alone among the calls taken), with `fields` besides."""
    return dataclasses.replace(
        cost,
        input_tokens=6000,
        output_tokens=200,
        others_calls=0,
        others_prompt_tokens=0,
        cached_tokens=0,
        **fields,
    )


def test_the_first_token_tells_prefill_from_decode_where_the_totals_cannot() -> None:
    """Calls of one shape (a prompt's prefill always about the same share of the service):
    their totals pin only a x prefill + b x decode, and the prior decides the split; their
    first tokens pin each. Truth: prefill 0.5x, decode 1.6x the calibration."""
    rng = random.Random(5)
    shape = [_of_one_shape(c) for c in calls(rng, 600)]
    told = InstanceCostLearner(L40S, dataclasses.replace(SETTINGS, first_token=FirstToken.ALWAYS))
    untold = InstanceCostLearner(L40S, dataclasses.replace(SETTINGS, first_token=FirstToken.WHOLE))
    for cost in shape:
        call = _served_in_phases(told, cost, 0.5, 1.6, rng)
        told.observe(call)
        untold.observe(dataclasses.replace(call, first_token_s=0.0))
    assert told.a == pytest.approx(0.5, rel=0.1) and told.b == pytest.approx(1.6, rel=0.1)
    assert abs(untold.a - 0.5) > 0.2 or abs(untold.b - 1.6) > 0.3, (untold.a, untold.b)


def test_calls_that_prefilled_alone_tell_prefill_from_decode() -> None:
    """The default fits apart only the first tokens of calls an idle engine took with
    nothing before their first token: one call in four here, the rest batched, whose
    first tokens also hold prompts the driver never saw (+0-3 s). Those alone pin the
    split, which the totals leave to the prior, and the others' first tokens, fitted
    apart, would move it (truth: prefill 0.5x, decode 1.6x)."""
    rng = random.Random(7)
    shape = []
    for i, c in enumerate(calls(rng, 600)):
        lone = i % 4 == 0
        shape.append(
            _of_one_shape(
                c,
                held_at_start=0 if lone else 1 + i % 3,
                mean_batch=1.0 if lone else c.mean_batch,
            )
        )
    learners = {
        mode: InstanceCostLearner(L40S, dataclasses.replace(SETTINGS, first_token=mode))
        for mode in FirstToken
    }
    default = InstanceCostLearner(L40S, SETTINGS)
    assert default.settings.first_token is FirstToken.ALONE
    for cost in shape:
        call = _served_in_phases(default, cost, 0.5, 1.6, rng)
        if not call.prefilled_alone:  # a prompt ahead it did not see
            hidden = rng.uniform(0.0, 3.0)
            call = dataclasses.replace(
                call,
                first_token_s=call.first_token_s + hidden,
                service_s=call.service_s + hidden,
            )
        default.observe(call)
        for learner in learners.values():
            learner.observe(call)
    alone = learners[FirstToken.ALONE]
    assert (default.a, default.b) == (alone.a, alone.b)
    assert alone.a == pytest.approx(0.5, rel=0.2) and alone.b == pytest.approx(1.6, rel=0.15)
    whole, always = learners[FirstToken.WHOLE], learners[FirstToken.ALWAYS]
    assert abs(whole.a - 0.5) > 0.15 or abs(whole.b - 1.6) > 0.3, (whole.a, whole.b)
    assert abs(always.a - 0.5) > 0.15 or abs(always.b - 1.6) > 0.3, (always.a, always.b)


def test_the_cost_meter_says_what_the_engine_held_when_it_took_a_call() -> None:
    """A call taken by an idle engine with nothing before its first token prefilled alone;
    one taken while another was held, or with one taken before its first token, did not;
    a first token not reported tells nothing."""
    meter = CostMeter(0)
    run = QueryRun(Query("q", Workflow.chain([(LLMCall("a", 1000, 100),)])), 0, 0.0, 1e9)
    a, b, c, d = (CallTicket(i, run, 0, LLMCall(f"c{i}", 1000, 50), 0.0, 1e9) for i in range(4))
    meter.taken(a, 0.0)
    meter.taken(b, 2.0)  # a held, after a's first token
    cost_a = meter.finished(a, 3.0, service_s=3.0, first_token_s=1.0)
    cost_b = meter.finished(b, 5.0, service_s=3.0, first_token_s=1.0)
    assert cost_a is not None and cost_b is not None
    assert (cost_a.held_at_start, cost_b.held_at_start) == (0, 1)
    assert cost_a.prefilled_alone and not cost_b.prefilled_alone
    meter.taken(c, 6.0)
    meter.taken(d, 6.5)  # before c's first token at 7.0
    cost_c = meter.finished(c, 9.0, service_s=3.0, first_token_s=1.0)
    assert cost_c is not None and cost_c.held_at_start == 0 and not cost_c.prefilled_alone
    cost_d = meter.finished(d, 10.0, service_s=3.5)  # no first token reported
    assert cost_d is not None and not cost_d.prefilled_alone
    old = read_cost_journal([cost_journal_line(cost_a).replace(',"held_at_start":0', "")])
    assert old[0].held_at_start == -1 and not old[0].prefilled_alone  # a journal from before


def test_the_first_token_mode_is_checked() -> None:
    with pytest.raises(ConfigError, match="first_token must be one of whole, alone, always"):
        LearnerSettings(first_token=True)  # type: ignore[arg-type]


def test_noisy_calls_leave_the_factors_of_the_engines_own_table_near_one() -> None:
    """Service times spread ±30 % around the model (contention the model averages): the
    factors stay within 10 % of the truth, where fitting each call relative to its own
    measured time (the noise in the divisor, as the learner did before) put prefill 13 %
    low here."""
    for settings in (SETTINGS, dataclasses.replace(SETTINGS, first_token=FirstToken.ALWAYS)):
        rng = random.Random(6)
        learner = InstanceCostLearner(L40S, settings)
        for cost in calls(rng, 800):
            learner.observe(_served_in_phases(learner, cost, 1.0, 1.0, rng))
        assert learner.a == pytest.approx(1.0, rel=0.1), settings
        assert learner.b == pytest.approx(1.0, rel=0.1), settings


def test_a_cost_journal_gives_back_the_very_calls() -> None:
    costs = [
        dataclasses.replace(c, service_s=1.5 + i, first_token_s=0.25 * i)
        for i, c in enumerate(calls(random.Random(3), 5))
    ]
    text = "".join(cost_journal_line(c) for c in costs)
    assert text.count("\n") == len(costs)
    assert read_cost_journal(text.splitlines()) == costs
    # A field a later version added is ignored; blank lines are skipped.
    newer = text.replace('{"instance"', '{"engine_version":"x","instance"', 1) + "\n"
    assert read_cost_journal(newer.splitlines()) == costs


def _journal_of_two_servers(n: int) -> list[CallCost]:
    """A cost journal, through its own text, of two L40S: server 0 serves its calls at 2x
    its calibration, server 1 at it, each call off by a random 10 % (log-normal)."""
    rng = random.Random(8)
    cluster = parse_cluster("L40S,L40S")
    terms = [InstanceCostLearner(spec, LearnerSettings()) for spec in cluster.instances]
    text = ""
    for k, unset in enumerate(calls(rng, 2 * n)):
        i, slow = k % 2, 2.0 if k % 2 == 0 else 1.0
        cost = dataclasses.replace(unset, instance=i)
        p, x = terms[i].predict_s(cost)
        served_s = slow * (p + x) * math.exp(rng.gauss(0.0, 0.1))
        text += cost_journal_line(dataclasses.replace(cost, service_s=served_s))
    return read_cost_journal(text.splitlines())


def test_checking_a_journal_judges_each_call_by_what_the_learner_then_predicted() -> None:
    costs = _journal_of_two_servers(300)
    cluster = parse_cluster("L40S,L40S")
    # A learner that never refits (its first fit would come after 1,000 calls) predicts
    # every call by the calibration: the check sees server 0 twice as slow, server 1 right,
    # and the calls' own 10 % scatter (the median |log| of N(0, 0.1) is 0.067).
    frozen = check_predictions(costs, cluster, LearnerSettings(refit_calls=1000), skip=0)
    assert [c.instance for c in frozen] == [0, 1]
    assert [c.calls for c in frozen] == [300, 300]
    assert frozen[0].bias == pytest.approx(math.log(2.0), abs=0.03)
    assert frozen[1].bias == pytest.approx(0.0, abs=0.03)
    assert 0.04 < frozen[1].spread < 0.1
    # The learner itself, past its first 50 calls of each server: no bias left on either,
    # only the scatter.
    learning = check_predictions(costs, cluster, skip=50)
    assert [c.calls for c in learning] == [250, 250]
    for check in learning:
        assert check.bias == pytest.approx(0.0, abs=0.05), check
        assert check.spread < 0.12, check


def test_a_learners_error_falls_within_the_bound_over_its_last_calls() -> None:
    # Windows of 3 calls: after 6 calls the median of the last three, [1, 1, 0], is still
    # e^1 off; after 7, that of [1, 0, 0] is 0, and every later window is inside.
    assert within_after([1.0] * 5 + [0.0] * 10, 3, 0.2) == (7, 1.0)
    assert within_after([0.0] * 10, 3, 0.2) == (3, 1.0)  # the prior was right
    assert within_after([0.1, -0.1, 0.15], 3, 0.2) == (3, 1.0)  # log 1.2 = 0.18 either way
    assert within_after([0.0] * 10 + [-0.5], 3, 0.2) == (3, 1.0)  # one outlier moves no median
    # It got there and left again: of the 10 windows from the first on, the last is off.
    assert within_after([0.0] * 10 + [-0.5] * 2, 3, 0.2) == (3, 0.9)
    assert within_after([1.0] * 10, 3, 0.2)[0] is None  # never
    assert within_after([0.0, 0.0], 3, 0.2)[0] is None  # too few calls for one window
    costs = _journal_of_two_servers(300)
    cluster = parse_cluster("L40S,L40S")
    # A learner that never refits stays 2x off on server 0; server 1's prior is right.
    frozen = check_predictions(costs, cluster, LearnerSettings(refit_calls=1000), skip=0)
    assert frozen[0].within_after is None and math.isnan(frozen[0].windows_within)
    assert (frozen[1].within_after, frozen[1].windows_within) == (20, 1.0)
    # The real learner gets server 0 within 20 % in its first 50 calls, and stays there.
    learning = check_predictions(costs, cluster, skip=50)
    assert learning[0].within_after is not None and 20 < learning[0].within_after <= 50
    assert learning[0].windows_within == 1.0
    assert (learning[1].within_after, learning[1].windows_within) == (20, 1.0)
    with pytest.raises(ConfigError, match="window must be >= 1, got 0"):
        check_predictions(costs, cluster, window=0)
    with pytest.raises(ConfigError, match="within must be > 0, got 0"):
        check_predictions(costs, cluster, within=0.0)


def test_checking_a_journal_without_a_servers_calls_says_so() -> None:
    costs = [c for c in _journal_of_two_servers(40) if c.instance == 0]
    checks = check_predictions(costs, parse_cluster("L40S,L40S"), skip=10)
    assert checks[0].calls == 30
    assert checks[1].calls == 0 and math.isnan(checks[1].bias) and math.isnan(checks[1].spread)
    with pytest.raises(ConfigError, match="skip must be >= 0, got -1"):
        check_predictions(costs, parse_cluster("L40S,L40S"), skip=-1)


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("[1, 2]", "not an object"),
        ('{"instance": 0}', "missing"),
        ('{"instance": 0, "input_tokens": 5, "output_tokens": 2, "service_s": "slow",'
         ' "mean_batch": 1}', "service_s not a finite number"),
        ('{"instance": 0, "input_tokens": 5, "output_tokens": 2, "service_s": NaN,'
         ' "mean_batch": 1}', "service_s not a finite number"),
        ("{oops", "Expecting"),
    ],
)  # fmt: skip
def test_a_cost_journal_line_that_is_not_a_call_is_named(line: str, why: str) -> None:
    good = cost_journal_line(calls(random.Random(1), 1)[0])
    with pytest.raises(ConfigError, match=f"cost journal line 2: not a CallCost .*{why}"):
        read_cost_journal([good, line])
