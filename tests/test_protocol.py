"""The scheduling protocol's events that only the coordinator produces (a worker lost or
back, a failed attempt, a cancel, a best-effort query, a restart, a session), on the real
core: the lifecycle each moves a call or a query through and the actions it returns. What
both drivers produce is compared between them in tests/test_protocol_conformance.py."""

from __future__ import annotations

import pytest

from hexgen_flow.admission import BEST_EFFORT_DELAY_S, is_best_effort
from hexgen_flow.cluster import parse_cluster
from hexgen_flow.errors import ConfigError
from hexgen_flow.lengths import OutputLengthPredictor
from hexgen_flow.policies.presets import resolve_policy
from hexgen_flow.protocol import (
    Admitted,
    Adopt,
    AlphaChanged,
    CallDone,
    CallFailed,
    CallGiven,
    CallStarted,
    Cancel,
    Dispatch,
    Finish,
    GraceOver,
    InstanceBack,
    InstanceLost,
    Lost,
    OthersReported,
    Park,
    QueryEnded,
    Redispatch,
    Resume,
    Resumed,
    Scheduler,
    SessionClosed,
    StageReleased,
    Start,
    StoredRun,
    StoredStage,
    Submit,
    Tick,
)
from hexgen_flow.runtime import CallState, CallTicket, QueryRun, QueryState
from hexgen_flow.scheduler import GlobalScheduler
from hexgen_flow.workload import LLMCall, Query, Workflow

CALL = LLMCall("generate_candidate", 4000, 200)
KW = LLMCall("extract_keywords", 600, 20)


def state(thing: CallTicket | QueryRun) -> CallState | QueryState:
    """Its lifecycle state now (read through a call: the core changes it under mypy's
    narrowing)."""
    return thing.state


def _core(policy: str = "round-robin+urgency", cluster: str = "A100,A6000") -> Scheduler:
    return Scheduler(GlobalScheduler(parse_cluster(cluster), resolve_policy(policy)))


def _query(qid: str = "q", wide: int = 2) -> Query:
    return Query(qid, Workflow.chain([(KW,), (CALL,) * wide]), slo_s=300.0)


def _submit(core: Scheduler, query: Query, now: float = 0.0, **kw: bool) -> QueryRun:
    actions = core.handle(Submit(query, 0, now, 300.0, **kw))
    assert isinstance(actions[0], Admitted)
    return actions[0].run


def _released(actions: tuple[object, ...]) -> list[CallTicket]:
    return [t for a in actions if isinstance(a, StageReleased) for t in a.tickets]


def test_a_call_goes_queued_running_done_and_its_query_finishes() -> None:
    core = _core()
    actions = core.handle(Submit(_query(), 0, 0.0, 300.0))
    run = actions[0].run  # type: ignore[union-attr]
    (kw,) = _released(actions)
    assert state(kw) is CallState.QUEUED and state(run) is QueryState.RUNNING
    assert core.handle(CallStarted(kw, 1.0)) == ()
    assert state(kw) is CallState.RUNNING
    actions = core.handle(CallDone(kw, 2.0))
    assert state(kw) is CallState.DONE
    candidates = _released(actions)
    assert [t.stage for t in candidates] == [1, 1]
    for t in candidates:
        core.handle(CallStarted(t, 2.5))
    assert core.handle(CallDone(candidates[0], 3.0)) == ()  # its stage is not done
    (finish,) = core.handle(CallDone(candidates[1], 4.0))
    assert finish == Finish(run, 4.0) and state(run) is QueryState.FINISHED
    assert run not in core.runs  # forgotten
    with pytest.raises(AttributeError):
        finish.now = 0.0  # type: ignore[misc]  # frozen


def test_call_done_applies_the_effect_the_driver_already_applied_not_a_new_one() -> None:
    """The coordinator evaluates a completion's effect once, hands it to Redis, and passes
    that very effect in `CallDone`: the core applies it instead of evaluating the release
    rule again (here an effect the state would not give, so re-evaluating would show)."""
    core = _core()
    actions = core.handle(Submit(_query(wide=3), 0, 0.0, 300.0))
    run = actions[0].run  # type: ignore[union-attr]
    (kw,) = _released(actions)
    effect = run.completion_effect(kw.stage)
    assert effect.finishes_stage and effect.released == (1,)
    candidates = _released(core.handle(CallDone(kw, 1.0, effect=effect)))
    assert [t.stage for t in candidates] == [1, 1, 1]
    # Evaluated now, the first candidate's effect finishes nothing; the driver's says
    # the stage and the query finish (what Redis applied), and that is what happens.
    assert run.completion_effect(1) == (False, (), False)
    given = run.completion_effect(1)._replace(finishes_stage=True, finishes_query=True)
    (finish,) = core.handle(CallDone(candidates[0], 2.0, effect=given))
    assert finish == Finish(run, 2.0) and run.stage_finished_s[1] == 2.0


