"""The scheduling protocol's events that only the coordinator produces (a worker lost or
back, a failed attempt, a cancel, a best-effort query, a restart, a session), on the real
core: the lifecycle each moves a call or a query through and the actions it returns. What
both drivers produce is compared between them in tests/test_protocol_conformance.py."""

from __future__ import annotations

import pytest

from hexgen_flow.admission import BEST_EFFORT_DELAY_S, is_best_effort
from hexgen_flow.cluster import parse_cluster
from hexgen_flow.errors import ConfigError
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
    Park,
    QueryEnded,
    Redispatch,
    Resume,
    Scheduler,
    SessionClosed,
    StageReleased,
    Start,
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


def test_a_restart_reserves_calls_for_their_workers_until_the_grace_ends() -> None:
    core = _core()
    query = _query(wide=2)
    run = core.policy.admit(query, 0, 0.0, 300.0)  # as recovery rebuilds it
    run.complete_call(0, 1.0)
    run.stage_released_s[1] = 1.0
    tickets = tuple(CallTicket(i, run, 1, CALL, 1.0, 100.0, 0.0, i) for i in range(2))
    assert core.handle(Resume(run, tickets, (0, -1))) == ()
    reserved, parked = tickets
    assert state(reserved) is CallState.RESERVED and state(parked) is CallState.PARKED
    assert core.handle(Adopt(reserved, 0, 2.0)) == ()
    assert state(reserved) is CallState.QUEUED and reserved.instance == 0
    (sent,) = core.handle(GraceOver(3.0))
    assert sent == Dispatch(parked, parked.instance) and state(parked) is CallState.QUEUED


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
