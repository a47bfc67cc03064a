"""Trace loaders: the paper's CHESS/BIRD traces and the JSONL workflow format."""

from __future__ import annotations

import itertools
import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from hexgen_flow.errors import TraceError
from hexgen_flow.traces import BUILTIN_TRACES, load_trace, load_traces, resolve_trace

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# Query counts stated in docs/algorithm.md §1.
PAPER_QUERY_COUNTS = {"trace1": 90, "trace2": 96, "trace3": 110, "financial": 94, "formula1": 29}


def _raw_trace(name: str) -> list[list[dict[str, Any]]]:
    """The built-in trace read straight from the package data, without the loader."""
    text = (
        resources.files("hexgen_flow")
        .joinpath("data", "workloads", "chess-bird", f"{name}.json")
        .read_text()
    )
    return [entry["Text2SQLRequest"] for entry in json.loads(text)]


def _group_key(step: str, position: int) -> str:
    """Consecutive generate_candidate_* share a key, so do consecutive evaluate; others not."""
    if step.startswith("generate_candidate"):
        return "generate_candidate"
    if step == "evaluate":
        return "evaluate"
    return f"solo-{position}"


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _jsonl(tmp_path: Path, *lines: str | dict[str, Any]) -> Path:
    rows = [line if isinstance(line, str) else json.dumps(line) for line in lines]
    return _write(tmp_path, "w.jsonl", "\n".join(rows) + "\n")


def _one_call_stage(step: str = "revise", **extra: Any) -> dict[str, Any]:
    return {"step": step, "calls": [{"input_tokens": 100, "output_tokens": 10}], **extra}


# --------------------------------------------------------------------------- built-in traces


def test_builtin_names_match_the_documented_traces() -> None:
    assert set(BUILTIN_TRACES) == set(PAPER_QUERY_COUNTS)


@pytest.mark.parametrize("name", BUILTIN_TRACES)
def test_builtin_trace_groups_parallel_calls_and_keeps_every_call(name: str) -> None:
    raw = _raw_trace(name)
    queries = load_trace(name)
    assert len(queries) == len(raw) == PAPER_QUERY_COUNTS[name]
    assert len({q.query_id for q in queries}) == len(queries)
    for query, calls in zip(queries, raw, strict=True):
        wf = query.workflow
        # Every trace entry is one LLM call, in order, with its own token counts.
        assert wf.num_calls == len(calls)
        flat = [c for stage in wf.stages for c in stage.calls]
        assert [(c.input_tokens, c.output_tokens) for c in flat] == [
            (c["input_length"], c["output_length"]) for c in calls
        ]
        # Stages: the runs of consecutive generate_candidate_* / evaluate entries, else one
        # stage per entry.
        groups = [
            list(g)
            for _, g in itertools.groupby(
                enumerate(calls), key=lambda ic: _group_key(ic[1]["step"], ic[0])
            )
        ]
        assert len(wf.stages) == len(groups)
        assert [len(s.calls) for s in wf.stages] == [len(g) for g in groups]
        for stage in wf.stages:
            assert all(c.step == stage.step for c in stage.calls)
        # The paper's stages form a chain.
        assert [s.after for s in wf.stages] == [(k - 1,) if k else () for k in range(len(groups))]
        assert query.tenant == "default"
        assert query.arrival_s is None and query.slo_s is None and query.slo_scale is None


def test_builtin_traces_have_the_documented_shape() -> None:
    # docs/algorithm.md §1: 10-28 calls per query, candidates 2 in parallel, evaluate 2-11.
    for name in BUILTIN_TRACES:
        for q in load_trace(name):
            assert 10 <= q.workflow.num_calls <= 28
            steps = [s.step for s in q.workflow.stages]
            assert steps[0] == "information_retriever"
            for stage in q.workflow.stages:
                if stage.step == "generate_candidate":
                    assert len(stage.calls) == 2
                elif stage.step == "evaluate":
                    assert 2 <= len(stage.calls) <= 11
                else:
                    assert len(stage.calls) == 1
                assert stage.step in {
                    "information_retriever",
                    "extract_keywords",
                    "generate_candidate",
                    "revise",
                    "unit_tester",
                    "generate_unit_test",
                    "evaluate",
                }


