"""Trace loaders: the paper's CHESS/BIRD traces and HexGen-Flow's own JSONL workflow format.

``--trace`` takes a file path or the name of a built-in trace (``trace1``, ``trace2``,
``trace3``, ``financial``, ``formula1``: the paper's traces, shipped in the package).

**Paper format** (``.json``): a list of ``{"Text2SQLRequest": [call, ...]}``, each call
``{"step": name, "input_length": n, "output_length": n}`` in execution order. Consecutive
``generate_candidate_*`` calls form one parallel stage, and so do consecutive ``evaluate``
calls; every other call is a stage of its own; the stages form a chain.

**HexGen-Flow JSONL** (``.jsonl``): one query per line (blank lines and lines starting with
``#`` are skipped)::

    {"query_id": "q1", "tenant": "acme", "arrival_s": 0.5, "slo_s": 120,
     "stages": [
       {"id": "link", "step": "information_retriever",
        "calls": [{"input_tokens": 300, "output_tokens": 5}]},
       {"id": "cand", "step": "generate_candidate", "after": ["link"],
        "calls": [{"input_tokens": 11000, "output_tokens": 600},
                  {"input_tokens": 8000, "output_tokens": 450}]},
       {"id": "fix", "step": "revise", "after": ["cand"], "repeat": 3,
        "calls": [{"input_tokens": 6000, "output_tokens": 80}]},
       {"id": "judge", "step": "evaluate", "after": ["fix", "link"],
        "calls": [{"input_tokens": 900, "output_tokens": 20}]}
     ]}

Fields: ``query_id`` (default: file stem and line number), ``tenant`` (default
``"default"``), ``arrival_s`` (explicit arrival time; default: the run's arrival process),
``slo_s`` (explicit SLO in seconds) or ``slo_scale`` (multiple of SLO_base; default: the
run's scale). A stage: ``step`` (step type), ``calls`` (one or more; more run in parallel;
a call may override ``step``), ``id`` (default: its position), ``after`` (ids it waits for;
default: the previous stage, ``[]`` for none) and ``repeat`` (a loop such as
self-correction rounds: the stage runs that many times in sequence; default 1).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

from hexgen_flow.errors import TraceError, WorkloadError
from hexgen_flow.workload import LLMCall, Query, Stage, Workflow, canonical_step

__all__ = [
    "BUILTIN_TRACES",
    "load_trace",
    "load_traces",
    "parse_paper_trace",
    "resolve_trace",
    "take_queries",
]

BUILTIN_TRACES = ("trace1", "trace2", "trace3", "financial", "formula1")
_PARALLEL_STEPS = ("generate_candidate", "evaluate")


def resolve_trace(name: str) -> Path:
    """A path for `name`: an existing file, or a built-in trace's packaged file."""
    path = Path(name)
    if path.is_file():
        return path
    if name in BUILTIN_TRACES:
        ref = resources.files("hexgen_flow").joinpath(
            "data", "workloads", "chess-bird", f"{name}.json"
        )
        return Path(str(ref))
    if path.exists():
        raise TraceError(f"trace {name} is not a file")
    raise TraceError(
        f"trace file {name} does not exist (built-in traces: {', '.join(BUILTIN_TRACES)})"
    )