def test_a_best_effort_query_is_a_state_that_waits_then_runs_last() -> None:
    core = _core()
    run = _submit(core, _query(), best_effort=True)
    assert state(run) is QueryState.WAITING and is_best_effort(run)
    assert run.deadline_s == 300.0 + BEST_EFFORT_DELAY_S  # behind every query held to its SLO
    actions = core.handle(Start(run, 5.0))
    assert state(run) is QueryState.RUNNING and [t.stage for t in _released(actions)] == [0]
    assert core.handle(Start(run, 6.0)) == ()  # started once
    assert not is_best_effort(_submit(core, _query("other")))


def test_a_lost_instance_loses_its_running_calls_and_sends_its_waiting_ones_elsewhere() -> None:
    core = _core()
    run = _submit(core, _query(wide=4))
    (kw,) = core.runs[run]
    core.handle(CallStarted(kw, 0.5))
    candidates = _released(core.handle(CallDone(kw, 1.0)))
    on_0 = [t for t in candidates if t.instance == 0]
    assert len(on_0) == 2
    core.handle(CallStarted(on_0[0], 1.5))  # running there; on_0[1] still waits
    actions = core.handle(InstanceLost(0, 2.0))
    assert actions == (Lost(on_0[0], 0), Dispatch(on_0[1], 1, 0))
    assert state(on_0[0]) is CallState.BACKOFF and on_0[0].instance == -1
    assert state(on_0[1]) is CallState.QUEUED and on_0[1].instance == 1
    # the lost call's retry goes where an instance is up; with none, it parks
    assert core.handle(Redispatch(on_0[0], 3.0, avoid=0)) == (Dispatch(on_0[0], 1, -1),)
    core.handle(InstanceLost(1, 4.0))  # every instance gone: whatever waited parks
    assert all(state(t) is CallState.PARKED for t in candidates) and core.parked == candidates
    # back: every parked call goes out, in release order
    actions = core.handle(InstanceBack(0, 5.0))
    assert [a.ticket.seq for a in actions if isinstance(a, Dispatch)] == sorted(
        t.seq for t in candidates
    )
    assert not core.parked


def test_a_worker_back_without_its_calls_gets_the_waiting_ones_again() -> None:
    core = _core()
    run = _submit(core, _query(wide=4))
    (kw,) = core.runs[run]
    core.handle(CallStarted(kw, 0.5))
    candidates = _released(core.handle(CallDone(kw, 1.0)))
    running, waiting = [t for t in candidates if t.instance == 0]
    core.handle(CallStarted(running, 1.5))
    # the worker of instance 0 restarted: it holds neither
    actions = core.handle(InstanceBack(0, 2.0, (running, waiting)))
    assert actions == (Lost(running, 0), Dispatch(waiting, 0))  # the waiting one: sent again
    assert state(running) is CallState.BACKOFF and state(waiting) is CallState.QUEUED


def test_a_failed_attempt_waits_off_the_ledger_for_its_retry() -> None:
    core = _core()
    run = _submit(core, _query())
    (kw,) = core.runs[run]
    core.handle(CallStarted(kw, 0.5))
    load = core.policy.load
    assert load.in_flight[kw.instance] == 1
    failed_on = kw.instance
    assert core.handle(CallFailed(kw, 1.0)) == ()
    assert state(kw) is CallState.BACKOFF and load.in_flight == [0, 0]
    assert core.handle(Tick(1.5)) == ()  # a call in its backoff is not parked
    (again,) = core.handle(Redispatch(kw, 2.0, avoid=failed_on))
    assert isinstance(again, Dispatch) and again.instance != failed_on


def test_a_query_ended_early_cancels_each_call_not_done() -> None:
    core = _core()
    run = _submit(core, _query(wide=3))
    (kw,) = core.runs[run]
    core.handle(CallStarted(kw, 0.5))
    candidates = _released(core.handle(CallDone(kw, 1.0)))
    expected = tuple(Cancel(t, t.instance) for t in candidates)
    assert core.handle(QueryEnded(run, 2.0)) == expected
    assert all(state(t) is CallState.DROPPED for t in candidates)
    assert state(run) is QueryState.ENDED and run not in core.runs
    assert core.policy.load.in_flight == [0, 0]
    assert core.handle(QueryEnded(run, 3.0)) == ()  # once