def test_builtin_trace_query_ids_name_the_trace() -> None:
    queries = load_trace("formula1")
    assert [q.query_id for q in queries[:3]] == ["formula1-0", "formula1-1", "formula1-2"]


def test_load_traces_concatenates_in_order() -> None:
    both = load_traces(["formula1", "trace1"])
    assert len(both) == 29 + 90
    assert both[0].query_id == "formula1-0"
    assert both[29].query_id == "trace1-0"


# --------------------------------------------------------------------------- paper format


def test_paper_grouping_of_a_hand_written_trace(tmp_path: Path) -> None:
    def c(step: str, i: int) -> dict[str, Any]:
        return {"step": step, "input_length": i, "output_length": 1}

    calls = [
        c("Information Retriever", 1),
        c("generate_candidate_llama-agent", 2),
        c("generate_candidate_gpt-agent", 3),  # other agent: same parallel stage
        c("evaluate", 4),  # right after candidates: a new stage
        c("evaluate", 5),
        c("evaluate", 6),
        c("revise", 7),
        c("revise", 8),  # consecutive revise rounds stay serial
        c("evaluate", 9),
    ]
    path = _write(tmp_path, "mine.json", json.dumps([{"Text2SQLRequest": calls}]))
    [query] = load_trace(str(path))
    stages = query.workflow.stages
    assert [(s.step, [x.input_tokens for x in s.calls]) for s in stages] == [
        ("information_retriever", [1]),
        ("generate_candidate", [2, 3]),
        ("evaluate", [4, 5, 6]),
        ("revise", [7]),
        ("revise", [8]),
        ("evaluate", [9]),
    ]
    assert query.query_id == "mine-0"


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        ({"Text2SQLRequest": []}, "expected a JSON list"),
        ([[1, 2]], r"query 0: expected an object with one key"),
        ([{"a": [], "b": []}], r"query 0: expected an object with one key"),
        ([{"Text2SQLRequest": []}], r"query 0: expected a non-empty list of calls"),
        (
            [{"Text2SQLRequest": [{"input_length": 5, "output_length": 5}]}],
            r"query 0, call 0: field 'step'",
        ),
        (
            [{"Text2SQLRequest": [{"step": "revise", "input_length": "5", "output_length": 5}]}],
            r"query 0, call 0: field 'input_length'",
        ),
        (
            [{"Text2SQLRequest": [{"step": "revise", "input_length": 5, "output_length": 0}]}],
            r"query 0, call 0: field 'output_length'",
        ),
        (
            [{"Text2SQLRequest": [{"step": "revise", "input_length": 5}]}],
            r"query 0, call 0: field 'output_length'",
        ),
        (
            [{"Text2SQLRequest": [{"step": "revise", "input_length": True, "output_length": 5}]}],
            r"query 0, call 0: field 'input_length'",
        ),
    ],
)
def test_paper_format_errors_name_file_query_call_and_field(
    tmp_path: Path, doc: Any, expected: str
) -> None:
    good = {"Text2SQLRequest": [{"step": "revise", "input_length": 5, "output_length": 5}]}
    if isinstance(doc, list):
        doc = [good, *doc]
        expected = expected.replace("query 0", "query 1")
    path = _write(tmp_path, "bad.json", json.dumps(doc))
    with pytest.raises(TraceError, match=re.escape(str(path)) + ".*" + expected):
        load_trace(str(path))


def test_paper_format_invalid_json_names_file_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "broken.json", '[\n  {"Text2SQLRequest": [\n  oops\n]}]\n')
    with pytest.raises(TraceError, match=re.escape(f"{path}:3: not valid JSON")):
        load_trace(str(path))


def test_unknown_trace_lists_the_builtin_ones(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="does not exist") as err:
        resolve_trace(str(tmp_path / "nope.json"))
    for name in BUILTIN_TRACES:
        assert name in str(err.value)
    with pytest.raises(TraceError, match="is not a file"):
        resolve_trace(str(tmp_path))


