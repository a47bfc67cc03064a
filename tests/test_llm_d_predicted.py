"""llm-d's predicted-latency router (`predicted-latency`, preset `llm-d-predicted`): it
explores until it has observed calls, learns TTFT = a p + b T and TPOT = c + d T from the
end-to-end latencies it observes, and routes to the lowest prediction; checked on latencies
made up by hand so that the fitted coefficients are known."""

from __future__ import annotations

import pytest

from dispatch_driver import Driver, context
from hexgen_flow.cluster import parse_cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.policies.predicted_latency import PredictedLatencyDispatcher, WindowedFit
from hexgen_flow.policies.presets import resolve_policy
from hexgen_flow.runtime import PolicyContext
from hexgen_flow.workload import LLMCall

REVISE = LLMCall("revise", 5963, 79)
SHORT = LLMCall("evaluate", 1000, 100)  # p = 1 (thousand), o = 1 (hundred)


def _teach(
    router: PredictedLatencyDispatcher,
    ctx: PolicyContext,
    driver: Driver,
    instance: int,
    seconds_per_call: float,
    n: int,
) -> None:
    """`n` SHORT calls placed on `instance` (by hand, as an adopted call: `select` records
    what it saw, so it is asked first) that each took `seconds_per_call` on an idle
    instance: p = o = 1 and T = 0, so the fit is a + c = seconds_per_call."""
    for _ in range(n):
        t = driver.ticket(SHORT)
        router.select(t, 0.0)
        router._remember(t, instance, None, 0.0)  # where it went, whatever was picked
        driver.commit(t, instance)
        ctx.load.on_complete(t)
        router.on_complete(t, seconds_per_call)


def test_cold_it_explores_fewest_calls_in_flight_lowest_index_on_ties() -> None:
    ctx = context(parse_cluster("A100x3"))
    driver = Driver(ctx)
    router = PredictedLatencyDispatcher(ctx)
    assert router.select(driver.ticket(REVISE), 0.0) == 0
    driver.place(0, REVISE)
    driver.place(1, REVISE)
    assert router.select(driver.ticket(REVISE), 0.0) == 2  # nothing learnt: explore


def test_it_learns_which_instance_is_slow_from_what_it_observed() -> None:
    """Instance 0 served 10 idle SHORT calls in 4 s each, instance 1 in 1 s, instance 2
    none: 0 and 1 fit a + c = 4 and 1; 2 is believed the pool, between them (the ridge
    pulls each towards it). The fastest, 1, wins; the estimator is never asked."""
    ctx = context(parse_cluster("A100x3"))
    driver = Driver(ctx)
    router = PredictedLatencyDispatcher(ctx, warmup=10)
    _teach(router, ctx, driver, 0, 4.0, 10)
    _teach(router, ctx, driver, 1, 1.0, 10)
    assert router.select(driver.ticket(SHORT), 0.0) == 1
    th0, th1, pool = router.models[0].theta, router.models[1].theta, router.pooled.theta
    assert th0[0] + th0[2] == pytest.approx(4.0, rel=0.1)
    assert th1[0] + th1[2] == pytest.approx(1.0, rel=0.1)
    assert th1[0] + th1[2] < pool[0] + pool[2] < th0[0] + th0[2]


def test_an_instance_warming_up_is_predicted_by_the_pool() -> None:
    """After 10 calls on instance 0 only, 0 has its own fit and 1 and 2, still warming up,
    are predicted by the pool (fitted on 0's calls: the same figures here)."""
    ctx = context(parse_cluster("A100x3"))
    driver = Driver(ctx)
    router = PredictedLatencyDispatcher(ctx, warmup=10)
    _teach(router, ctx, driver, 0, 2.0, 10)
    assert (router.models[0].count, router.models[1].count, router.pooled.count) == (10, 0, 10)
    assert router._theta(0) is router.models[0].theta
    assert router._theta(1) is router._theta(2) is router.pooled.theta
    own, pool = router.models[0].theta, router.pooled.theta
    assert own[0] + own[2] == pytest.approx(pool[0] + pool[2]) == pytest.approx(2.0)


