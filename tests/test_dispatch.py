"""Dispatchers on hand-built clusters and loads, against the formulas they implement
(docs/algorithm.md §3 and §7, the docstrings of `hexgen_flow.policies.dispatch`).

Expected choices are derived from the latency model directly (`latency_model(...)`), not
from the `Estimator` the policies use.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from dispatch_driver import Driver as _Driver
from dispatch_driver import context as _ctx
from hexgen_flow.cluster import Cluster
from hexgen_flow.cluster import parse_cluster as _parse_cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.estimate import REPRESENTATIVE_TOKENS
from hexgen_flow.policies.dispatch import (
    LeastRequestsDispatcher,
    LeastWorkDispatcher,
    MarginalLatencyDispatcher,
    PowerOfTwoDispatcher,
    RoundRobinDispatcher,
    WorkloadBalancedDispatcher,
)
from hexgen_flow.policies.registration import DISPATCHERS
from hexgen_flow.runtime import ClusterLoad
from hexgen_flow.workload import LLMCall
from pinned_calibration import latency_model, parse_cluster

MODEL = "llama-3.1-70b"
BIG = LLMCall("generate_candidate", 11748, 678)
SMALL = LLMCall("information_retriever", 308, 5)
REVISE = LLMCall("revise", 5963, 79)


def _step_time(gpu: str, step: str) -> float:
    """The paper's t_g(s): single-request latency at the step's representative tokens."""
    return latency_model(MODEL, gpu).single_s(*REPRESENTATIVE_TOKENS[step])


# --------------------------------------------------------------------------- round-robin


def test_round_robin_cycles_through_the_instances() -> None:
    ctx = _ctx(parse_cluster("A100,A6000,L40S"))
    assert _Driver(ctx).dispatch(RoundRobinDispatcher(ctx), [SMALL] * 7) == [0, 1, 2, 0, 1, 2, 0]


def test_round_robin_skips_instances_that_cannot_hold_the_call() -> None:
    cluster = Cluster.build(
        [{"gpu": "A100"}, {"gpu": "A100", "kv_cache_tokens": 5000}, {"gpu": "A100"}], "rr"
    )
    ctx = _ctx(cluster)
    rr = RoundRobinDispatcher(ctx)
    # The cursor moves past the skipped instance: BIG never lands on 1, SMALL may.
    assert _Driver(ctx).dispatch(rr, [SMALL, BIG, SMALL, BIG, BIG, SMALL, SMALL]) == [
        0,
        2,
        0,
        2,
        0,
        1,
        2,
    ]


# --------------------------------------------------------------------------- pow2


def _pow2_frequencies(in_flight: Sequence[int], draws: int = 6000) -> dict[int, float]:
    cluster = parse_cluster(",".join(["A100"] * len(in_flight)))
    ctx = _ctx(cluster, seed=3)
    driver = _Driver(ctx)
    for i, n in enumerate(in_flight):
        for _ in range(n):
            driver.place(i, SMALL)
    pow2 = PowerOfTwoDispatcher(ctx)
    counts = collections.Counter(pow2.select(driver.ticket(SMALL), 0.0) for _ in range(draws))
    return {i: counts[i] / draws for i in range(len(in_flight))}


def test_pow2_keeps_the_less_loaded_of_two_sampled_instances() -> None:
    # in flight [5, 0, 3, 1]: of the 6 equally likely pairs instance 1 wins the 3 it is in,
    # instance 3 wins {0,3} and {2,3}, instance 2 wins {0,2}, instance 0 never wins.
    freq = _pow2_frequencies([5, 0, 3, 1])
    assert freq[0] == 0.0
    assert freq[1] == pytest.approx(3 / 6, abs=0.03)
    assert freq[3] == pytest.approx(2 / 6, abs=0.03)
    assert freq[2] == pytest.approx(1 / 6, abs=0.03)


def test_pow2_breaks_ties_on_the_lower_index() -> None:
    # Equal loads: a pair's winner is its lower index; the last instance never wins.
    freq = _pow2_frequencies([2, 2, 2, 2])
    assert freq[3] == 0.0
    assert freq[0] == pytest.approx(3 / 6, abs=0.03)
    assert freq[1] == pytest.approx(2 / 6, abs=0.03)
    assert freq[2] == pytest.approx(1 / 6, abs=0.03)


def test_pow2_is_reproducible_for_a_seed_and_varies_across_seeds() -> None:
    def choices(seed: int) -> list[int]:
        ctx = _ctx(parse_cluster("A100x4"), seed)
        return _Driver(ctx).dispatch(PowerOfTwoDispatcher(ctx), [SMALL] * 40)

    assert choices(1) == choices(1)
    assert choices(1) != choices(2)


# --------------------------------------------------------------------------- least-requests

SMALL_KV_CLUSTER = Cluster.build(
    [{"gpu": "A100"}, {"gpu": "A100", "kv_cache_tokens": 5000}, {"gpu": "A6000"}, {"gpu": "L40S"}],
    "lr",
)
"""Instance 1 (5,000 KV slots) holds SMALL (313 tokens), not REVISE (6,042) or BIG."""


@pytest.mark.parametrize(
    ("in_flight", "call", "expected"),
    [
        ([0, 0, 0, 0], SMALL, 0),  # all idle: the lower index
        ([2, 1, 3, 1], SMALL, 1),  # 1 and 3 tie on one call: the lower index
        ([2, 3, 0, 1], SMALL, 2),  # the slow A6000, idle: speed is not read
        ([1, 0, 2, 2], BIG, 0),  # 1 is emptiest but cannot hold BIG
        ([3, 0, 2, 2], BIG, 2),  # and the tie among the rest goes to the lower index
        ([1, 0, 2, 1], REVISE, 0),  # nor REVISE
    ],
)
def test_least_requests_picks_the_fewest_calls_in_flight(
    in_flight: Sequence[int], call: LLMCall, expected: int
) -> None:
    ctx = _ctx(SMALL_KV_CLUSTER)
    driver = _Driver(ctx)
    for i, n in enumerate(in_flight):
        for _ in range(n):
            driver.place(i, SMALL)
    assert list(ctx.load.in_flight) == list(in_flight)
    assert LeastRequestsDispatcher(ctx).select(driver.ticket(call), 0.0) == expected


@pytest.mark.parametrize(
    ("placed", "expected"),
    [
        ([[BIG], [SMALL, SMALL], [], []], 2),  # one big call still counts as one request
        ([[BIG], [SMALL], [SMALL], [SMALL]], 0),  # all tie at one: the lower index
        ([[SMALL, SMALL], [BIG, BIG, BIG], [REVISE], [REVISE, SMALL]], 2),
    ],
)
def test_least_requests_counts_calls_not_work(
    placed: Sequence[Sequence[LLMCall]], expected: int
) -> None:
    ctx = _ctx(parse_cluster("A100x4"))
    driver = _Driver(ctx)
    for i, calls in enumerate(placed):
        for call in calls:
            driver.place(i, call)
    assert LeastRequestsDispatcher(ctx).select(driver.ticket(SMALL), 0.0) == expected


def test_least_requests_forgets_finished_calls_and_spreads_a_burst() -> None:
    ctx = _ctx(parse_cluster("A100,A6000,L40S"))
    driver = _Driver(ctx)
    lr = LeastRequestsDispatcher(ctx)
    # Nothing completes: a burst fills the instances level, in index order.
    assert driver.dispatch(lr, [SMALL] * 7) == [0, 1, 2, 0, 1, 2, 0]
    done = driver.place(1, SMALL)  # in flight [3, 3, 2]
    assert lr.select(driver.ticket(SMALL), 0.0) == 2
    ctx.load.on_complete(done)
    driver.place(2, SMALL)  # in flight [3, 2, 3]
    assert lr.select(driver.ticket(SMALL), 0.0) == 1
    ctx.load.set_available(1, False)  # a worker away is skipped like a full KV cache
    assert lr.select(driver.ticket(SMALL), 0.0) == 0


# --------------------------------------------------------------------------- least-work


def test_least_work_picks_the_least_outstanding_work_lowest_index_on_ties() -> None:
    ctx = _ctx(parse_cluster("A100x4"))
    driver = _Driver(ctx)
    # revise: ~3.18 s each, candidate: ~26.8 s, retriever ~0.25 s on an A100
    for i, calls in enumerate([[REVISE, REVISE], [SMALL], [BIG], [SMALL]]):
        for call in calls:
            driver.place(i, call)
    lw = LeastWorkDispatcher(ctx)
    assert lw.select(driver.ticket(SMALL), 0.0) == 1  # 1 and 3 tie: lower index
    driver.place(1, SMALL)
    assert lw.select(driver.ticket(SMALL), 0.0) == 3


def test_least_work_ignores_work_freed_and_skips_instances_too_small() -> None:
    cluster = Cluster.build(
        [{"gpu": "A100"}, {"gpu": "A100", "kv_cache_tokens": 5000}, {"gpu": "A100"}], "lw"
    )
    ctx = _ctx(cluster)
    driver = _Driver(ctx)
    done = driver.place(0, BIG)
    driver.place(2, REVISE)
    lw = LeastWorkDispatcher(ctx)
    assert lw.select(driver.ticket(SMALL), 0.0) == 1  # idle
    assert lw.select(driver.ticket(BIG), 0.0) == 2  # 1 is idle but cannot hold it
    ctx.load.on_complete(done)
    assert lw.select(driver.ticket(BIG), 0.0) == 0  # the finished call no longer counts


# --------------------------------------------------------------------------- workload-balanced


def _wb_reference(
    gpus: Sequence[str],
    steps: Sequence[str],
    alpha: float,
    weights: Mapping[str, float] | None = None,
    reference: str = "baseline",
) -> list[int]:
    """docs/algorithm.md §3.1 computed from scratch: cumulative W_i, b = instance 0."""
    weights = weights or {}
    work = [0.0] * len(gpus)
    out = []
    for step in steps:
        t = [_step_time(g, step) for g in gpus]
        ref = work[0] if reference == "baseline" else sum(work) / len(work)
        if reference == "baseline" and work[0] == 0.0:
            choice = 0
        else:
            scores = [
                alpha * t[0] / t[i]
                - ((1 - alpha) * weights.get(gpus[i], 1.0) * work[i] / ref if ref > 0 else 0.0)
                for i in range(len(gpus))
            ]
            best = max(scores)
            choice = scores.index(best)  # first maximum: ties go to the lowest index
        work[choice] += t[choice]
        out.append(choice)
    return out


MIXED_STEPS = [
    "information_retriever",
    "extract_keywords",
    "information_retriever",
    "generate_candidate",
    "generate_candidate",
    "revise",
    "revise",
    "unit_tester",
    "generate_unit_test",
    "unit_tester",
    "evaluate",
    "evaluate",
    "evaluate",
    "unit_tester",
] * 3


def _calls(steps: Sequence[str]) -> list[LLMCall]:
    return [LLMCall(s, *REPRESENTATIVE_TOKENS[s]) for s in steps]


def _wb(gpus: Sequence[str], **params: Any) -> tuple[WorkloadBalancedDispatcher, _Driver]:
    ctx = _ctx(parse_cluster(",".join(gpus)))
    return WorkloadBalancedDispatcher(ctx, **params), _Driver(ctx)


def test_wb_idle_baseline_takes_the_call_whatever_alpha() -> None:
    for alpha in (0.0, 0.5, 1.0):
        # The baseline (first) instance is the slowest here: only W_b == 0 sends it there.
        wb, driver = _wb(["A6000", "A100", "L40S"], alpha=alpha)
        assert driver.dispatch(wb, [BIG]) == [0]


def test_wb_alpha_one_sends_every_call_to_its_fastest_gpu_type() -> None:
    gpus = ["A6000", "L40S", "A100", "A100"]
    wb, driver = _wb(gpus, alpha=1.0)
    choices = driver.dispatch(wb, _calls(MIXED_STEPS))
    assert choices[0] == 0  # idle baseline
    for step, choice in zip(MIXED_STEPS[1:], choices[1:], strict=True):
        times = [_step_time(g, step) for g in gpus]
        assert choice == times.index(min(times)), step  # fastest, lowest index of the A100s
    assert set(choices[1:]) == {2}


def test_wb_a_new_alpha_starts_a_new_cumulative_balance() -> None:
    gpus = ["A100", "A6000", "L40S"]
    calls = _calls(MIXED_STEPS)
    wb, driver = _wb(gpus, alpha=0.2)
    driver.dispatch(wb, calls)
    kept = wb._work[:]
    wb.alpha = 0.2  # the same α: the ledger stays
    assert wb._work == kept and sum(kept) > 0
    wb.alpha = 0.7  # a new α: from here on it dispatches as a fresh dispatcher at 0.7 does
    fresh, fresh_driver = _wb(gpus, alpha=0.7)
    assert driver.dispatch(wb, calls) == fresh_driver.dispatch(fresh, calls)


def test_wb_alpha_zero_balances_cumulative_work_by_hand() -> None:
    t_a = _step_time("A100", "revise")
    t_6 = _step_time("A6000", "revise")
    assert 1 < t_6 / t_a < 2  # the hand computation below relies on it
    wb, driver = _wb(["A100", "A6000"], alpha=0.0)
    choices = driver.dispatch(wb, [REVISE] * 4)
    # 1: W_b = 0 -> b.                              W = [tA, 0]
    # 2: scores -tA/tA = -1 vs -0/tA = 0 -> 1.       W = [tA, t6]
    # 3: -1 vs -t6/tA < -1 -> 0.                     W = [2tA, t6]
    # 4: -1 vs -t6/(2tA) > -1 -> 1.                  W = [2tA, 2t6]
    assert choices == [0, 1, 0, 1]
    assert choices + driver.dispatch(wb, [REVISE] * 26) == _wb_reference(
        ["A100", "A6000"], ["revise"] * 30, 0.0
    )


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.7])
def test_wb_follows_the_paper_formula_over_a_mixed_sequence(alpha: float) -> None:
    gpus = ["A100", "A100", "A6000", "L40S"]
    wb, driver = _wb(gpus, alpha=alpha)
    choices = driver.dispatch(wb, _calls(MIXED_STEPS))
    assert choices == _wb_reference(gpus, MIXED_STEPS, alpha)
    assert len(set(choices)) > 1


def test_wb_alpha_zero_keeps_cumulative_work_balanced() -> None:
    gpus = ["A100", "A6000", "L40S"]
    wb, driver = _wb(gpus, alpha=0.0)
    steps = ["revise", "evaluate", "extract_keywords"] * 30
    choices = driver.dispatch(wb, _calls(steps))
    work = [0.0] * 3
    for step, i in zip(steps, choices, strict=True):
        work[i] += _step_time(gpus[i], step)
    # Each call goes to the least-loaded instance, so no W_i can exceed another by more
    # than one call's time.
    largest_call = max(_step_time(g, s) for g in gpus for s in set(steps))
    assert max(work) - min(work) <= largest_call


def test_wb_load_weights_make_a_gpu_type_take_more_work() -> None:
    t_a = _step_time("A100", "revise")
    t_6 = _step_time("A6000", "revise")
    plain, d1 = _wb(["A100", "A6000"], alpha=0.0)
    weighted, d2 = _wb(["A100", "A6000"], alpha=0.0, load_weights={"A6000": 0.5})
    # Third call, W = [tA, t6]: plain -1 vs -t6/tA (-> 0); weighted -1 vs -0.5 t6/tA (-> 1).
    assert 0.5 * t_6 / t_a < 1 < t_6 / t_a
    assert d1.dispatch(plain, [REVISE] * 3) == [0, 1, 0]
    assert d2.dispatch(weighted, [REVISE] * 3) == [0, 1, 1]
    gpus = ["A100", "A100", "A6000", "L40S"]
    weights = {"A6000": 0.5, "L40S": 0.5}
    wb, driver = _wb(gpus, alpha=0.2, load_weights=weights)
    assert driver.dispatch(wb, _calls(MIXED_STEPS)) == _wb_reference(
        gpus, MIXED_STEPS, 0.2, weights
    )


def test_wb_outstanding_work_is_freed_on_completion() -> None:
    calls = [REVISE, REVISE]
    cumulative, d1 = _wb(["A100", "A6000"], alpha=0.5)
    outstanding, d2 = _wb(["A100", "A6000"], alpha=0.5, work="outstanding")
    for wb, driver in ((cumulative, d1), (outstanding, d2)):
        first = driver.ticket(REVISE)
        assert wb.select(first, 0.0) == 0  # idle baseline
        driver.commit(first, 0)
        driver.ctx.load.on_complete(first)
    # Cumulative: W = [tA, 0], score_0 = 0.5 - 0.5 = 0 < score_1 = 0.5 tA/t6 -> 1.
    assert d1.dispatch(cumulative, calls[:1]) == [1]
    # Outstanding: the baseline is idle again (W_b = 0) -> b.
    assert d2.dispatch(outstanding, calls[:1]) == [0]


def test_wb_outstanding_scores_use_the_in_flight_estimates() -> None:
    ctx = _ctx(parse_cluster("A100,A6000"))
    driver = _Driver(ctx)
    wb = WorkloadBalancedDispatcher(ctx, alpha=0.5, work="outstanding")
    driver.place(0, BIG)
    driver.place(1, REVISE)
    w = ctx.load.outstanding_s
    t = [_step_time(g, "revise") for g in ("A100", "A6000")]
    scores = [0.5 * t[0] / t[i] - 0.5 * w[i] / w[0] for i in range(2)]
    assert scores[1] > scores[0]  # the A100 is busy with a candidate
    assert wb.select(driver.ticket(REVISE), 0.0) == 1
    driver.place(1, BIG)
    driver.place(1, BIG)
    scores = [0.5 * t[0] / t[i] - 0.5 * w[i] / w[0] for i in range(2)]
    assert scores[0] > scores[1]
    assert wb.select(driver.ticket(REVISE), 0.0) == 0


def test_wb_mean_reference_lets_speed_decide_on_an_idle_cluster() -> None:
    gpus = ["A6000", "A100"]
    baseline, d1 = _wb(gpus, alpha=0.5)
    mean, d2 = _wb(gpus, alpha=0.5, reference="mean")
    assert d1.dispatch(baseline, [REVISE]) == [0]
    assert d2.dispatch(mean, [REVISE]) == [1]
    gpus4 = ["A100", "A100", "A6000", "L40S"]
    wb, driver = _wb(gpus4, alpha=0.4, reference="mean")
    assert driver.dispatch(wb, _calls(MIXED_STEPS)) == _wb_reference(
        gpus4, MIXED_STEPS, 0.4, reference="mean"
    )


@pytest.mark.parametrize("alpha", [-0.1, 1.01, math.nan])
def test_wb_rejects_alpha_outside_unit_interval(alpha: float) -> None:
    ctx = _ctx(parse_cluster("A100"))
    with pytest.raises(ConfigError, match="alpha"):
        WorkloadBalancedDispatcher(ctx, alpha=alpha)
    with pytest.raises(ConfigError, match="alpha"):
        DISPATCHERS.create("workload-balanced", ctx, params={"alpha": alpha})
    with pytest.raises(ConfigError, match="alpha"):
        MarginalLatencyDispatcher(ctx, alpha=alpha)


@pytest.mark.parametrize(
    "params", [{"work": "peak"}, {"reference": "median"}, {"estimate": "guess"}]
)
def test_wb_rejects_unknown_modes(params: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=next(iter(params))):
        WorkloadBalancedDispatcher(_ctx(parse_cluster("A100")), **params)


# --------------------------------------------------------------------------- marginal-latency


def _own_and_delay(
    cluster: Cluster, load: ClusterLoad, call: LLMCall, share: float = 0.5
) -> list[tuple[float, float]]:
    """(own_i, delay_i) from the formula in MarginalLatencyDispatcher's docstring."""
    out = []
    for inst in cluster.instances:
        lat = latency_model(MODEL, inst.gpu)
        prefill, decode = lat.split(call.input_tokens, call.output_tokens)
        b = load.in_flight[inst.index]
        own = prefill + decode * lat.slowdown(b + 1)
        delay = (lat.slowdown(b + 1) - lat.slowdown(b)) * share * load.outstanding_s[
            inst.index
        ] + prefill * b
        out.append((own, delay))
    return out


