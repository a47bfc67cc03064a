"""The core of workflow sessions and re-budgeting, as the coordinator and the simulator
share it: `QueryRun.give` / `add_stage`, held calls in `GlobalScheduler.release`,
`StageBudget.revise`, `GlobalScheduler.rebudget` / `better_instance`, and the simulator's
re-budgeting of queued calls when a stage finishes."""

from __future__ import annotations

import dataclasses

import pytest

from hexgen_flow.cluster import parse_cluster
from hexgen_flow.policies.presets import resolve_policy
from hexgen_flow.scheduler import CallMoved, DeadlineChanged, GlobalScheduler
from hexgen_flow.sim.simulator import SimConfig, Simulation
from hexgen_flow.templates import TEMPLATES, template
from hexgen_flow.workload import LLMCall, Query, Stage, Workflow

KW = LLMCall("extract_keywords", 600, 40)
CAND = LLMCall("generate_candidate", 8000, 400)


def _scheduler(policy: str = "hexgen-flow", cluster: str = "A100,A6000") -> GlobalScheduler:
    return GlobalScheduler(parse_cluster(cluster), resolve_policy(policy))


def _session(scheduler: GlobalScheduler, slo_s: float = 300.0) -> Query:
    return Query("s", Workflow.chain([(KW,), (CAND, CAND)]), slo_s=slo_s)


def test_a_session_holds_its_calls_until_given_and_never_finishes_while_open() -> None:
    scheduler = _scheduler()
    run = scheduler.admit(_session(scheduler), 0, 0.0, 300.0)
    run.start_session()
    (held,) = scheduler.release(run, 0, 0.0)
    assert held.instance == -1 and not run.is_given(0, 0)  # no prompt yet: not dispatched
    given = LLMCall("extract_keywords", 900, 12)
    assert run.give(0, given) == 0
    assert run.query.workflow.stages[0].calls == (given,) and run.is_given(0, 0)
    scheduler.dispatch(held, 0.0)
    released = scheduler.complete(held, 5.0)
    assert [t.stage for t in released] == [1, 1]
    assert all(t.instance == -1 for t in released)  # the candidates are not given either
    # A third candidate joins the stage; a stage it did not expect is added, waiting for none.
    for c in range(3):
        assert run.give(1, CAND) == c
    assert len(run.query.workflow.stages[1].calls) == 3 and run.stage_calls_left[1] == 3
    extra = run.add_stage(LLMCall("summarize", 100, 10))
    assert extra == 2 and run.query.workflow.stages[2].after == () and run.given == [1, 3, 1]
    for k, n in ((1, 3), (2, 1)):
        for _ in range(n):
            run.complete_call(k, 9.0)
    assert run.finished_s is None and run.calls_left == 1  # the open session's hold
    run.end_session(9.5)
    assert run.finished_s == 9.5


def test_revise_is_the_budget_at_a_new_time_and_changes_nothing() -> None:
    scheduler = _scheduler("hexgen-flow-paper")  # the template budget: state per query
    run = scheduler.admit(_session(scheduler), 0, 0.0, 300.0)
    scheduler.release(run, 0, 0.0)
    state = list(run.budget_state)
    early, late = scheduler.budget.revise(run, 1, 10.0), scheduler.budget.revise(run, 1, 100.0)
    assert run.budget_state == state  # pure
    assert early - 10.0 > late - 100.0  # more time left, more budget
    assert scheduler.budget.revise(run, 1, 10.0) == early
    # What it revises is what a release would give (the release takes the step off).
    assert scheduler.budget.deadline(run, 1, 10.0) == pytest.approx(early)


def test_rebudget_and_better_instance() -> None:
    scheduler = _scheduler("round-robin+urgency")
    run = scheduler.admit(_session(scheduler, slo_s=40.0), 0, 0.0, 40.0)
    first = scheduler.release(run, 0, 0.0)  # A100
    waiting = scheduler.release(run, 1, 0.0)  # A6000, then A100
    assert [t.instance for t in first + waiting] == [0, 1, 0]
    assert scheduler.rebudget(waiting, 1.0) == waiting
    assert all(t.deadline_s == scheduler.budget.revise(run, 1, 1.0) for t in waiting)
    # The candidate on the A6000 takes longer there than its deadline allows; the A100 is
    # fast enough.
    on_a6000 = waiting[0]
    assert scheduler.finish_estimate(on_a6000, 1, 1.0) > on_a6000.deadline_s
    assert scheduler.better_instance(on_a6000, 1.0) == 0
    scheduler.move(on_a6000, 0)
    assert on_a6000.instance == 0 and scheduler.load.in_flight == [3, 0]
    assert scheduler.better_instance(on_a6000, 1.0) is None  # stays where it can make it
    assert scheduler.rebudget(waiting, 1.0) == []  # nothing new


