"""Autellix (preset `autellix`): its load balancer (`autellix-lb`: long calls stay on their
program's engine, short ones go to the least loaded) and ATLAS (`atlas`: the program's least
attained service first, in levels, with starvation promotion); checked by hand."""

from __future__ import annotations

import random

import pytest

from dispatch_driver import Driver, context
from hexgen_flow.cluster import Cluster, parse_cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.estimate import Estimator
from hexgen_flow.policies.autellix import AutellixDispatcher
from hexgen_flow.policies.base import LocalQueue
from hexgen_flow.policies.presets import resolve_policy
from hexgen_flow.policies.queues import AtlasQueue
from hexgen_flow.runtime import CallTicket, ClusterLoad, PolicyContext, QueryRun
from hexgen_flow.workload import LLMCall, Query, Workflow

LONG = LLMCall("revise", 5963, 79)  # >= 2048 prompt tokens
SHORT = LLMCall("evaluate", 961, 22)
CLUSTER: Cluster = parse_cluster("A100,A100,A6000,L40S")

# --------------------------------------------------------------------------- load balancer


def test_short_calls_go_to_the_least_loaded_lowest_index_on_ties() -> None:
    ctx = context(parse_cluster("A100x3"))
    driver = Driver(ctx)
    lb = AutellixDispatcher(ctx)
    driver.place(0, SHORT)
    assert lb.select(driver.ticket(SHORT, query="p"), 0.0) == 1
    driver.place(1, SHORT)
    assert lb.select(driver.ticket(SHORT, query="p"), 0.0) == 2


def test_a_long_program_stays_on_its_engine_however_loaded() -> None:
    """Program p's first long call goes to the least loaded engine (1) and makes it p's
    engine; its later long calls follow it there even with 5 calls on it, while its short
    calls, and other programs' long ones, go to the least loaded."""
    ctx = context(parse_cluster("A100x3"))
    driver = Driver(ctx)
    lb = AutellixDispatcher(ctx)
    driver.place(0, SHORT)
    t = driver.ticket(LONG, query="p")
    assert lb.select(t, 0.0) == 1
    driver.commit(t, 1)
    for _ in range(4):
        driver.place(1, SHORT)
    assert lb.select(driver.ticket(LONG, query="p"), 0.0) == 1
    assert lb.select(driver.ticket(SHORT, query="p"), 0.0) == 2
    assert lb.select(driver.ticket(LONG, query="other"), 0.0) == 2


def test_long_tokens_sets_what_is_long_and_no_caching_means_no_locality() -> None:
    ctx = context(parse_cluster("A100,A100"))
    driver = Driver(ctx)
    lb = AutellixDispatcher(ctx, long_tokens=500)  # SHORT (961 tokens) is long now
    t = driver.ticket(SHORT, query="p")
    assert lb.select(t, 0.0) == 0
    driver.commit(t, 0)
    assert lb.select(driver.ticket(SHORT, query="p"), 0.0) == 0  # kept on its engine
    ctx.load.prefix_caching = False
    assert lb.select(driver.ticket(SHORT, query="p"), 0.0) == 1  # least loaded


def test_the_load_balancer_refuses_a_negative_threshold() -> None:
    with pytest.raises(ConfigError, match="long_tokens"):
        AutellixDispatcher(context(parse_cluster("A100")), long_tokens=-1)


# --------------------------------------------------------------------------- ATLAS


def _ctx() -> PolicyContext:
    return PolicyContext(CLUSTER, Estimator(CLUSTER), ClusterLoad(CLUSTER), random.Random(0))


def _ticket(seq: int, program: str, stage: int = 0, call: LLMCall = SHORT) -> CallTicket:
    run = QueryRun(Query(program, Workflow.chain([(call,)] * 4)), seq, 0.0, 1000.0)
    return CallTicket(seq, run, stage, call, 0.0, 100.0)


def _drain(queue: LocalQueue, now: float) -> list[int]:
    out = []
    while len(queue):
        head = queue.peek(now)
        t = queue.pop(now)
        assert t is head
        out.append(t.seq)
    return out


def _served(queue: AtlasQueue, t: CallTicket, start: float, end: float) -> None:
    """`t` ran on this queue's instance from `start` to `end` (the engine sets these)."""
    queue.push(t, start)
    assert queue.pop(start) is t
    queue.on_admit(t, start)
    t.admitted_s, t.finished_s = start, end


def test_the_least_attained_program_goes_first() -> None:
    """Program a attained 5 s (one 5 s call), b 1 s, c nothing: levels with quantum 2 s and
    growth 2 are [0, 2) -> 0, [2, 4) -> 1, [4, 8) -> 2, so c (0), b (0: 1 < 2), a (2);
    c and b tie on level and go in release order."""
    queue = AtlasQueue(_ctx(), 0)
    _served(queue, _ticket(0, "a"), 0.0, 5.0)
    _served(queue, _ticket(1, "b"), 5.0, 6.0)
    waiting = [_ticket(2, "a", 1), _ticket(3, "b", 1), _ticket(4, "c")]
    for t in waiting:
        queue.push(t, 10.0)
    assert queue.attained == {"a": 5.0, "b": 1.0}
    assert [t.key for t in waiting] == [2, 0, 0]
    assert _drain(queue, 10.0) == [3, 4, 2]


def test_attained_service_counts_the_longest_call_of_each_stage() -> None:
    """Two parallel calls of stage 0 (threads) took 3 s and 1 s: the stage adds 3 s, not
    4 s; stage 1's 2 s call adds 2: 5 s on the critical path."""
    queue = AtlasQueue(_ctx(), 0)
    _served(queue, _ticket(0, "a", 0), 0.0, 3.0)
    _served(queue, _ticket(1, "a", 0), 0.0, 1.0)
    _served(queue, _ticket(2, "a", 1), 3.0, 5.0)
    queue.push(_ticket(3, "a", 2), 6.0)
    assert queue.attained["a"] == pytest.approx(5.0)
    assert queue.level(5.0) == 2


def test_a_starving_call_is_promoted_to_the_top() -> None:
    """a attained 5 s: its call queued at 10 starves once it waited 3 x 5 = 15 s, at 25;
    b's fresh calls (attained 0, starving after 3 x 2 = 6 s of waiting) keep arriving.
    Before 25 b's calls go first; from 25 a's goes first."""
    queue = AtlasQueue(_ctx(), 0)
    _served(queue, _ticket(0, "a"), 0.0, 5.0)
    queue.push(_ticket(1, "a", 1), 10.0)
    queue.push(_ticket(2, "b"), 20.0)
    p = queue.peek(24.9)
    assert p is not None and p.seq == 2
    queue.push(_ticket(3, "b", 1), 24.9)
    assert _drain(queue, 25.0) == [1, 2, 3]


def test_levels_cap_at_the_last() -> None:
    queue = AtlasQueue(_ctx(), 0, quantum_s=1.0, growth=10.0, levels=3)
    assert [queue.level(s) for s in (0.0, 0.99, 1.0, 9.9, 10.0, 1e9)] == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"quantum_s": 0.0}, "quantum_s"),
        ({"growth": 1.0}, "growth"),
        ({"levels": 0}, "levels"),
        ({"starvation_ratio": 0.0}, "starvation_ratio"),
    ],
)
def test_bad_queue_parameters_are_refused(params: dict[str, float], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        AtlasQueue(_ctx(), 0, **params)  # type: ignore[arg-type]


def test_the_preset_is_the_load_balancer_and_atlas() -> None:
    preset = resolve_policy("autellix")
    assert (preset.dispatch.name, preset.queue.name) == ("autellix-lb", "atlas")