def test_marginal_alpha_one_picks_the_lowest_own_latency() -> None:
    cluster = parse_cluster("A100,A6000,L40S")
    ctx = _ctx(cluster)
    driver = _Driver(ctx)
    ml = MarginalLatencyDispatcher(ctx, alpha=1.0)
    assert ml.select(driver.ticket(REVISE), 0.0) == 0  # idle: the A100 is fastest
    for _ in range(64):
        driver.place(0, REVISE)  # a big batch slows the A100's decode
    own = [o for o, _ in _own_and_delay(cluster, ctx.load, REVISE)]
    expected = own.index(min(own))
    assert expected != 0
    assert ml.select(driver.ticket(REVISE), 0.0) == expected


def test_marginal_alpha_zero_prefers_an_idle_slow_instance() -> None:
    ctx = _ctx(parse_cluster("A100,A6000"))
    driver = _Driver(ctx)
    driver.place(0, REVISE)
    ml = MarginalLatencyDispatcher(ctx, alpha=0.0)
    assert ml.select(driver.ticket(REVISE), 0.0) == 1
    assert MarginalLatencyDispatcher(ctx, alpha=1.0).select(driver.ticket(REVISE), 0.0) == 0


def test_marginal_score_matches_the_docstring_formula_at_the_crossover() -> None:
    """score_i = α own_i + (1 − α) delay_i is linear in α: with a loaded fast A100 and an
    idle A6000 (delay 0) the choice flips exactly at α* = delay_0 / (delay_0 + own_1 − own_0).
    Checking both sides of the hand-computed α* pins both scores."""
    cluster = parse_cluster("A100,A6000")
    ctx = _ctx(cluster)
    driver = _Driver(ctx)
    for call in [REVISE] * 6 + [BIG] * 4:
        driver.place(0, call)
    (own0, delay0), (own1, delay1) = _own_and_delay(cluster, ctx.load, REVISE)
    assert delay1 == 0.0 and delay0 > 0.0 and own1 > own0
    a_star = delay0 / (delay0 + own1 - own0)
    assert 0.05 < a_star < 0.95
    below = MarginalLatencyDispatcher(ctx, alpha=a_star - 1e-6)
    above = MarginalLatencyDispatcher(ctx, alpha=a_star + 1e-6)
    assert below.select(driver.ticket(REVISE), 0.0) == 1
    assert above.select(driver.ticket(REVISE), 0.0) == 0
    # The share of outstanding work moves the crossover as the formula says.
    share = 0.9
    (own0, delay0), (own1, _) = _own_and_delay(cluster, ctx.load, REVISE, share)
    a_star = delay0 / (delay0 + own1 - own0)
    below = MarginalLatencyDispatcher(ctx, alpha=a_star - 1e-6, share=share)
    above = MarginalLatencyDispatcher(ctx, alpha=a_star + 1e-6, share=share)
    assert below.select(driver.ticket(REVISE), 0.0) == 1
    assert above.select(driver.ticket(REVISE), 0.0) == 0