def test_resolve_trace_prefers_an_existing_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve_trace("trace1").name == "trace1.json"  # no such local file: built-in
    _write(tmp_path, "trace1", "[]")
    assert resolve_trace("trace1") == Path("trace1")


def test_non_utf8_trace_is_a_trace_error(tmp_path: Path) -> None:
    path = tmp_path / "latin.json"
    path.write_bytes(b'[{"Text2SQLRequest": [{"step": "r\xe9vise"}]}]')
    with pytest.raises(TraceError, match="not UTF-8"):
        load_trace(str(path))


def test_load_traces_of_nothing_is_an_error(tmp_path: Path) -> None:
    path = _jsonl(tmp_path, "# only a comment", "")
    assert load_trace(str(path)) == []
    with pytest.raises(TraceError, match="no queries"):
        load_traces([str(path)])


# --------------------------------------------------------------------------- JSONL format


DOCSTRING_QUERY: dict[str, Any] = {
    "query_id": "q1",
    "tenant": "acme",
    "arrival_s": 0.5,
    "slo_s": 120,
    "stages": [
        {
            "id": "link",
            "step": "information_retriever",
            "calls": [{"input_tokens": 300, "output_tokens": 5}],
        },
        {
            "id": "cand",
            "step": "generate_candidate",
            "after": ["link"],
            "calls": [
                {"input_tokens": 11000, "output_tokens": 600},
                {"input_tokens": 8000, "output_tokens": 450},
            ],
        },
        {
            "id": "fix",
            "step": "revise",
            "after": ["cand"],
            "repeat": 3,
            "calls": [{"input_tokens": 6000, "output_tokens": 80}],
        },
        {
            "id": "judge",
            "step": "evaluate",
            "after": ["fix", "link"],
            "calls": [{"input_tokens": 900, "output_tokens": 20}],
        },
    ],
}


def test_jsonl_docstring_example(tmp_path: Path) -> None:
    [q] = load_trace(str(_jsonl(tmp_path, DOCSTRING_QUERY)))
    assert (q.query_id, q.tenant, q.arrival_s, q.slo_s, q.slo_scale) == (
        "q1",
        "acme",
        0.5,
        120.0,
        None,
    )
    wf = q.workflow
    # link, cand, fix x3 (a loop unrolled into a chain), judge
    assert [s.step for s in wf.stages] == [
        "information_retriever",
        "generate_candidate",
        "revise",
        "revise",
        "revise",
        "evaluate",
    ]
    assert [s.after for s in wf.stages] == [(), (0,), (1,), (2,), (3,), (0, 4)]
    assert wf.num_calls == 1 + 2 + 3 + 1
    assert wf.dependents == ((1, 5), (2,), (3,), (4,), (5,), ())
    assert [c.input_tokens for c in wf.stages[1].calls] == [11000, 8000]


def test_jsonl_defaults_ids_from_file_stem_and_line(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path,
        "# a comment line",
        "",
        {"stages": [_one_call_stage("Information Retriever"), _one_call_stage()]},
        "   # indented comment",
        {"stages": [_one_call_stage()]},
    )
    a, b = load_trace(str(path))
    assert (a.query_id, b.query_id) == ("w-3", "w-5")
    assert a.tenant == b.tenant == "default"
    assert a.arrival_s is None and a.slo_s is None and a.slo_scale is None
    # Default `after`: the previous stage; the canonical step name applies.
    assert [s.after for s in a.workflow.stages] == [(), (0,)]
    assert a.workflow.stages[0].step == "information_retriever"


def test_jsonl_explicit_roots_integer_ids_and_slo_scale(tmp_path: Path) -> None:
    query = {
        "query_id": 7,
        "tenant": "t2",
        "slo_scale": 2,
        "arrival_s": 0,
        "stages": [
            _one_call_stage(),  # id "0"
            _one_call_stage(after=[]),  # id "1", a second root
            _one_call_stage(after=[0, "1"]),  # ids by default position
        ],
    }
    [q] = load_trace(str(_jsonl(tmp_path, query)))
    assert q.query_id == "7"
    assert (q.slo_scale, q.slo_s, q.arrival_s) == (2.0, None, 0.0)
    assert q.workflow.roots == (0, 1)
    assert q.workflow.stages[2].after == (0, 1)


