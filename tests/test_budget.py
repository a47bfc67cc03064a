"""Stage budgets against docs/algorithm.md §4 computed by hand, on CHESS queries of trace1 and a
hand-built diamond DAG. The cluster-mean estimates t̄ come from the latency model directly."""

from __future__ import annotations

import random

import pytest

from hexgen_flow.errors import ConfigError
from hexgen_flow.estimate import REPRESENTATIVE_TOKENS, Estimator
from hexgen_flow.policies.budget import DagStageBudget, EndToEndBudget, TemplateStageBudget
from hexgen_flow.runtime import ClusterLoad, PolicyContext, QueryRun
from hexgen_flow.traces import load_trace
from hexgen_flow.workload import STANDARD_TEMPLATE, LLMCall, Query, Stage, Workflow
from pinned_calibration import latency_model, parse_cluster

MODEL = "llama-3.1-70b"
GPUS = ("A100", "A100", "A6000", "L40S")
CLUSTER = parse_cluster(",".join(GPUS))
TRACE1 = load_trace("trace1")
SLO = 150.0
ARRIVAL = 7.0

IR, EK, GC, REV = "information_retriever", "extract_keywords", "generate_candidate", "revise"
UT, GUT, EV = "unit_tester", "generate_unit_test", "evaluate"


def _ctx() -> PolicyContext:
    return PolicyContext(CLUSTER, Estimator(CLUSTER), ClusterLoad(CLUSTER), random.Random(0))


def _mean_single(inp: int, out: int) -> float:
    return sum(latency_model(MODEL, g).single_s(inp, out) for g in GPUS) / len(GPUS)


TBAR = {step: _mean_single(*tokens) for step, tokens in REPRESENTATIVE_TOKENS.items()}
"""t̄(s): cluster-mean latency at the step's representative tokens (docs/algorithm.md §2)."""
SLO_BASE = sum(TBAR[s] for s in STANDARD_TEMPLATE)


def _run(query: Query, index: int = 0, arrival: float = ARRIVAL, slo: float = SLO) -> QueryRun:
    return QueryRun(query, index, arrival, slo)


def _steps(query: Query) -> list[str]:
    return [s.calls[0].step for s in query.workflow.stages]


def _split(now: float, deadline: float, own: float, rest: list[str]) -> float:
    """docs/algorithm.md §4.1: a_k + (SLO_q − elapsed) · t̄(s_k) / (t̄(s_k) + Σ_{R(q)} t̄(s))."""
    return now + (deadline - now) * own / (own + sum(TBAR[s] for s in rest))


def test_slo_base_matches_the_published_value() -> None:
    slo_base = Estimator(CLUSTER).slo_base()
    assert slo_base == pytest.approx(58.9, abs=0.05)  # docs/algorithm.md §5
    assert slo_base == pytest.approx(SLO_BASE, rel=1e-12)


def test_template_budget_on_a_chess_query_by_hand() -> None:
    query = TRACE1[0]
    assert _steps(query) == [IR, EK, IR, IR, IR, GC, REV, UT, GUT, UT, EV, UT]
    assert [len(s.calls) for s in query.workflow.stages] == [1, 1, 1, 1, 1, 2, 1, 1, 1, 1, 5, 1]
    budget = TemplateStageBudget(_ctx())
    run = _run(query)
    budget.start(run)
    d = run.deadline_s
    # R(q) after each release, written out: one occurrence removed per released stage;
    # the fan-outs (2 candidates, 5 evaluations) remove one each; the first unit_tester
    # drops the revise rounds still in the template.
    remaining_after = [
        [EK, IR, IR, IR, GC, REV, REV, REV, REV, UT, GUT, UT, EV, UT],
        [IR, IR, IR, GC, REV, REV, REV, REV, UT, GUT, UT, EV, UT],
        [IR, IR, GC, REV, REV, REV, REV, UT, GUT, UT, EV, UT],
        [IR, GC, REV, REV, REV, REV, UT, GUT, UT, EV, UT],
        [GC, REV, REV, REV, REV, UT, GUT, UT, EV, UT],
        [REV, REV, REV, REV, UT, GUT, UT, EV, UT],
        [REV, REV, REV, UT, GUT, UT, EV, UT],
        [GUT, UT, EV, UT],
        [UT, EV, UT],
        [EV, UT],
        [UT],
        [],
    ]
    for k, step in enumerate(_steps(query)):
        now = ARRIVAL + 4.0 * k
        expected = _split(now, d, TBAR[step], remaining_after[k])
        assert budget.deadline(run, k, now) == pytest.approx(expected, rel=1e-12), k
    # Closed forms: the first stage, released on arrival, gets SLO · t̄(IR) / SLO_base; the
    # last stage, with nothing left after it, gets the whole remaining SLO.
    fresh = _run(query)
    budget.start(fresh)
    first = budget.deadline(fresh, 0, ARRIVAL) - ARRIVAL
    assert first == pytest.approx(SLO * TBAR[IR] / SLO_BASE, rel=1e-12)
    assert run.budget_state == []


