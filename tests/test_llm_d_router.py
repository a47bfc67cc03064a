"""llm-d's default profile (`prefix-queue`, preset `llm-d`): queue scorer x 2 + prefix-cache
scorer x 3, the highest total wins; checked against those scores by hand."""

from __future__ import annotations

import pytest

from dispatch_driver import Driver, context
from hexgen_flow.cluster import parse_cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.policies.prefix_routers import PrefixQueueDispatcher
from hexgen_flow.policies.presets import resolve_policy
from hexgen_flow.prefix import DEFAULT_PREFIX_SHARE
from hexgen_flow.workload import LLMCall

REVISE = LLMCall("revise", 5963, 79)


def test_without_a_home_it_is_least_requests_lowest_index_on_ties() -> None:
    ctx = context(parse_cluster("A100x3"))
    driver = Driver(ctx)
    router = PrefixQueueDispatcher(ctx)
    assert router.select(driver.ticket(REVISE), 0.0) == 0  # all equal: every queue score 1
    driver.place(0, REVISE)
    driver.place(1, REVISE)
    assert router.select(driver.ticket(REVISE), 0.0) == 2


def test_a_cache_hit_outweighs_an_uneven_queue_up_to_the_weights() -> None:
    """Home on 0 with k calls there, none elsewhere: queue scores 0 and 1, so home scores
    3 x 0.75 = 2.25 against 2 x 1 = 2 and wins whatever k; with weights 2 and 2, home's
    1.5 loses."""
    ctx = context(parse_cluster("A100,A100"))
    driver = Driver(ctx)
    driver.place(0, REVISE, query="q")
    for _ in range(9):
        driver.place(0, REVISE)
    assert PrefixQueueDispatcher(ctx).select(driver.ticket(REVISE, query="q"), 0.0) == 0
    even = PrefixQueueDispatcher(ctx, prefix_weight=2.0)
    assert even.select(driver.ticket(REVISE, query="q"), 0.0) == 1
    assert 3.0 * DEFAULT_PREFIX_SHARE > 2.0 > 2.0 * DEFAULT_PREFIX_SHARE  # why both hold


def test_the_queue_score_is_relative_to_the_spread() -> None:
    """Three instances with 0, 2 and 4 calls, home on the middle one: queue scores 1, 0.5
    and 0, so home scores 2 x 0.5 + 3 x 0.75 = 3.25 against the idle one's 2."""
    ctx = context(parse_cluster("A100x3"))
    driver = Driver(ctx)
    driver.place(1, REVISE, query="q")
    driver.place(1, REVISE)
    for _ in range(4):
        driver.place(2, REVISE)
    assert PrefixQueueDispatcher(ctx).select(driver.ticket(REVISE, query="q"), 0.0) == 1
    no_cache = PrefixQueueDispatcher(ctx, prefix_share=0.0)
    assert no_cache.select(driver.ticket(REVISE, query="q"), 0.0) == 0


def test_the_preset_is_registered_with_fcfs() -> None:
    preset = resolve_policy("llm-d")
    assert (preset.dispatch.name, preset.queue.name) == ("prefix-queue", "fcfs")
    assert not preset.has_alpha


@pytest.mark.parametrize(
    ("params", "field"),
    [({"queue_weight": -1.0}, "weights"), ({"prefix_share": 1.5}, "prefix_share")],
)
def test_bad_parameters_are_refused(params: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        PrefixQueueDispatcher(context(parse_cluster("A100")), **params)