def test_jsonl_after_a_repeated_stage_waits_for_its_last_round(tmp_path: Path) -> None:
    query = {
        "stages": [
            {"id": "a", **_one_call_stage()},
            {"id": "loop", "after": [], "repeat": 2, **_one_call_stage()},
            {"id": "z", "after": ["loop", "a"], **_one_call_stage("evaluate")},
        ]
    }
    [q] = load_trace(str(_jsonl(tmp_path, query)))
    assert [s.after for s in q.workflow.stages] == [(), (), (1,), (0, 2)]
    assert q.workflow.roots == (0, 1)


def test_jsonl_per_call_step_override(tmp_path: Path) -> None:
    stage = {
        "step": "generate_candidate",
        "calls": [
            {"input_tokens": 100, "output_tokens": 10},
            {"step": "Information Retriever", "input_tokens": 50, "output_tokens": 5},
        ],
    }
    [q] = load_trace(str(_jsonl(tmp_path, {"stages": [stage]})))
    [s] = q.workflow.stages
    assert s.step == "generate_candidate"
    assert [c.step for c in s.calls] == ["generate_candidate", "information_retriever"]


def test_jsonl_duplicate_after_ids_count_once(tmp_path: Path) -> None:
    query = {"stages": [{"id": "a", **_one_call_stage()}, _one_call_stage(after=["a", "a"])]}
    [q] = load_trace(str(_jsonl(tmp_path, query)))
    assert q.workflow.stages[1].after == (0,)


def _stage_with(**fields: Any) -> dict[str, Any]:
    return {"stages": [{**_one_call_stage(), **fields}]}


