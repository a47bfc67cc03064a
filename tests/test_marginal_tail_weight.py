"""`marginal-latency`'s tail weight (`tail_power` p): each call's seconds weigh
((now - arrival + own + remaining) / slo) ** p, its own latency as well as the delay it
causes to the calls in flight, which keep the weight they were dispatched with (the
dispatcher's docstring). Expected values are computed here from the latency model."""

from __future__ import annotations

import math

import pytest

from dispatch_driver import Driver, context
from hexgen_flow.cluster import Cluster, parse_cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.policies.dispatch import MAX_TAIL_POWER, MarginalLatencyDispatcher
from hexgen_flow.runtime import CallTicket, ClusterLoad
from hexgen_flow.workload import LLMCall

REVISE = LLMCall("revise", 5963, 79)
SMALL = LLMCall("information_retriever", 308, 5)
SLO = 100.0


def _own(cluster: Cluster, i: int, call: LLMCall, batch: int) -> float:
    lat = cluster.instances[i].latency
    prefill, decode = lat.split(call.input_tokens, call.output_tokens)
    return prefill + decode * lat.slowdown(batch + 1)


def _weight(ticket: CallTicket, own: float, now: float, power: float) -> float:
    run = ticket.run
    assert run is not None
    return math.pow((now - run.arrival_s + own + ticket.remaining_after_s) / SLO, power)


def _scores(
    cluster: Cluster,
    load: ClusterLoad,
    ticket: CallTicket,
    now: float,
    alpha: float,
    power: float,
    others_weight: float,
) -> list[float]:
    """score_i = alpha * w_self * own_i + (1 - alpha) * weighted delay_i, by the docstring;
    another driver's calls weigh what was reported of them, else `others_weight` each."""
    call = ticket.call
    out = []
    for inst in cluster.instances:
        i, lat = inst.index, inst.latency
        prefill, _ = lat.split(call.input_tokens, call.output_tokens)
        b = load.in_flight[i]
        own = _own(cluster, i, call, b)
        score = alpha * _weight(ticket, own, now, power) * own
        if b:
            if power > 0 and load.others_weight[i] > 0:
                batch_o, work_o = load.others_weight[i], load.others_weighted_outstanding_s[i]
            else:
                batch_o = others_weight * load.others_in_flight[i]
                work_o = others_weight * load.others_outstanding_s[i]
            batch = load.weight_in_flight[i] + batch_o
            work = load.weighted_outstanding_s[i] + work_o
            stretch = lat.slowdown(b + 1) - lat.slowdown(b)
            score += (1 - alpha) * (stretch * 0.5 * work + prefill * batch)
        out.append(score)
    return out


def test_a_call_with_time_to_spare_keeps_off_the_instance_serving_a_late_query() -> None:
    """One call of a query 90 s into its 100 s SLO runs on instance 0, two calls of fresh
    queries on instance 1. Unweighted, a fresh call joins the shorter batch (0); weighted,
    the delay it would add to the late query outweighs a batch of two, so it goes to 1."""
    now = 90.0

    def choice(power: float) -> int:
        cluster = parse_cluster("A100,A100")
        ctx = context(cluster)
        driver = Driver(ctx)
        ml = MarginalLatencyDispatcher(ctx, tail_power=power)
        driver.place(0, REVISE, weigh=ml, now=now, arrival_s=0.0)
        for _ in range(2):
            driver.place(1, REVISE, weigh=ml, now=now, arrival_s=now)
        fresh = driver.ticket(REVISE, arrival_s=now)
        scores = _scores(cluster, ctx.load, fresh, now, 0.5, power, others_weight=1.0)
        chosen = ml.select(fresh, now)
        assert chosen == scores.index(min(scores))
        return chosen

    assert choice(0.0) == 0
    assert choice(2.0) == 1


def test_weights_in_the_ledger_are_the_formula_at_dispatch() -> None:
    cluster = parse_cluster("A100,A100")
    ctx = context(cluster)
    driver = Driver(ctx)
    ml = MarginalLatencyDispatcher(ctx, tail_power=3.0)
    late = driver.place(0, REVISE, weigh=ml, now=40.0, arrival_s=0.0, remaining_after_s=25.0)
    own = _own(cluster, 0, REVISE, 0)
    assert late.weight == pytest.approx(((40.0 + own + 25.0) / SLO) ** 3)
    second = driver.place(0, SMALL, weigh=ml, now=41.0, arrival_s=30.0)
    assert second.weight == pytest.approx(((11.0 + _own(cluster, 0, SMALL, 1)) / SLO) ** 3)
    load = ctx.load
    assert load.weight_in_flight[0] == pytest.approx(late.weight + second.weight)
    assert load.weighted_outstanding_s[0] == pytest.approx(
        late.weight * late.work_s + second.weight * second.work_s
    )
    load.on_complete(late)
    assert load.weight_in_flight[0] == pytest.approx(second.weight)
    load.on_complete(second)
    assert load.weight_in_flight == [0.0, 0.0]
    assert load.weighted_outstanding_s == [0.0, 0.0]


