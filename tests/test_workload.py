"""Domain model: call/stage/workflow/query validation, DAG bookkeeping and step names."""

from __future__ import annotations

import dataclasses
import math

import pytest

from hexgen_flow.errors import WorkloadError
from hexgen_flow.workload import (
    STANDARD_TEMPLATE,
    STEP_TYPES,
    LLMCall,
    Query,
    Stage,
    Workflow,
    canonical_step,
)


def _call(step: str = "revise", inp: int = 100, out: int = 10) -> LLMCall:
    return LLMCall(step, inp, out)


def _stage(after: tuple[int, ...] = (), n_calls: int = 1, step: str = "revise") -> Stage:
    return Stage(step, tuple(_call(step) for _ in range(n_calls)), after)


# --------------------------------------------------------------------------- LLMCall


def test_call_keeps_its_token_counts() -> None:
    call = LLMCall("revise", 5963, 79)
    assert (call.step, call.input_tokens, call.output_tokens) == ("revise", 5963, 79)


def test_smallest_valid_call_is_one_token_each_way() -> None:
    call = LLMCall("evaluate", 1, 1)
    assert call.input_tokens == call.output_tokens == 1


@pytest.mark.parametrize(
    ("inp", "out", "field"),
    [
        (0, 10, "input_tokens"),
        (-5, 10, "input_tokens"),
        (10, 0, "output_tokens"),
        (10, -1, "output_tokens"),
    ],
)
def test_call_rejects_non_positive_tokens(inp: int, out: int, field: str) -> None:
    with pytest.raises(WorkloadError, match=field):
        LLMCall("revise", inp, out)


def test_call_is_immutable() -> None:
    call = _call()
    with pytest.raises(dataclasses.FrozenInstanceError):
        call.input_tokens = 5  # type: ignore[misc]  # the point: frozen dataclass refuses


# --------------------------------------------------------------------------- canonical_step


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("Information Retriever", "information_retriever"),
        ("  information retriever ", "information_retriever"),
        ("IR", "information_retriever"),
        ("generate_candidate_llama-agent", "generate_candidate"),
        ("Generate_Candidate_gpt-agent", "generate_candidate"),
        ("generate_candidate", "generate_candidate"),
        ("extract_keywords", "extract_keywords"),
        ("Unit Tester", "unit_tester"),
        ("Summarise Table", "summarise_table"),
    ],
)
def test_canonical_step(raw: str, expected: str) -> None:
    assert canonical_step(raw) == expected


def test_canonical_step_is_idempotent_on_every_step_type() -> None:
    for step in STEP_TYPES:
        assert canonical_step(step) == step
        assert canonical_step(canonical_step(step.upper())) == step


def test_standard_template_uses_only_known_step_types() -> None:
    assert set(STANDARD_TEMPLATE) <= set(STEP_TYPES)
    # docs/algorithm.md §4.1: 15 entries, four revise rounds, three unit_tester visits.
    assert len(STANDARD_TEMPLATE) == 15
    assert STANDARD_TEMPLATE.count("revise") == 4
    assert STANDARD_TEMPLATE.count("unit_tester") == 3
    assert STANDARD_TEMPLATE[0] == "information_retriever"


# --------------------------------------------------------------------------- Workflow


def test_diamond_dependents_and_roots() -> None:
    #   0 -> 1 -> 3
    #   0 -> 2 -> 3
    wf = Workflow((_stage(), _stage((0,)), _stage((0,)), _stage((1, 2))))
    assert wf.dependents == ((1, 2), (3,), (3,), ())
    assert wf.roots == (0,)


def test_several_roots_and_num_calls() -> None:
    wf = Workflow((_stage(n_calls=2), _stage(n_calls=3), _stage((0, 1), n_calls=1)))
    assert wf.roots == (0, 1)
    assert wf.num_calls == 6
    assert wf.dependents == ((2,), (2,), ())