def test_no_instance_parks_a_release_until_one_comes() -> None:
    core = _core()
    for i in range(2):
        core.handle(InstanceLost(i, 0.0))
    run = _submit(core, _query())
    (kw,) = core.runs[run]
    assert state(kw) is CallState.PARKED and core.parked == [kw]
    assert core.handle(Tick(1.0)) == ()  # still none
    assert core.handle(InstanceBack(1, 2.0)) == (Dispatch(kw, 1),)
    assert state(kw) is CallState.QUEUED


def _stored(core: Scheduler, run: QueryRun, *, keep_deadlines: bool = True) -> StoredRun:
    """`run` as a driver's store keeps it (what the coordinator's Redis holds)."""
    tickets = core.runs[run]
    deadlines = {t.stage: t.deadline_s for t in tickets}
    stages = tuple(
        StoredStage(
            run.stage_calls_left[k],
            run.deps_left[k],
            run.stage_released_s[k],
            run.stage_finished_s[k],
            deadlines.get(k) if keep_deadlines else None,
        )
        for k in range(len(run.query.workflow.stages))
    )
    waiting = {(t.stage, t.index) for t in tickets if t.state is not CallState.DONE}
    done = frozenset(
        (k, i)
        for k, stage in enumerate(run.query.workflow.stages)
        for i in range(len(stage.calls))
        if run.stage_released_s[k] is not None and (k, i) not in waiting
    )
    placed = {
        (t.stage, t.index): (t.seq, t.instance) for t in tickets if (t.stage, t.index) in waiting
    }
    return StoredRun(
        core.declared(run),
        run.index,
        run.arrival_s,
        run.slo_s,
        run.calls_left,
        stages,
        done,
        placed,
    )


@pytest.mark.parametrize("keep_deadlines", [True, False])
def test_a_resumed_query_is_what_submit_and_its_releases_left(keep_deadlines: bool) -> None:
    """A restarted scheduler rebuilds a stored query as the first one held it: the same
    release orders, stage deadlines (kept, or replayed by the stage budget) and plan."""
    first = _core("hexgen-flow", "A100,A100,L40S")
    run = _submit(first, _query(wide=3))
    (kw,) = first.runs[run]
    first.handle(CallStarted(kw, 0.5))
    first.handle(CallDone(kw, 4.0))
    stored = _stored(first, run, keep_deadlines=keep_deadlines)
    again = _core("hexgen-flow", "A100,A100,L40S")
    (resumed,) = again.handle(Resume((stored,)))
    assert isinstance(resumed, Resumed)
    rebuilt = resumed.run
    assert rebuilt.deadline_s == run.deadline_s and rebuilt.calls_left == run.calls_left
    assert rebuilt.stage_released_s == run.stage_released_s
    fields = ("seq", "stage", "index", "released_s", "deadline_s", "remaining_after_s", "call")
    before = [tuple(getattr(t, f) for f in fields) for t in first.runs[run] if t is not kw]
    assert [tuple(getattr(t, f) for f in fields) for t in resumed.tickets] == before
    assert all(state(t) is CallState.RESERVED for t in resumed.tickets)
    assert again.runs[rebuilt] == list(resumed.tickets)
    assert again.policy.next_seq == max(t.seq for t in resumed.tickets) + 1


def test_a_restart_reserves_calls_for_their_workers_until_the_grace_ends() -> None:
    core = _core()
    query = _query(wide=2)
    stages = (StoredStage(0, 0, 0.0, 1.0), StoredStage(2, 0, 1.0, None, 100.0))
    placed = {(1, 0): (7, 0)}  # the second call was never dispatched
    stored = StoredRun(query, 0, 0.0, 300.0, 2, stages, frozenset({(0, 0)}), placed)
    (resumed,) = core.handle(Resume((stored,)))
    assert isinstance(resumed, Resumed)
    reserved, parked = resumed.tickets
    assert (reserved.seq, parked.seq) == (7, 8)  # a new release order after the kept ones
    assert reserved.deadline_s == parked.deadline_s == 100.0
    assert state(reserved) is CallState.RESERVED and state(parked) is CallState.PARKED
    assert core.parked == [parked]
    assert core.handle(Adopt(reserved, 0, 2.0)) == ()
    assert state(reserved) is CallState.QUEUED and reserved.instance == 0
    (sent,) = core.handle(GraceOver(3.0))
    assert sent == Dispatch(parked, parked.instance) and state(parked) is CallState.QUEUED


