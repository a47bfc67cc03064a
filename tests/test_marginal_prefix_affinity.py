"""`marginal-latency`'s prefix affinity: at the query's step home the call's prefill counts
only its uncached part, in the call's own latency and in the delay it causes, so a cache
hit is traded against speed and load in seconds (the dispatcher's docstring)."""

from __future__ import annotations

import pytest

from dispatch_driver import Driver, context
from hexgen_flow.cluster import Cluster, parse_cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.policies.dispatch import MarginalLatencyDispatcher
from hexgen_flow.prefix import DEFAULT_PREFIX_SHARE
from hexgen_flow.runtime import ClusterLoad
from hexgen_flow.workload import LLMCall

REVISE = LLMCall("revise", 5963, 79)
BIG = LLMCall("generate_candidate", 11748, 678)


def _scores(
    cluster: Cluster, load: ClusterLoad, call: LLMCall, alpha: float, home: int | None
) -> list[float]:
    """score_i by the docstring's formula, with the prefill cut to its uncached part at home."""
    out = []
    for inst in cluster.instances:
        lat = inst.latency
        prefill, decode = lat.split(call.input_tokens, call.output_tokens)
        if inst.index == home:
            prefill *= 1.0 - DEFAULT_PREFIX_SHARE
        b = load.in_flight[inst.index]
        own = prefill + decode * lat.slowdown(b + 1)
        delay = (
            (lat.slowdown(b + 1) - lat.slowdown(b)) * 0.5 * load.outstanding_s[inst.index]
            + prefill * b
            if b
            else 0.0
        )
        out.append(alpha * own + (1 - alpha) * delay)
    return out


def test_equal_instances_send_the_call_to_its_prefix_home() -> None:
    ctx = context(parse_cluster("A100,A100"))
    driver = Driver(ctx)
    driver.place(1, REVISE, query="q")
    driver.place(0, REVISE)  # the same load on both
    ml = MarginalLatencyDispatcher(ctx)
    assert ml.select(driver.ticket(REVISE, query="q"), 0.0) == 1
    assert ml.select(driver.ticket(REVISE, query="other"), 0.0) == 0  # a tie: lower index
    blind = MarginalLatencyDispatcher(ctx, prefix_share=0.0)
    assert blind.select(driver.ticket(REVISE, query="q"), 0.0) == 0


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.7, 1.0])
@pytest.mark.parametrize("loaded", [0, 3, 12])
def test_the_choice_is_the_formula_with_the_hit_discounted(alpha: float, loaded: int) -> None:
    """A100, L40S and A6000, the query's revise home on the L40S, `loaded` calls on the A100."""
    cluster = parse_cluster("A100,L40S,A6000")
    ctx = context(cluster)
    driver = Driver(ctx)
    driver.place(1, REVISE, query="q")
    for _ in range(loaded):
        driver.place(0, BIG)
    scores = _scores(cluster, ctx.load, REVISE, alpha, home=1)
    expected = scores.index(min(scores))
    ml = MarginalLatencyDispatcher(ctx, alpha=alpha)
    assert ml.select(driver.ticket(REVISE, query="q"), 0.0) == expected


def test_a_hit_can_move_a_call_off_the_fastest_gpu() -> None:
    """A busy H100 and an idle A100 that holds the query's prefix: at alpha 1, for some load
    on the H100, the A100 wins with the hit and the H100 without it."""
    cluster = parse_cluster("H100,A100")
    flipped = []
    for loaded in range(0, 200, 8):
        ctx = context(cluster)
        driver = Driver(ctx)
        driver.place(1, REVISE, query="q")
        for _ in range(loaded):
            driver.place(0, REVISE)
        with_hit = MarginalLatencyDispatcher(ctx, alpha=1.0).select(
            driver.ticket(REVISE, query="q"), 0.0
        )
        without = MarginalLatencyDispatcher(ctx, alpha=1.0).select(driver.ticket(REVISE), 0.0)
        flipped.append((with_hit, without))
    assert (1, 0) in flipped  # somewhere the hit alone decides
    assert all(w >= wo for w, wo in flipped)  # and the hit never pushes it off its home


def test_prefix_share_outside_the_unit_interval_is_refused() -> None:
    with pytest.raises(ConfigError, match="prefix_share"):
        MarginalLatencyDispatcher(context(parse_cluster("A100")), prefix_share=1.2)


def test_engines_without_a_prefix_cache_give_no_affinity() -> None:
    ctx = context(parse_cluster("A100,A100"))
    driver = Driver(ctx)
    driver.place(1, REVISE, query="q")
    driver.place(0, REVISE)
    ctx.load.prefix_caching = False
    assert MarginalLatencyDispatcher(ctx).select(driver.ticket(REVISE, query="q"), 0.0) == 0
