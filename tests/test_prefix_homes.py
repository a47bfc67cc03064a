"""Where a query's prompt prefixes live (`hexgen_flow.prefix.PrefixHomes`) and how the load
ledger keeps it: every dispatch and every move records the call's instance, per query and
step type, in a bounded index."""

from __future__ import annotations

import pytest

from dispatch_driver import Driver, context
from hexgen_flow.cluster import parse_cluster
from hexgen_flow.policies.presets import resolve_policy
from hexgen_flow.prefix import PrefixHomes
from hexgen_flow.scheduler import GlobalScheduler
from hexgen_flow.sim.simulator import SimConfig, Simulation
from hexgen_flow.workload import LLMCall, Query, Workflow

REVISE = LLMCall("revise", 5963, 79)
CANDIDATE = LLMCall("generate_candidate", 11748, 678)


def test_a_home_is_the_last_instance_a_query_step_went_to() -> None:
    homes = PrefixHomes()
    assert homes.get("q1", "revise") is None
    homes.put("q1", "revise", 2)
    homes.put("q1", "generate_candidate", 0)
    homes.put("q1", "revise", 1)
    homes.put("q2", "revise", 0)
    assert homes.get("q1", "revise") == 1
    assert homes.get("q1", "generate_candidate") == 0
    assert homes.get("q2", "revise") == 0
    assert homes.get("q3", "revise") is None
    assert len(homes) == 2
    homes.forget("q1")
    homes.forget("never-seen")
    assert homes.get("q1", "generate_candidate") is None
    assert len(homes) == 1


def test_homes_are_bounded_least_recently_used_query_first_out() -> None:
    homes = PrefixHomes(max_queries=2)
    homes.put("a", "s", 0)
    homes.put("b", "s", 1)
    homes.put("a", "t", 0)  # touched: b is now the oldest
    homes.put("c", "s", 2)
    assert len(homes) == 2
    assert homes.get("b", "s") is None
    assert (homes.get("a", "s"), homes.get("a", "t"), homes.get("c", "s")) == (0, 0, 2)
    with pytest.raises(ValueError, match="max_queries"):
        PrefixHomes(max_queries=0)


def test_the_ledger_records_homes_and_tokens_on_dispatch_and_completion() -> None:
    ctx = context(parse_cluster("A100,A100"))
    load = ctx.load
    driver = Driver(ctx)
    first = driver.place(1, REVISE, query="q")
    assert load.prefix_homes.get("q", "revise") == 1
    assert load.tokens_in_flight == [0, REVISE.input_tokens + REVISE.output_tokens]
    driver.place(0, CANDIDATE, query="q")
    assert load.prefix_homes.get("q", "generate_candidate") == 0
    assert load.prefix_homes.get("q", "revise") == 1  # another step type has its own home
    load.on_complete(first)
    assert load.tokens_in_flight == [CANDIDATE.input_tokens + CANDIDATE.output_tokens, 0]
    assert load.prefix_homes.get("q", "revise") == 1  # the cache outlives the call


def test_a_moved_call_takes_its_home_along() -> None:
    cluster = parse_cluster("A100,A100")
    scheduler = GlobalScheduler(cluster, resolve_policy("hexgen-flow"))
    driver = Driver(scheduler.ctx)
    ticket = driver.ticket(REVISE, query="q")
    scheduler.dispatch(ticket, 0.0)
    here = ticket.instance
    scheduler.move(ticket, 1 - here)
    assert scheduler.load.prefix_homes.get("q", "revise") == 1 - here
    assert scheduler.load.tokens_in_flight[here] == 0


def test_a_finished_query_leaves_no_home_behind() -> None:
    """The simulator's path: the last call's completion ends the query and forgets it."""
    cluster = parse_cluster("A100,A100")
    queries = [
        Query(f"q{i}", Workflow.chain([(REVISE,), (REVISE, REVISE), (CANDIDATE,)]))
        for i in range(3)
    ]
    sim = Simulation(queries, cluster, resolve_policy("hexgen-flow"), SimConfig(qps=1.0))
    homes = sim.scheduler.load.prefix_homes
    seen: list[int] = []
    sim.every(1.0, lambda t, s: seen.append(len(homes)))
    metrics = sim.run()
    assert len(metrics.outcomes) == 3
    assert max(seen) >= 1  # queries had homes while they ran
    assert len(homes) == 0


def test_without_prefix_caching_no_instance_is_a_home() -> None:
    """The simulator tells the ledger what its engine model does; with caching off the
    homes are still recorded but none is offered to the dispatchers."""
    queries = [Query("q", Workflow.chain([(REVISE,), (REVISE,)]))]
    cluster = parse_cluster("A100,A100")
    preset = resolve_policy("hexgen-flow")
    assert Simulation(queries, cluster, preset, SimConfig(qps=1.0)).scheduler.load.prefix_caching
    off = Simulation(queries, cluster, preset, SimConfig(qps=1.0, prefix_caching=False))
    load = off.scheduler.load
    assert not load.prefix_caching
    driver = Driver(off.scheduler.ctx)
    driver.place(1, REVISE, query="q")
    assert load.prefix_homes.get("q", "revise") == 1
    assert load.prefix_home(driver.ticket(REVISE, query="q")) is None
    load.prefix_caching = True
    assert load.prefix_home(driver.ticket(REVISE, query="q")) == 1