def test_template_budget_without_revise_rounds_drops_them_at_the_first_unit_tester() -> None:
    query = TRACE1[1]
    steps = _steps(query)
    assert REV not in steps and steps[6] == UT
    budget = TemplateStageBudget(_ctx())
    run = _run(query)
    budget.start(run)
    for k in range(6):
        budget.deadline(run, k, ARRIVAL + k)
    now = ARRIVAL + 20.0
    expected = _split(now, run.deadline_s, TBAR[UT], [GUT, UT, EV, UT])
    assert budget.deadline(run, 6, now) == pytest.approx(expected, rel=1e-12)


def test_template_budget_with_more_revise_rounds_than_the_template() -> None:
    query = TRACE1[10]
    steps = _steps(query)
    assert steps[6:12] == [REV] * 5 + [UT]
    budget = TemplateStageBudget(_ctx())
    run = _run(query)
    budget.start(run)
    deadlines = [budget.deadline(run, k, ARRIVAL + 2.0 * k) for k in range(12)]
    d = run.deadline_s
    # 4th revise round: the template's last revise goes; the 5th finds none to remove.
    after = [UT, GUT, UT, EV, UT]
    assert deadlines[9] == pytest.approx(_split(ARRIVAL + 18, d, TBAR[REV], after), rel=1e-12)
    assert deadlines[10] == pytest.approx(_split(ARRIVAL + 20, d, TBAR[REV], after), rel=1e-12)
    assert deadlines[11] == pytest.approx(
        _split(ARRIVAL + 22, d, TBAR[UT], [GUT, UT, EV, UT]), rel=1e-12
    )


def test_template_budget_per_call_estimates_use_the_slowest_call_of_a_fan_out() -> None:
    query = TRACE1[0]
    budget = TemplateStageBudget(_ctx(), estimate="call")
    run = _run(query)
    budget.start(run)
    for k in range(5):
        budget.deadline(run, k, ARRIVAL + k)
    candidates = query.workflow.stages[5].calls
    assert len(candidates) == 2 and candidates[0] != candidates[1]
    own = max(_mean_single(c.input_tokens, c.output_tokens) for c in candidates)
    rest = [REV] * 4 + [UT, GUT, UT, EV, UT]
    now = ARRIVAL + 10.0
    expected = now + (run.deadline_s - now) * own / (own + sum(TBAR[s] for s in rest))
    assert budget.deadline(run, 5, now) == pytest.approx(expected, rel=1e-12)


def test_template_budgets_of_two_queries_are_independent() -> None:
    budget = TemplateStageBudget(_ctx())
    first, second = _run(TRACE1[0], 0), _run(TRACE1[2], 1, arrival=ARRIVAL + 1.0)
    budget.start(first)
    budget.start(second)
    for k in range(len(TRACE1[0].workflow.stages)):
        budget.deadline(first, k, ARRIVAL + k)
    assert first.budget_state == []
    got = budget.deadline(second, 0, ARRIVAL + 1.0) - (ARRIVAL + 1.0)
    assert got == pytest.approx(SLO * TBAR[IR] / SLO_BASE, rel=1e-12)
    assert got < 0.01 * SLO


def test_shared_template_reproduces_the_authors_bug() -> None:
    """docs/algorithm.md §4.1, §9: one list for all queries; once the first query has emptied it,
    every stage of a later query gets the whole remaining SLO (end-to-end laxity)."""
    budget = TemplateStageBudget(_ctx(), shared_template=True)
    proper = TemplateStageBudget(_ctx())
    first, reference = _run(TRACE1[0], 0), _run(TRACE1[0], 0)
    budget.start(first)
    proper.start(reference)
    for k in range(len(TRACE1[0].workflow.stages)):
        # The first query is budgeted as without the bug.
        assert budget.deadline(first, k, ARRIVAL + k) == pytest.approx(
            proper.deadline(reference, k, ARRIVAL + k), rel=1e-12
        )
    second = _run(TRACE1[2], 1, arrival=50.0)
    budget.start(second)
    for k, now in enumerate([50.0, 55.0, 61.5]):
        assert budget.deadline(second, k, now) == pytest.approx(second.deadline_s, rel=1e-12)


def test_end_to_end_budget_is_the_query_deadline() -> None:
    budget = EndToEndBudget(_ctx())
    run = _run(TRACE1[0])
    budget.start(run)
    for k in range(len(TRACE1[0].workflow.stages)):
        assert budget.deadline(run, k, ARRIVAL + 3.0 * k) == ARRIVAL + SLO