def test_revise_waiting_is_the_one_decision_both_drivers_carry_out() -> None:
    """The core's frozen actions: a new deadline for every waiting call whose deadline
    changed, a move (charged to the ledger) for one that would be late where it waits; a
    driver that cannot reach an instance (`movable`) gets the new deadline only."""
    for movable, moves in ((None, True), (lambda i: i == 1, False)):
        scheduler = _scheduler("round-robin+urgency")
        run = scheduler.admit(_session(scheduler, slo_s=40.0), 0, 0.0, 40.0)
        scheduler.release(run, 0, 0.0)  # A100
        waiting = scheduler.release(run, 1, 0.0)  # A6000, then A100
        on_a6000, on_a100 = waiting
        actions = scheduler.revise_waiting(waiting, 1.0, movable=movable)
        deadline = scheduler.budget.revise(run, 1, 1.0)
        if moves:
            assert actions == (
                CallMoved(on_a6000, 1, 0, deadline),
                DeadlineChanged(on_a100, deadline),
            )
            assert on_a6000.instance == 0 and scheduler.load.in_flight == [3, 0]
        else:  # the A100 is out of reach: nothing moves
            assert actions == (
                DeadlineChanged(on_a6000, deadline),
                DeadlineChanged(on_a100, deadline),
            )
            assert on_a6000.instance == 1 and scheduler.load.in_flight == [2, 1]
        with pytest.raises(dataclasses.FrozenInstanceError):
            actions[0].deadline_s = 0.0  # type: ignore[misc]
        assert scheduler.revise_waiting(waiting, 1.0, movable=movable) == ()  # nothing new


def test_the_simulator_moves_a_queued_call_when_a_parallel_branch_finishes() -> None:
    # Two branches released together: a quick keyword stage and six large candidates, which
    # round-robin splits over the A100 and the A6000, where they queue (KV cache). When
    # the keyword stage finishes, the candidates still queued get their new deadlines, and
    # those the A6000 would finish too late move to the A100.
    cluster = parse_cluster("A100,A6000")
    preset = resolve_policy("round-robin+urgency")
    big = LLMCall("generate_candidate", 40_000, 400)
    flow = Workflow(
        (
            Stage("extract_keywords", (KW,)),
            Stage("generate_candidate", (big,) * 6),
            Stage("evaluate", (LLMCall("evaluate", 500, 10),), after=(0, 1)),
        )
    )
    queries = [Query(f"q{i}", flow, arrival_s=0.0, slo_s=120.0) for i in range(4)]
    sim = Simulation(queries, cluster, preset, SimConfig(qps=1.0, seed=1))
    assert sim.run().completed == 4
    assert sim.calls_moved >= 1
    # A chain has no call waiting when a stage finishes: nothing to re-budget.
    chain = [
        Query(f"c{i}", Workflow.chain([(KW,), (big,) * 6]), arrival_s=0.0, slo_s=120.0)
        for i in range(4)
    ]
    sim = Simulation(chain, cluster, preset, SimConfig(qps=1.0, seed=1))
    sim.run()
    assert sim.calls_moved == 0


def test_templates_are_well_formed() -> None:
    for name, stages in TEMPLATES.items():
        names = [s.name for s in stages]
        assert len(set(names)) == len(names), name
        for k, stage in enumerate(stages):
            assert set(stage.after) <= set(names[:k]), (name, stage.name)
            assert stage.calls >= 1 and stage.repeat >= 1
    with pytest.raises(KeyError, match="known: chess, single"):
        template("nope")


def test_a_workflow_without_its_skipped_calls() -> None:
    a, b, c = LLMCall("a", 10, 1), LLMCall("b", 20, 2), LLMCall("c", 30, 3)
    flow = Workflow(
        (
            Stage("a", (a,)),
            Stage("b", (b, b)),
            Stage("c", (c,), after=(1,)),
            Stage("a", (a,), after=(0, 2)),
        )
    )
    assert flow.without(()) is flow
    one_b = flow.without({(1, 0)})
    assert one_b is not None and [len(s.calls) for s in one_b.stages] == [1, 1, 1, 1]
    # Stage 1 emptied: stage 2 waited for it, so it now waits for what stage 1 waited for.
    no_b = flow.without({(1, 0), (1, 1)})
    assert no_b is not None
    assert [(s.step, s.after) for s in no_b.stages] == [("a", ()), ("c", ()), ("a", (0, 1))]
    assert flow.without({(0, 0), (1, 0), (1, 1), (2, 0), (3, 0)}) is None
