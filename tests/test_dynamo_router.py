"""NVIDIA Dynamo's KV router (`kv-overlap`, preset `dynamo`): the least new prefill plus
decode tokens, checked against that cost by hand."""

from __future__ import annotations

import pytest

from dispatch_driver import Driver, context
from hexgen_flow.cluster import parse_cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.policies.prefix_routers import KvOverlapDispatcher
from hexgen_flow.policies.presets import resolve_policy
from hexgen_flow.prefix import DEFAULT_PREFIX_SHARE
from hexgen_flow.workload import LLMCall

REVISE = LLMCall("revise", 5963, 79)
SMALL = LLMCall("information_retriever", 308, 5)


def _tokens(call: LLMCall) -> int:
    return call.input_tokens + call.output_tokens


def test_without_a_home_it_picks_the_fewest_tokens_in_flight() -> None:
    ctx = context(parse_cluster("A100x3"))
    driver = Driver(ctx)
    router = KvOverlapDispatcher(ctx)
    assert router.select(driver.ticket(REVISE), 0.0) == 0  # ties: the lower index
    driver.place(0, SMALL)
    driver.place(1, REVISE)  # more tokens than 0's, though one call each
    driver.place(2, SMALL)
    driver.place(2, SMALL)
    assert router.select(driver.ticket(REVISE), 0.0) == 0
    assert ctx.load.tokens_in_flight == [_tokens(SMALL), _tokens(REVISE), 2 * _tokens(SMALL)]


def test_a_hit_is_worth_the_prefill_tokens_it_saves() -> None:
    """Home on 0 holding `extra` more tokens than 1: home costs 0.25 p + extra + p against
    p + p elsewhere, so it wins exactly while extra < 0.75 p (p the prompt); the overlap
    weight scales the saving."""
    prompt = REVISE.input_tokens
    saving = DEFAULT_PREFIX_SHARE * prompt
    for filler, home_wins in ((SMALL, True), (REVISE, False)):
        ctx = context(parse_cluster("A100,A100"))
        driver = Driver(ctx)
        driver.place(0, REVISE, query="q")
        driver.place(1, REVISE)
        driver.place(0, filler)
        extra = _tokens(filler)
        assert (extra < saving) is home_wins
        chosen = KvOverlapDispatcher(ctx).select(driver.ticket(REVISE, query="q"), 0.0)
        assert chosen == (0 if home_wins else 1)
    # Weight 0: prefill does not count, only the tokens held.
    assert KvOverlapDispatcher(ctx, overlap_weight=0.0).select(driver.ticket(REVISE), 0.0) == 1


def test_the_preset_is_registered_with_fcfs() -> None:
    preset = resolve_policy("dynamo")
    assert (preset.dispatch.name, preset.queue.name) == ("kv-overlap", "fcfs")


@pytest.mark.parametrize(
    ("params", "field"),
    [({"overlap_weight": -0.5}, "overlap_weight"), ({"prefix_share": -0.1}, "prefix_share")],
)
def test_bad_parameters_are_refused(params: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        KvOverlapDispatcher(context(parse_cluster("A100")), **params)