# --------------------------------------------------------------------------- DAG budget

SMALL = LLMCall(IR, 308, 5)
CAND_A = LLMCall(GC, 11748, 678)
CAND_B = LLMCall(GC, 9000, 400)
KEYS = LLMCall(EK, 667, 45)
JUDGE = LLMCall(EV, 961, 22)


def _diamond() -> Query:
    """0 -> {1: two candidates in parallel, 2: keywords} -> 3: three evaluations."""
    return Query(
        "diamond",
        Workflow(
            (
                Stage(IR, (SMALL,)),
                Stage(GC, (CAND_B, CAND_A), (0,)),
                Stage(EK, (KEYS,), (0,)),
                Stage(EV, (JUDGE, JUDGE, JUDGE), (1, 2)),
            )
        ),
    )


def _s(call: LLMCall) -> float:
    return _mean_single(call.input_tokens, call.output_tokens)


def test_dag_budget_uses_the_longest_remaining_path() -> None:
    budget = DagStageBudget(_ctx(), split="proportional")
    run = _run(_diamond())
    budget.start(run)
    s0, s1, s2, s3 = _s(SMALL), max(_s(CAND_A), _s(CAND_B)), _s(KEYS), _s(JUDGE)
    assert s1 > s2
    got = budget.deadline(run, 0, ARRIVAL) - ARRIVAL
    assert got == pytest.approx(SLO * s0 / (s0 + s1 + s3), rel=1e-12)
    # Not the sum of both branches:
    assert got > SLO * s0 / (s0 + s1 + s2 + s3) * (1 + 1e-6)
    now = ARRIVAL + 1.0
    d = run.deadline_s
    assert budget.deadline(run, 1, now) == pytest.approx(
        now + (d - now) * s1 / (s1 + s3), rel=1e-12
    )
    assert budget.deadline(run, 2, now) == pytest.approx(
        now + (d - now) * s2 / (s2 + s3), rel=1e-12
    )
    assert budget.deadline(run, 3, ARRIVAL + 40.0) == pytest.approx(d, rel=1e-12)


def test_dag_budget_shrinks_when_a_stage_is_released_late() -> None:
    budget = DagStageBudget(_ctx(), split="proportional")
    run = _run(_diamond())
    budget.start(run)
    s1, s3 = max(_s(CAND_A), _s(CAND_B)), _s(JUDGE)
    budgets = []
    for now in (ARRIVAL + 1.0, ARRIVAL + 30.0, ARRIVAL + 90.0):
        got = budget.deadline(run, 1, now) - now
        assert got == pytest.approx((run.deadline_s - now) * s1 / (s1 + s3), rel=1e-12)
        budgets.append(got)
    assert budgets[0] > budgets[1] > budgets[2] > 0


def test_dag_latest_start_leaves_the_rest_of_the_dag_its_time() -> None:
    budget = DagStageBudget(_ctx())  # latest-start is the default split
    run = _run(_diamond())
    budget.start(run)
    s1, s3 = max(_s(CAND_A), _s(CAND_B)), _s(JUDGE)
    d = run.deadline_s
    # deadline = query deadline - longest path of what comes after the stage
    assert budget.deadline(run, 0, ARRIVAL) == pytest.approx(d - (s1 + s3), rel=1e-12)
    assert budget.deadline(run, 1, ARRIVAL + 5.0) == pytest.approx(d - s3, rel=1e-12)
    assert budget.deadline(run, 2, ARRIVAL + 5.0) == pytest.approx(d - s3, rel=1e-12)
    assert budget.deadline(run, 3, ARRIVAL + 40.0) == pytest.approx(d, rel=1e-12)
    # A late release keeps the deadline: the lateness comes out of this stage's budget.
    early = budget.deadline(run, 1, ARRIVAL + 1.0) - (ARRIVAL + 1.0)
    late = budget.deadline(run, 1, ARRIVAL + 60.0) - (ARRIVAL + 60.0)
    assert early - late == pytest.approx(59.0, rel=1e-9)


def test_dag_budget_rejects_an_unknown_split() -> None:
    with pytest.raises(ConfigError, match="split"):
        DagStageBudget(_ctx(), split="even")  # type: ignore[arg-type]  # the bad value is the test


def test_dag_budget_per_step_estimates() -> None:
    budget = DagStageBudget(_ctx(), estimate="step", split="proportional")
    run = _run(_diamond())
    budget.start(run)
    path = TBAR[IR] + TBAR[GC] + TBAR[EV]
    got = budget.deadline(run, 0, ARRIVAL) - ARRIVAL
    assert got == pytest.approx(SLO * TBAR[IR] / path, rel=1e-12)