def test_dependents_are_the_inverse_of_after() -> None:
    wf = Workflow((_stage(), _stage((0,)), _stage((0,)), _stage((1,)), _stage((0, 2, 3)), _stage()))
    for k, stage in enumerate(wf.stages):
        for dep in stage.after:
            assert k in wf.dependents[dep]
    for k, users in enumerate(wf.dependents):
        for user in users:
            assert k in wf.stages[user].after
    assert wf.roots == (0, 5)


def test_workflow_needs_a_stage() -> None:
    with pytest.raises(WorkloadError, match="at least one stage"):
        Workflow(())


def test_stage_without_calls_is_rejected_naming_it() -> None:
    with pytest.raises(WorkloadError, match=r"stage 1 \(evaluate\) has no calls"):
        Workflow((_stage(), Stage("evaluate", (), (0,))))


@pytest.mark.parametrize("dep", [1, 2, -1])
def test_dependency_must_be_an_earlier_stage(dep: int) -> None:
    with pytest.raises(WorkloadError, match=f"depends on stage {dep}"):
        Workflow((_stage(), _stage((dep,)), _stage()))


def test_chain_links_each_stage_to_the_previous() -> None:
    wf = Workflow.chain(
        [
            (_call("information_retriever"),),
            (_call("generate_candidate"), _call("generate_candidate")),
            (_call("evaluate"), _call("evaluate"), _call("evaluate")),
        ]
    )
    assert [s.after for s in wf.stages] == [(), (0,), (1,)]
    assert [s.step for s in wf.stages] == [
        "information_retriever",
        "generate_candidate",
        "evaluate",
    ]
    assert wf.num_calls == 6
    assert wf.roots == (0,)
    assert wf.dependents == ((1,), (2,), ())


def test_chain_of_mixed_fan_out_takes_the_first_calls_step() -> None:
    wf = Workflow.chain([(_call("evaluate"), _call("revise"))])
    assert wf.stages[0].step == "evaluate"


def test_chain_rejects_empty_input_and_empty_stages() -> None:
    with pytest.raises(WorkloadError, match="at least one stage"):
        Workflow.chain([])
    with pytest.raises(WorkloadError, match=r"stage 1 .*has no calls"):
        Workflow.chain([(_call(),), ()])


def test_workflow_is_immutable() -> None:
    wf = Workflow.chain([(_call(),)])
    with pytest.raises(dataclasses.FrozenInstanceError):
        wf.stages = ()  # type: ignore[misc]  # the point: frozen dataclass refuses


# --------------------------------------------------------------------------- Query


def test_query_defaults() -> None:
    q = Query("q1", Workflow.chain([(_call(),)]))
    assert q.tenant == "default"
    assert q.arrival_s is None and q.slo_s is None and q.slo_scale is None


def test_query_accepts_explicit_settings() -> None:
    q = Query("q1", Workflow.chain([(_call(),)]), "acme", arrival_s=0.0, slo_s=30.0)
    assert (q.tenant, q.arrival_s, q.slo_s) == ("acme", 0.0, 30.0)
    q2 = Query("q2", Workflow.chain([(_call(),)]), slo_scale=1.5)
    assert q2.slo_scale == 1.5


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"slo_s": 0.0}, "slo_s"),
        ({"slo_s": -3.0}, "slo_s"),
        ({"slo_s": math.nan}, "slo_s"),
        ({"slo_s": math.inf}, "slo_s"),
        ({"slo_scale": 0.0}, "slo_scale"),
        ({"slo_scale": math.nan}, "slo_scale"),
        ({"arrival_s": -0.5}, "arrival_s"),
        ({"arrival_s": math.inf}, "arrival_s"),
        ({"arrival_s": math.nan}, "arrival_s"),
        ({"query_id": ""}, "query_id"),
        ({"tenant": ""}, "tenant"),
    ],
)
def test_query_rejects_invalid_settings(kwargs: dict[str, object], field: str) -> None:
    args: dict[str, object] = {"query_id": "q1", "workflow": Workflow.chain([(_call(),)])}
    args.update(kwargs)
    with pytest.raises(WorkloadError, match=field):
        Query(**args)  # type: ignore[arg-type]  # values of mixed types from the table