def load_trace(name: str) -> list[Query]:
    path = resolve_trace(name)
    try:
        text = path.read_text()
    except OSError as exc:
        raise TraceError(f"cannot read trace {name}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise TraceError(f"trace {name} is not UTF-8 text") from None
    if path.suffix == ".jsonl":
        return parse_jsonl(text, path.stem, str(path))
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    return parse_paper_trace(doc, path.stem, str(path))


def load_traces(names: Sequence[str]) -> list[Query]:
    """Queries of every trace, in file order."""
    queries: list[Query] = []
    for name in names:
        queries.extend(load_trace(name))
    if not queries:
        raise TraceError("the traces hold no queries")
    return queries


def _int_field(obj: dict[str, Any], field: str, where: str) -> int:
    value = obj.get(field)
    # Token counts: checked here so that the message names the field as the file spells it.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TraceError(f"{where}: field {field!r} must be an integer >= 1, got {value!r}")
    return value


def parse_paper_trace(doc: Any, stem: str, source: str) -> list[Query]:
    if not isinstance(doc, list):
        raise TraceError(f"{source}: expected a JSON list of {{'Text2SQLRequest': [...]}}")
    queries = []
    for n, entry in enumerate(doc):
        where = f"{source}: query {n}"
        if not isinstance(entry, dict) or len(entry) != 1:
            raise TraceError(f"{where}: expected an object with one key, e.g. Text2SQLRequest")
        calls_raw = next(iter(entry.values()))
        if not isinstance(calls_raw, list) or not calls_raw:
            raise TraceError(f"{where}: expected a non-empty list of calls")
        stages: list[list[LLMCall]] = []
        for c, raw in enumerate(calls_raw):
            cwhere = f"{where}, call {c}"
            if not isinstance(raw, dict) or not isinstance(raw.get("step"), str):
                raise TraceError(f"{cwhere}: field 'step' must be a string")
            try:
                call = LLMCall(
                    canonical_step(raw["step"]),
                    _int_field(raw, "input_length", cwhere),
                    _int_field(raw, "output_length", cwhere),
                )
            except WorkloadError as exc:
                raise TraceError(f"{cwhere}: {exc}") from None
            if stages and call.step in _PARALLEL_STEPS and stages[-1][0].step == call.step:
                stages[-1].append(call)
            else:
                stages.append([call])
        queries.append(Query(f"{stem}-{n}", Workflow.chain([tuple(s) for s in stages])))
    return queries


def parse_jsonl(text: str, stem: str, source: str) -> list[Query]:
    queries = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{source}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object (one query per line)")
        try:
            queries.append(_query_from_json(obj, f"{stem}-{lineno}", where))
        except WorkloadError as exc:
            raise TraceError(f"{where}: {exc}") from None
    return queries


def _optional_number(obj: dict[str, Any], field: str, where: str) -> float | None:
    value = obj.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TraceError(f"{where}: field {field!r} must be a finite number, got {value!r}")
    if field != "arrival_s" and value <= 0:
        raise TraceError(f"{where}: field {field!r} must be > 0, got {value}")
    if value < 0:
        raise TraceError(f"{where}: field {field!r} must be >= 0, got {value}")
    return float(value)


_QUERY_FIELDS = frozenset({"query_id", "tenant", "arrival_s", "slo_s", "slo_scale", "stages"})
_STAGE_FIELDS = frozenset({"id", "step", "calls", "after", "repeat"})
_CALL_FIELDS = frozenset({"step", "input_tokens", "output_tokens"})


def _reject_unknown(obj: dict[str, Any], known: frozenset[str], where: str) -> None:
    # A misspelt optional field ("afterr", "repeats") would otherwise change the DAG silently.
    unknown = sorted(set(obj) - known)
    if unknown:
        fields = ", ".join(sorted(known))
        raise TraceError(f"{where}: unknown field {unknown[0]!r} (fields: {fields})")


def _query_from_json(obj: dict[str, Any], default_id: str, where: str) -> Query:
    _reject_unknown(obj, _QUERY_FIELDS, where)
    stages_raw = obj.get("stages")
    if not isinstance(stages_raw, list) or not stages_raw:
        raise TraceError(f"{where}: field 'stages' must be a non-empty list")
    slo_s = _optional_number(obj, "slo_s", where)
    slo_scale = _optional_number(obj, "slo_scale", where)
    if slo_s is not None and slo_scale is not None:
        raise TraceError(f"{where}: give 'slo_s' or 'slo_scale', not both")
    query_id = obj.get("query_id", default_id)
    if isinstance(query_id, bool) or not isinstance(query_id, str | int) or query_id == "":
        raise TraceError(f"{where}: field 'query_id' must be a non-empty string or an integer")
    tenant = obj.get("tenant", "default")
    if not isinstance(tenant, str) or not tenant:
        raise TraceError(f"{where}: field 'tenant' must be a non-empty string, got {tenant!r}")
    return Query(
        query_id=str(query_id),
        workflow=_workflow_from_json(stages_raw, where),
        tenant=tenant,
        arrival_s=_optional_number(obj, "arrival_s", where),
        slo_s=slo_s,
        slo_scale=slo_scale,
    )


def _workflow_from_json(stages_raw: Iterable[Any], where: str) -> Workflow:
    stages: list[Stage] = []
    last_of: dict[str, int] = {}  # stage id -> index of its last round
    previous: int | None = None
    for n, raw in enumerate(stages_raw):
        swhere = f"{where}: stages[{n}]"
        if not isinstance(raw, dict):
            raise TraceError(f"{swhere}: expected an object")
        _reject_unknown(raw, _STAGE_FIELDS, swhere)
        sid = str(raw.get("id", n))
        if sid in last_of:
            raise TraceError(f"{swhere}: duplicate stage id {sid!r}")
        step_raw = raw.get("step")
        if not isinstance(step_raw, str) or not step_raw:
            raise TraceError(f"{swhere}: field 'step' must be a non-empty string")
        step = canonical_step(step_raw)
        calls_raw = raw.get("calls")
        if not isinstance(calls_raw, list) or not calls_raw:
            raise TraceError(f"{swhere}: field 'calls' must be a non-empty list")
        calls = []
        for c, craw in enumerate(calls_raw):
            cwhere = f"{swhere}.calls[{c}]"
            if not isinstance(craw, dict):
                raise TraceError(f"{cwhere}: expected an object")
            _reject_unknown(craw, _CALL_FIELDS, cwhere)
            cstep = craw.get("step", step_raw)
            if not isinstance(cstep, str):
                raise TraceError(f"{cwhere}: field 'step' must be a string")
            calls.append(
                LLMCall(
                    canonical_step(cstep),
                    _int_field(craw, "input_tokens", cwhere),
                    _int_field(craw, "output_tokens", cwhere),
                )
            )
        after_raw = raw.get("after")
        if after_raw is None:
            after: tuple[int, ...] = (previous,) if previous is not None else ()
        else:
            if not isinstance(after_raw, list):
                raise TraceError(f"{swhere}: field 'after' must be a list of stage ids")
            missing = [str(a) for a in after_raw if str(a) not in last_of]
            if missing:
                raise TraceError(
                    f"{swhere}: 'after' names {missing[0]!r}, which is not an earlier stage id"
                )
            after = tuple(sorted({last_of[str(a)] for a in after_raw}))
        repeat = raw.get("repeat", 1)
        if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
            raise TraceError(f"{swhere}: field 'repeat' must be an integer >= 1")
        for _ in range(repeat):
            stages.append(Stage(step=step, calls=tuple(calls), after=after))
            after = (len(stages) - 1,)
        last_of[sid] = len(stages) - 1
        previous = len(stages) - 1
    return Workflow(tuple(stages))


def take_queries(queries: Sequence[Query], n: int | None) -> list[Query]:
    """The first `n` queries in order, cycling when `n` exceeds them (None: each once).

    A repeated query gets the id ``<id>#<round>`` so every query of a run is distinct.
    """
    if n is None:
        return list(queries)
    if n < 1:
        raise TraceError(f"num-queries must be >= 1, got {n}")
    out = []
    for i in range(n):
        q = queries[i % len(queries)]
        rnd = i // len(queries)
        out.append(q if rnd == 0 else replace(q, query_id=f"{q.query_id}#{rnd}"))
    return out