def _call_with(**fields: Any) -> dict[str, Any]:
    call = {"input_tokens": 100, "output_tokens": 10, **fields}
    return {"stages": [{"step": "revise", "calls": [call]}]}


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({"stages": [_one_call_stage()], "tenantt": "x"}, "'tenantt'"),
        ({}, "'stages'"),
        ({"stages": []}, "'stages'"),
        ({"stages": "revise"}, "'stages'"),
        ({"stages": [_one_call_stage()], "slo_s": 10, "slo_scale": 2}, "'slo_s'"),
        ({"stages": [_one_call_stage()], "slo_s": 0}, "'slo_s'"),
        ({"stages": [_one_call_stage()], "slo_s": "fast"}, "'slo_s'"),
        (
            '{"stages": [{"step": "r", "calls": [{"input_tokens": 1, "output_tokens": 1}]}],'
            ' "slo_s": NaN}',
            "'slo_s'",
        ),
        ({"stages": [_one_call_stage()], "slo_scale": -1}, "'slo_scale'"),
        ({"stages": [_one_call_stage()], "arrival_s": -1}, "'arrival_s'"),
        ({"stages": [_one_call_stage()], "arrival_s": True}, "'arrival_s'"),
        (
            '{"stages": [{"step": "r", "calls": [{"input_tokens": 1, "output_tokens": 1}]}],'
            ' "arrival_s": Infinity}',
            "'arrival_s'",
        ),
        ({"stages": [_one_call_stage()], "tenant": None}, "'tenant'"),
        ({"stages": [_one_call_stage()], "tenant": 5}, "'tenant'"),
        ({"stages": [_one_call_stage()], "query_id": None}, "'query_id'"),
        ({"stages": [_one_call_stage()], "query_id": ""}, "'query_id'"),
        ({"stages": ["revise"]}, r"stages\[0\]: expected an object"),
        (
            {"stages": [{"calls": [{"input_tokens": 1, "output_tokens": 1}]}]},
            r"stages\[0\]: field 'step'",
        ),
        (_stage_with(step=""), r"stages\[0\]: field 'step'"),
        (_stage_with(calls=[]), r"stages\[0\]: field 'calls'"),
        (_stage_with(calls="x"), r"stages\[0\]: field 'calls'"),
        (_stage_with(calls=[3]), r"stages\[0\]\.calls\[0\]: expected an object"),
        (_stage_with(afterr=[]), r"stages\[0\]: unknown field 'afterr'"),
        (_stage_with(after="start"), r"stages\[0\]: field 'after'"),
        (_stage_with(after=["ghost"]), r"stages\[0\]: 'after' names 'ghost'"),
        (_stage_with(id="me", after=["me"]), r"stages\[0\]: 'after' names 'me'"),
        (_stage_with(repeat=0), r"stages\[0\]: field 'repeat'"),
        (_stage_with(repeat="3"), r"stages\[0\]: field 'repeat'"),
        (_stage_with(repeat=True), r"stages\[0\]: field 'repeat'"),
        (
            {"stages": [{"id": "x", **_one_call_stage()}, {"id": "x", **_one_call_stage()}]},
            r"stages\[1\]: duplicate stage id 'x'",
        ),
        (_call_with(input_tokens=0), r"calls\[0\]: field 'input_tokens'"),
        (_call_with(input_tokens=1.5), r"calls\[0\]: field 'input_tokens'"),
        (_call_with(output_tokens="10"), r"calls\[0\]: field 'output_tokens'"),
        (
            {"stages": [{"step": "revise", "calls": [{"input_tokens": 5}]}]},
            r"calls\[0\]: field 'output_tokens'",
        ),
        (_call_with(step=5), r"calls\[0\]: field 'step'"),
        (_call_with(input_length=5), r"calls\[0\]: unknown field 'input_length'"),
    ],
)
def test_jsonl_errors_name_file_line_and_field(
    tmp_path: Path, line: str | dict[str, Any], field: str
) -> None:
    # The bad query sits on line 3, after a comment and a valid query.
    path = _jsonl(tmp_path, "# header", {"stages": [_one_call_stage()]}, line)
    with pytest.raises(TraceError, match=re.escape(f"{path}:3: ") + ".*" + field):
        load_trace(str(path))


# --------------------------------------------------------------------------- examples/


def test_example_workflows_file() -> None:
    queries = load_trace(str(EXAMPLES / "workflows.jsonl"))
    by_id = {q.query_id: q for q in queries}
    assert len(by_id) == len(queries) == 4
    assert {q.tenant for q in queries} == {"acme", "globex"}

    fan = by_id["fan-out"].workflow
    # One router call, three candidate generators in parallel, a judge per candidate.
    assert [len(s.calls) for s in fan.stages] == [1, 3, 3]
    assert fan.stages[1].step == "generate_candidate"
    assert {c.step for c in fan.stages[1].calls} == {"generate_candidate"}
    assert by_id["fan-out"].arrival_s == 0.0 and by_id["fan-out"].slo_s == 60.0

    loop = by_id["self-correction"].workflow
    steps = [s.step for s in loop.stages]
    assert steps.count("revise") == 4
    first = steps.index("revise")
    assert [loop.stages[first + k].after for k in range(4)] == [
        (first - 1,),
        (first,),
        (first + 1,),
        (first + 2,),
    ]
    assert by_id["self-correction"].slo_scale == 1.5

    diamond = by_id["diamond"].workflow
    assert diamond.roots == (0,)
    assert diamond.dependents[0] == (1, 2)
    assert diamond.stages[3].after == (1, 2)
    assert diamond.dependents[1] == diamond.dependents[2] == (3,)

    custom = by_id["custom-steps"]
    assert custom.arrival_s is None and custom.slo_s is None and custom.slo_scale is None
    assert len(custom.workflow.roots) == 2
    assert "summarise" in {s.step for s in custom.workflow.stages}
    # Explicit arrivals are in time order and nothing arrives before zero.
    arrivals = [q.arrival_s for q in queries if q.arrival_s is not None]
    assert arrivals == sorted(arrivals) and arrivals[0] >= 0