@pytest.mark.parametrize("alpha", [0.2, 0.5, 0.9])
@pytest.mark.parametrize("power", [1.0, 2.0, 4.0])
def test_the_choice_is_the_weighted_formula(alpha: float, power: float) -> None:
    """Three A100s with calls of queries at different points of their SLO in flight, and
    calls another driver placed on instance 2 (they weigh as this driver's mean call)."""
    cluster = parse_cluster("A100,A100,A100")
    ctx = context(cluster)
    driver = Driver(ctx)
    ml = MarginalLatencyDispatcher(ctx, alpha=alpha, tail_power=power)
    now = 60.0
    for instance, arrival in [(0, 0.0), (0, 55.0), (1, 40.0), (1, 45.0), (1, 50.0), (2, 58.0)]:
        driver.place(instance, REVISE, weigh=ml, now=now, arrival_s=arrival)
    ctx.load.report_others(2, 3, 12.0, 3 * (REVISE.input_tokens + REVISE.output_tokens))
    mean = sum(ctx.load.weight_in_flight) / 6
    for arrival in (0.0, 20.0, 45.0, 60.0):
        ticket = driver.ticket(REVISE, arrival_s=arrival, remaining_after_s=10.0)
        scores = _scores(cluster, ctx.load, ticket, now, alpha, power, others_weight=mean)
        assert ml.select(ticket, now) == scores.index(min(scores)), arrival


def test_another_shards_calls_weigh_what_their_worker_reports() -> None:
    """Two A100s, one call of this driver's on each, and two calls another coordinator shard
    placed on each, alike in number, work and tokens. The shared workers report their
    weights: instance 0's belong to a query near its deadline, instance 1's to fresh ones,
    so a new call keeps off instance 0. Unreported (a worker older than the report), they
    weigh this driver's mean call each: the instances tie, and the first wins."""
    cluster = parse_cluster("A100,A100")
    tokens = 2 * (REVISE.input_tokens + REVISE.output_tokens)

    def choice(weights: tuple[float, float]) -> int:
        ctx = context(cluster)
        driver = Driver(ctx)
        ml = MarginalLatencyDispatcher(ctx, tail_power=3.0)
        for instance in (0, 1):
            driver.place(instance, REVISE, weigh=ml, now=60.0, arrival_s=50.0)
            w = weights[instance]
            ctx.load.report_others(instance, 2, 20.0, tokens, 2 * w, 2 * w * 10.0)
        assert ctx.load.others_weight == [2 * w for w in weights]
        fresh = driver.ticket(REVISE, arrival_s=60.0)
        mean = sum(ctx.load.weight_in_flight) / 2
        scores = _scores(cluster, ctx.load, fresh, 60.0, 0.5, 3.0, others_weight=mean)
        chosen = ml.select(fresh, 60.0)
        assert chosen == scores.index(min(scores))
        return chosen

    assert choice((1.5, 0.01)) == 1
    assert choice((0.01, 1.5)) == 0
    assert choice((0.0, 0.0)) == 0  # not reported: the mean for both, a tie


def test_a_report_replaces_the_last_and_an_empty_or_bad_one_weighs_nothing() -> None:
    load = context(parse_cluster("A100")).load
    load.report_others(0, 2, 20.0, 100, 3.0, 30.0)
    load.report_others(0, 1, 10.0, 50, 0.5, 5.0)
    assert (load.others_weight, load.others_weighted_outstanding_s) == ([0.5], [5.0])
    load.report_others(0, 0, 0.0, 0, 0.5, 5.0)  # no calls: no weight, whatever was sent
    assert (load.others_weight, load.others_weighted_outstanding_s) == ([0.0], [0.0])
    load.report_others(0, 1, 10.0, 50, math.nan, -1.0)
    assert (load.others_weight, load.others_weighted_outstanding_s) == ([0.0], [0.0])
    assert (load.in_flight, load.outstanding_s) == ([1], [10.0])


def test_power_zero_is_the_unweighted_score_and_weighs_every_call_one() -> None:
    cluster = parse_cluster("A100,A100,A6000")
    ctx = context(cluster)
    driver = Driver(ctx)
    unweighted = MarginalLatencyDispatcher(ctx, alpha=0.4)
    for instance, arrival in [(0, 0.0), (0, 50.0), (1, 10.0), (2, 59.0)]:
        t = driver.place(instance, REVISE, weigh=unweighted, now=60.0, arrival_s=arrival)
        assert t.weight == 1.0
    # another shard's calls count one each, whatever weights were reported for them
    ctx.load.report_others(1, 2, 15.0, 2 * (REVISE.input_tokens + REVISE.output_tokens), 9.0, 90.0)
    ticket = driver.ticket(REVISE, arrival_s=0.0)
    scores = _scores(cluster, ctx.load, ticket, 60.0, 0.4, 0.0, others_weight=1.0)
    assert unweighted.select(ticket, 60.0) == scores.index(min(scores))


@pytest.mark.parametrize("power", [-0.5, MAX_TAIL_POWER + 1])
def test_a_tail_power_out_of_range_is_refused_by_name(power: float) -> None:
    with pytest.raises(ConfigError, match="tail_power"):
        MarginalLatencyDispatcher(context(parse_cluster("A100")), tail_power=power)