def test_a_query_taken_up_without_reserving_parks_every_call() -> None:
    core = _core()
    stages = (StoredStage(0, 0, 0.0, 1.0), StoredStage(2, 0, 1.0, None, 100.0))
    stored = StoredRun(_query(), 0, 0.0, 300.0, 2, stages, frozenset({(0, 0)}), {(1, 0): (3, 1)})
    (resumed,) = core.handle(Resume((stored,), reserve=False))
    assert isinstance(resumed, Resumed)
    assert all(state(t) is CallState.PARKED for t in resumed.tickets)
    assert core.handle(Tick(2.0)) == tuple(Dispatch(t, t.instance) for t in resumed.tickets)


def test_a_restart_plans_with_learned_lengths_and_keeps_best_effort() -> None:
    lengths = OutputLengthPredictor(within_declared=True)
    for _ in range(8):
        lengths.observe(CALL.step, 50)  # learned before the restart (kept in Redis)
    core = Scheduler(
        GlobalScheduler(parse_cluster("A100,A6000"), resolve_policy("round-robin+urgency")),
        lengths=lengths,
    )
    query = _query(wide=2)
    stages = (StoredStage(0, 0, 0.0, 1.0), StoredStage(2, 0, 1.0, None))
    stored = StoredRun(query, 0, 0.0, 300.0, 2, stages, frozenset({(0, 0)}), best_effort=True)
    (resumed,) = core.handle(Resume((stored,)))
    assert isinstance(resumed, Resumed)
    run = resumed.run
    assert [c.output_tokens for c in run.query.workflow.stages[1].calls] == [50, 50]
    assert core.declared(run) is query
    assert [t.output_tokens for t in resumed.tickets] == [CALL.output_tokens] * 2  # asked
    assert is_best_effort(run) and run.deadline_s == 300.0 + BEST_EFFORT_DELAY_S
    assert all(t.deadline_s > 300.0 for t in resumed.tickets)


def test_a_session_holds_calls_until_given_and_finishes_when_closed() -> None:
    core = _core()
    run = _submit(core, _query(wide=2), session=True)
    (held,) = core.runs[run]
    assert state(held) is CallState.HELD and held.instance == -1
    given = LLMCall("extract_keywords", 900, 12)
    index = run.give(0, given)
    (sent,) = core.handle(CallGiven(run, 0, index, given, 1.0, held))
    assert isinstance(sent, Dispatch) and state(held) is CallState.QUEUED
    core.handle(CallStarted(held, 1.5))
    candidates = _released(core.handle(CallDone(held, 2.0)))
    assert all(state(t) is CallState.HELD for t in candidates)  # no prompts yet
    # a call beyond the stage's expected ones joins it
    for t in candidates:
        t_index = run.give(1, CALL)
        core.handle(CallGiven(run, 1, t_index, CALL, 2.5, t))
    extra_index = run.give(1, CALL)
    (joined,) = core.handle(CallGiven(run, 1, extra_index, CALL, 2.6, call_id="q/1.2"))
    assert isinstance(joined, Dispatch | Park) and joined.ticket.call_id == "q/1.2"
    for t in [*candidates, joined.ticket]:
        core.handle(CallStarted(t, 3.0))
        core.handle(CallDone(t, 4.0))
    assert run.finished_s is None  # the session is open
    assert core.handle(SessionClosed(run, 5.0)) == (Finish(run, 5.0),)
    assert state(run) is QueryState.FINISHED and run not in core.runs


def test_alpha_changes_through_the_protocol_and_is_checked_once() -> None:
    core = _core("hexgen-flow")
    assert core.handle(AlphaChanged(0.3)) == () and core.policy.alpha == 0.3
    with pytest.raises(ConfigError, match="alpha"):
        core.handle(AlphaChanged(1.5))
    with pytest.raises(ConfigError, match="no alpha"):
        _core("round-robin+urgency").handle(AlphaChanged(0.3))


@pytest.mark.parametrize("busy", [0, 1])
def test_what_other_shards_report_on_an_instance_steers_dispatch_away(busy: int) -> None:
    core = _core("hexgen-flow", "A100,A100")
    assert core.handle(OthersReported(busy, 6, 120.0, 60_000, 6.0, 120.0)) == ()
    assert core.policy.load.in_flight[busy] == 6
    run = _submit(core, _query())
    (kw,) = core.runs[run]
    assert kw.instance == 1 - busy