def test_the_load_term_is_learnt_from_tokens_in_flight() -> None:
    """Calls sent to a loaded instance took longer: with T = 1 (10k tokens in flight) a
    SHORT call took 6 s instead of 1 s, so b + d = 5 per 10k tokens: an idle instance of
    the same fit is then preferred to the loaded one."""
    ctx = context(parse_cluster("A100,A100"))
    driver = Driver(ctx)
    router = PredictedLatencyDispatcher(ctx, warmup=5, ridge=1e-6)
    _teach(router, ctx, driver, 0, 1.0, 5)
    load = [driver.place(0, LLMCall("revise", 9000, 1000))]  # T = 1 on instance 0
    for _ in range(5):
        t = driver.ticket(SHORT)
        router.select(t, 0.0)
        router._remember(t, 0, None, 0.0)
        driver.commit(t, 0)
        ctx.load.on_complete(t)
        router.on_complete(t, 6.0)
    th = router.models[0].theta
    assert th[1] + th[3] == pytest.approx(5.0, rel=0.05)
    assert router.select(driver.ticket(SHORT), 0.0) == 1  # 0 holds 10k tokens
    ctx.load.on_complete(load[0])
    assert router.select(driver.ticket(SHORT), 0.0) == 0  # both idle: lower index


def test_a_call_moved_since_dispatch_is_not_learnt() -> None:
    ctx = context(parse_cluster("A100,A100"))
    driver = Driver(ctx)
    router = PredictedLatencyDispatcher(ctx)
    t = driver.ticket(SHORT)
    assert router.select(t, 0.0) == 0
    driver.commit(t, 1)  # adopted elsewhere (`GlobalScheduler.move`)
    router.on_complete(t, 3.0)
    assert router.pooled.count == router.models[0].count == router.models[1].count == 0


def test_slos_prefer_an_instance_with_headroom() -> None:
    """Instance 0: TTFT 0.5 s, TPOT 3 s per hundred tokens (latency 3.5 s for SHORT);
    instance 1: TTFT 2 s, TPOT 1 s (latency 3 s). Without SLOs 1 wins (lower latency); with
    a TTFT SLO of 1 s only 0 has headroom, so 0 wins."""
    ctx = context(parse_cluster("A100,A100"))
    driver = Driver(ctx)
    for slo, expected in ((0.0, 1), (1.0, 0)):
        router = PredictedLatencyDispatcher(ctx, ttft_slo_s=slo)
        router.pooled.count = router.models[0].count = router.models[1].count = 99
        router.models[0].theta = [0.5, 0.0, 3.0, 0.0]
        router.models[1].theta = [2.0, 0.0, 1.0, 0.0]
        assert router.select(driver.ticket(SHORT), 0.0) == expected


def test_the_windowed_fit_solves_least_squares() -> None:
    """y = 2 p + 3 o exactly on four independent points: the fit recovers it."""
    fit = WindowedFit(window=10, every=4)
    points = [(1.0, 0.0, 0.0, 0.0), (0.0, 1.0, 0.0, 0.0), (0.0, 0.0, 1.0, 0.0), (1, 1, 1, 1)]
    for x in points:
        y = 2.0 * x[0] + 3.0 * x[2]
        fit.observe(tuple(float(v) for v in x), y, [0.0] * 4, 1e-9)
    assert fit.theta == pytest.approx([2.0, 0.0, 3.0, 0.0], abs=1e-6)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"ttft_slo_s": -1.0}, "ttft_slo_s"),
        ({"tpot_slo_s": -1.0}, "tpot_slo_s"),
        ({"warmup": 0}, "warmup"),
        ({"window": 0}, "window"),
        ({"ridge": 0.0}, "ridge"),
        ({"prefix_share": 1.5}, "prefix_share"),
    ],
)
def test_bad_parameters_are_refused(params: dict[str, float], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        PredictedLatencyDispatcher(context(parse_cluster("A100")), **params)  # type: ignore[arg-type]


def test_the_preset_is_registered_with_fcfs() -> None:
    preset = resolve_policy("llm-d-predicted")
    assert (preset.dispatch.name, preset.queue.name) == ("predicted-latency", "fcfs")