def test_marginal_ties_go_to_the_lower_index() -> None:
    ctx = _ctx(parse_cluster("A100x3"))
    driver = _Driver(ctx)
    driver.place(0, BIG)
    ml = MarginalLatencyDispatcher(ctx, alpha=0.5)
    assert ml.select(driver.ticket(REVISE), 0.0) == 1  # 1 and 2 are identical and idle


def test_marginal_equal_scores_go_to_the_fewest_calls_in_flight() -> None:
    # On aiconfigurator's H100 the slowdown is flat from 2 to 4 sequences (its database's
    # batch-4 step is faster than its batch-2 step; `monotone_slowdown` pools them), so
    # joining 1, 2 or 3 calls costs the same own latency: the fewest in flight wins, as
    # least-requests would choose, not the lowest index.
    cluster = _parse_cluster("H100,H100,H100", calibration="aiconfigurator")
    table = cluster.instances[0].latency.slowdown_table(8)
    assert table[2] == table[3] == table[4]
    ctx = _ctx(cluster)
    driver = _Driver(ctx)
    for instance, calls in ((0, 3), (1, 2), (2, 1)):
        for _ in range(calls):
            driver.place(instance, REVISE)
    assert MarginalLatencyDispatcher(ctx, alpha=1.0).select(driver.ticket(REVISE), 0.0) == 2


def test_marginal_never_prefers_a_bigger_batch_on_own_latency() -> None:
    # Before the slowdown was made monotone, aiconfigurator's H100 told the dispatcher that
    # a call decodes faster beside 3 others than beside 1.
    cluster = _parse_cluster("H100,H100", calibration="aiconfigurator")
    ctx = _ctx(cluster)
    driver = _Driver(ctx)
    for _ in range(3):
        driver.place(0, REVISE)
    driver.place(1, REVISE)
    assert MarginalLatencyDispatcher(ctx, alpha=1.0).select(driver.ticket(REVISE), 0.0) == 1


def test_marginal_rejects_share_outside_unit_interval() -> None:
    with pytest.raises(ConfigError, match="share"):
        MarginalLatencyDispatcher(_ctx(parse_cluster("A100")), share=1.5)
