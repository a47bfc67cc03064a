"""The Redis layout has one owner, `hexgen_service.redis_schema`.

- every key, hash field and stream entry a coordinator writes in a real run (queries, a
  workflow session, a cancelled query, an α change) is one the schema declares, and
  check-state finds nothing out of place;
- no module but the schema spells a layout key or field (an ast scan of the services);
  the coordinator's Lua scripts spell only the names the schema declares, and write the
  streams' fields in the schema's order;
- the per-call field formats, key names and stream entries round-trip through the
  schema's format/parse and encode/decode functions.
"""

from __future__ import annotations

import ast
import asyncio
import itertools
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from hexgen_client.addresses import DEFAULT_REDIS_PREFIX
from hexgen_client.client import CoordinatorClient
from hexgen_coordinator import check_state as check_state_module
from hexgen_coordinator import session_store, store
from hexgen_coordinator.check_state import check_state
from hexgen_flow.workload import LLMCall, Query, Workflow
from hexgen_service import redis_keys
from hexgen_service import redis_schema as schema
from hexgen_service.redis_schema import (
    AdmittedEntry,
    CompletionEntry,
    FinishedEntry,
    Placement,
)
from in_process_mesh import in_process_mesh
from redis_here import REDIS_URL, needs_redis

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ROOT / "services"
SCHEMA_FILE = SERVICES / "common" / "hexgen_service" / "redis_schema.py"

# ---------------------------------------------------------------------------- (a) a real run


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@needs_redis
async def test_every_key_and_field_a_real_run_writes_is_declared() -> None:
    small = LLMCall("information_retriever", 308, 5)
    async with in_process_mesh(("A100", "L40S"), "schema", time_scale=200.0) as (
        coordinator,
        address,
    ):
        prefix = coordinator.config.redis_prefix
        async with CoordinatorClient(address) as client:
            for i in range(3):  # queries declared whole: succeeded
                query = Query(f"schema-{i}", Workflow.chain([(small,), (small, small)]))
                assert [e async for e in client.run(query)]
            await client.set_alpha(0.4, "schema test")
            # a workflow session, run and closed: g:, z:, x: and c:{id}/session fields
            await client.open_workflow("schema-session", template="chess", slo_s=600)
            for stage in ("extract_keywords", "generate_candidate", "summarize"):
                async for _ in client.run_call(
                    "schema-session", stage, f"{stage} prompt", max_tokens=4
                ):
                    pass
            await client.close_workflow("schema-session")
            # a session left open (running, in the active set)
            await client.open_workflow("schema-open", template="chess", slo_s=600)
            async for _ in client.run_call("schema-open", "extract_keywords", "x", max_tokens=4):
                pass
            # a cancelled query, cancelled while its long call runs
            long = Query(
                "schema-cancelled",
                Workflow.chain([(LLMCall("x", 308, 5000),)] * 2),
                slo_s=3000.0,
            )
            await client.submit(long)
            await asyncio.sleep(0.3)
            await client.cancel("schema-cancelled")
        await asyncio.sleep(0.5)  # the write-behind lands

        sync: redis.Redis[bytes] = redis.Redis.from_url(REDIS_URL)
        try:
            _check_layout(sync, prefix)
            report = check_state(sync, prefix, None)
        finally:
            sync.close()
    assert report.orphan_keys == 0 and report.clean, report.problems
    assert report.queries == 6 and report.running == 1


def _check_layout(client: redis.Redis[bytes], prefix: str) -> None:
    keys = sorted(_text(k) for k in client.scan_iter(match=prefix + "*", count=1000))
    kinds: dict[str, set[str]] = {}
    patterns: set[str] = set()
    for name in keys:
        where = schema.classify_key(prefix, name)
        assert where is not None, f"{name!r} is not a key the schema declares"
        kinds.setdefault(where[0], set()).add(where[1])
        if where[0] != "query":
            continue
        for field in client.hkeys(name):
            pattern = schema.field_pattern(_text(field))
            assert pattern is not None, f"{name!r}: field {_text(field)!r} is not declared"
            patterns.add(pattern)
    assert {"schema-0", "schema-session", "schema-open", "schema-cancelled"} <= kinds["query"]
    assert {schema.META, schema.QSEQ, schema.ACTIVE, schema.ALPHA_HISTORY} <= kinds["fixed"]
    assert {schema.COMPLETIONS, schema.ADMITTED, schema.FINISHED} <= kinds["fixed"]
    # the run wrote what the test meant it to: stage and per-call fields of every kind
    for pattern in ("s{k}:left", "s{k}:rel", "s{k}:fin", "s{k}:dl", "p:{call_id}"):
        assert pattern in patterns
    for pattern in ("c:{call_id}", "g:{call_id}", "z:{k}", "x:{k}", "session", "idle_s"):
        assert pattern in patterns
    # the streams' entries are the schema's, and decode
    admitted = client.xrange(schema.key(prefix, schema.ADMITTED))
    finished = client.xrange(schema.key(prefix, schema.FINISHED))
    completions = client.xrange(schema.key(prefix, schema.COMPLETIONS))
    assert admitted and finished and completions
    for _, fields in admitted:
        assert [_text(k) for k in fields] == list(schema.ADMITTED_FIELDS)
        assert isinstance(schema.decode_admitted(fields), AdmittedEntry)
    for _, fields in finished:
        assert [_text(k) for k in fields] == list(schema.FINISHED_FIELDS)
        assert isinstance(schema.decode_query_entry(fields), FinishedEntry)
    assert "schema-session" in {schema.decode_finished(f).query_id for _, f in finished}
    for _, fields in completions:
        assert [_text(k) for k in fields] == list(schema.COMPLETION_FIELDS)
        entry = schema.decode_completion(fields)
        assert entry.call_id.startswith(entry.query_id + "/")
    meta = {_text(k) for k in client.hkeys(schema.key(prefix, schema.META))}
    assert meta == {schema.M.EPOCH_UNIX_S, schema.M.TIME_SCALE, schema.M.ALPHA}


# ---------------------------------------------------------------------------- (b) no literal

_NAMESPACES = {
    schema.QUERY_NS,
    schema.EVENTS_NS,
    schema.PROMPTS_NS,
    *schema.CALL_NAMESPACES,
    schema.TUNER_NS,
}
_FIXED_NAMES = set(schema.COORDINATOR_KEYS) | set(schema.TUNER_KEYS) | set(schema.RETIRED_KEYS)
_ANYWHERE = {
    *_NAMESPACES,
    *(":" + name for name in schema.STAGE_FIELDS),
    schema.DEFAULT_PREFIX,
    schema.CLUSTER_PREFIX,
    schema.QSEQ,
    schema.ALPHA_HISTORY,
    *schema.TUNER_KEYS,
    *schema.RETIRED_KEYS,
    schema.M.EPOCH_UNIX_S,
}
"""Literals that spell the layout wherever they stand (no other meaning in the services)."""

_LAYOUT_MODULES = {
    "coordinator/hexgen_coordinator/store.py",
    "coordinator/hexgen_coordinator/session_store.py",
    "coordinator/hexgen_coordinator/recovery.py",
    "coordinator/hexgen_coordinator/check_state.py",
    "coordinator/hexgen_coordinator/views.py",
    "coordinator/hexgen_coordinator/completions.py",
    "coordinator/hexgen_coordinator/shards.py",
    "tuner/hexgen_tuner/window.py",
    "common/hexgen_service/auth_dir.py",
}
"""The modules that read or write the layout: there, every field name is the schema's too."""
_FIELD_NAMES = {
    *schema.QUERY_FIELDS,
    *schema.ADMITTED_FIELDS,
    *schema.FINISHED_FIELDS,
    *schema.COMPLETION_FIELDS,
    schema.M.EPOCH_UNIX_S,
    schema.M.TIME_SCALE,
    schema.CALL_DONE,
    schema.CALL_SKIPPED,
    *_FIXED_NAMES,
}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants (a module's, a class's, a function's, an attribute's)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for stmt in body:
            if (
                isinstance(stmt, ast.Expr)
                and isinstance(stmt.value, ast.Constant)
                and isinstance(stmt.value.value, str)
            ):
                out.add(id(stmt.value))
    return out


def layout_literals(source: str, *, layout_module: bool) -> list[tuple[int, str]]:
    """(line, literal) of every string literal in `source` that spells the layout: a key
    namespace or stage suffix (``"q:"``, ``f"c:{id}"``, ``f"s{k}:left"``), the default
    prefix, a fixed key after a prefix (``prefix + "meta"``, ``f"{prefix}meta"``) and, in a
    module that reads or writes the layout (`layout_module`), any field name."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    in_fstring = {id(p) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for p in n.values}
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) in docs:
                continue
            text = node.value
            whole = id(node) not in in_fstring  # a field name is a whole literal
            if text in _ANYWHERE or (layout_module and whole and text in _FIELD_NAMES):
                found.append((node.lineno, text))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            right = node.right
            if (
                isinstance(right, ast.Constant)
                and isinstance(right.value, str)
                and right.value in _FIXED_NAMES
            ):
                found.append((node.lineno, right.value))
        elif isinstance(node, ast.JoinedStr):
            parts = node.values
            for before, part in itertools.pairwise(parts):
                if (
                    isinstance(before, ast.FormattedValue)
                    and isinstance(part, ast.Constant)
                    and isinstance(part.value, str)
                    and (
                        part.value in _FIXED_NAMES
                        or any(part.value.startswith(ns) for ns in _NAMESPACES)
                    )
                ):
                    found.append((node.lineno, part.value))
    return sorted(set(found))


def _service_modules() -> Iterator[Path]:
    for path in sorted(SERVICES.rglob("*.py")):
        if path != SCHEMA_FILE:
            yield path


def test_no_module_but_the_schema_spells_the_layout() -> None:
    found = []
    for path in _service_modules():
        rel = path.relative_to(SERVICES).as_posix()
        for line, text in layout_literals(path.read_text(), layout_module=rel in _LAYOUT_MODULES):
            found.append(f"services/{rel}:{line}: {text!r}")
    assert not found, "layout literals outside hexgen_service.redis_schema:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        'key = f"{prefix}q:{query_id}"',
        'key = f"{self.prefix}ev:{query_id}"',
        'key = prefix + "meta"',
        'key = f"{prefix}lease"',
        'name = f"s{k}:left"',
        'name = f"c:{call_id}"',
        'done = name.startswith("p:")',
        'prefix = "hf:"',
        'key = self.prefix + "tuner:runs"',
    ],
)
def test_the_scan_finds_a_reintroduced_literal(source: str) -> None:
    assert layout_literals(source, layout_module=False)


@pytest.mark.parametrize(
    "source",
    [
        '"""A docstring about ``P q:{id}`` and s{k}:left."""',
        'message = f"query {query_id!r}: {state}"',
        'help_text = "prefix of every key (default hf:, with --redis-cluster hf:{0}:)"',
        'label = "q: what"',
        'state = "running"',  # a field value outside the layout modules is someone else's
    ],
)
def test_the_scan_leaves_unrelated_strings_alone(source: str) -> None:
    assert not layout_literals(source, layout_module=False)


def test_a_field_name_in_a_layout_module_is_found() -> None:
    assert layout_literals('state = fields["calls_left"]', layout_module=True)
    assert layout_literals('if f.get("state") == S.RUNNING: pass', layout_module=True)
    assert not layout_literals('name = f"stage{k}"', layout_module=True)


_LUA = {
    "store._SUBMIT": store._SUBMIT,
    "store._COMPLETE": store._COMPLETE,
    "store._FAIL_CALL": store._FAIL_CALL,
    "store._CANCEL": store._CANCEL,
    "session_store._GIVE": session_store._GIVE,
    "session_store._CLOSE_STAGES": session_store._CLOSE_STAGES,
}


def lua_literals(script: str) -> set[str]:
    """The string literals of a Lua script, but for Redis command names and XADD's
    ``MAXLEN ~ *`` (comments left out)."""
    code = "\n".join(line.split("--", 1)[0] for line in script.splitlines())
    return {
        s
        for s in re.findall(r"'([^']*)'", code)
        if not re.fullmatch(r"[A-Z]+", s) and s not in ("~", "*")
    }


@pytest.mark.parametrize("name", sorted(_LUA))
def test_the_lua_scripts_spell_only_declared_names(name: str) -> None:
    unknown = lua_literals(_LUA[name]) - schema.LUA_LITERALS
    assert not unknown, f"{name} spells names the schema does not declare: {sorted(unknown)}"


def test_the_lua_check_finds_an_undeclared_name() -> None:
    script = "redis.call('HSET', KEYS[1], 'stage_count', 1) -- 'ok in a comment'"
    assert lua_literals(script) - schema.LUA_LITERALS == {"stage_count"}


def _xadd_fields(script: str) -> list[list[str]]:
    """The field names of each XADD with literal fields in `script`, in order."""
    out = []
    for call in re.findall(r"redis\.call\('XADD',(.*?)\)\n", script, flags=re.S):
        after = call.split("'*',", 1)[1]
        out.append(re.findall(r"'([a-z_]+)'", after))
    return [fields for fields in out if fields]


def test_the_lua_scripts_write_the_streams_as_the_schema_declares() -> None:
    assert _xadd_fields(store._SUBMIT) == [list(schema.ADMITTED_FIELDS)]
    assert _xadd_fields(store.LUA_HELPERS) == [list(schema.FINISHED_FIELDS)]


def test_check_state_and_the_tuner_take_their_key_lists_from_the_schema() -> None:
    assert check_state_module._FIXED == schema.COORDINATOR_KEYS
    assert check_state_module._TUNER == schema.TUNER_KEYS
    assert check_state_module._RETIRED == schema.RETIRED_KEYS
    assert redis_keys.DEFAULT_PREFIX == schema.DEFAULT_PREFIX == DEFAULT_REDIS_PREFIX
    assert redis_keys.CLUSTER_PREFIX == schema.CLUSTER_PREFIX
    assert store.Placement is Placement and store.parse_placement is schema.parse_placement


# ---------------------------------------------------------------------------- (c) round trips


@pytest.mark.parametrize(
    "placement",
    [Placement(0, 0, 0), Placement(3, 17, 2), Placement(-1, 0, 4), Placement(12, -1, 1)],
)
def test_a_placement_round_trips(placement: Placement) -> None:
    text = schema.format_placement(placement)
    assert text == placement.encode() == f"{placement.slot}:{placement.seq}:{placement.attempt}"
    assert schema.parse_placement(text) == placement


def test_a_placement_of_the_older_layout_and_garbage() -> None:
    assert schema.parse_placement("3:7") == Placement(3, 7, 0)  # before attempts were kept
    for bad in ("", "3", "a:b", "1:2:3:4", "1:x:2"):
        assert schema.parse_placement(bad) is None
    assert re.fullmatch(r"-?\d+:-?\d+:?\d*", "-1:0:3")  # what the Lua pattern reads
    assert schema.format_placement(Placement(-1, 0, 3)) == schema.UNPLACED_LUA_PREFIX + "3"


@pytest.mark.parametrize("k", [0, 1, 12])
@pytest.mark.parametrize("name", schema.STAGE_FIELDS)
def test_a_stage_field_round_trips(k: int, name: str) -> None:
    field = schema.stage_field(k, name)
    assert field == f"s{k}:{name}"
    assert schema.parse_stage_field(field) == (k, name)
    assert schema.field_pattern(field) == f"s{{k}}:{name}"


def test_fields_that_are_no_stage_fields() -> None:
    for bad in ("s:left", "sx:left", "s1:other", "s1left", "state", "shape"):
        assert schema.parse_stage_field(bad) is None


@pytest.mark.parametrize("call_id", ["q1/0.0", "a:b/3.12", "wf-1/session"])
@pytest.mark.parametrize("ns", [schema.PLACED, schema.DONE, schema.FAILURES, schema.GIVEN])
def test_a_call_field_round_trips(ns: str, call_id: str) -> None:
    field = schema.call_field(ns, call_id)
    assert schema.parse_call_field(field, ns) == call_id
    assert schema.field_pattern(field) == ns + "{call_id}"
    others = [o for o in (schema.PLACED, schema.DONE, schema.FAILURES) if o != ns]
    assert all(schema.parse_call_field(field, o) is None for o in others)


def test_a_session_stage_field_and_unknown_fields() -> None:
    assert schema.field_pattern(schema.call_field(schema.STAGE_NAME, 3)) == "x:{k}"
    assert schema.field_pattern(schema.call_field(schema.STAGE_CLOSED, 0)) == "z:{k}"
    assert schema.field_pattern("z:abc") is None
    assert schema.field_pattern("unknown") is None
    assert schema.field_pattern("c:") is None
    for name in schema.QUERY_FIELDS:
        assert schema.field_pattern(name) == name


def test_done_values() -> None:
    assert schema.is_done(schema.CALL_DONE) and schema.is_done(schema.CALL_SKIPPED.encode())
    assert not schema.is_done(None) and not schema.is_done("") and not schema.is_done(b"x")


@pytest.mark.parametrize("prefix", ["hf:", "hf:{0}:", "hf-x-1:", ""])
def test_keys_round_trip(prefix: str) -> None:
    for query_id in ("q1", "a:b", "q:1", "meta"):
        assert schema.classify_key(prefix, schema.query_key(prefix, query_id)) == (
            "query",
            query_id,
        )
        assert schema.classify_key(prefix, schema.events_key(prefix, query_id)) == (
            "events",
            query_id,
        )
        assert schema.classify_key(prefix, schema.prompts_key(prefix, query_id)) == (
            "prompts",
            query_id,
        )
    for name in (*schema.COORDINATOR_KEYS, *schema.TUNER_KEYS):
        assert schema.classify_key(prefix, schema.key(prefix, name)) == ("fixed", name)
    assert schema.classify_key(prefix, prefix + "stray") is None
    assert schema.query_key("hf:", "x") == "hf:q:x"  # the stored data's layout: unchanged
    assert schema.events_key("hf:", "x") == "hf:ev:x"
    assert schema.prompts_key("hf:", "x") == "hf:pr:x"


def _as_redis(fields: dict[str, str | int | float]) -> dict[bytes, bytes]:
    """Fields as redis-py reads them back."""
    return {k.encode(): str(v).encode() for k, v in fields.items()}


def test_a_completion_entry_round_trips() -> None:
    entry = CompletionEntry("q1", "q1/0.1", 0, "step", 308, 12, "A100-0", "A100", 0.1, 0.25, 1.5)
    fields = schema.encode_completion(entry)
    assert list(fields) == list(schema.COMPLETION_FIELDS)
    assert fields["released_s"] == "0.1"  # as the coordinator always wrote them: repr
    assert schema.decode_completion(_as_redis(fields)) == entry


def test_an_alpha_change_round_trips_and_the_one_history_spells_it_here() -> None:
    """One format for an α change, the entries of the one α history (the coordinator's
    ``alpha:history``, written with `encode_alpha_change`); the tuner keeps none, and the
    key an older tuner kept is a retired one, no orphan."""
    text = schema.encode_alpha_change(12.5, 0.3, "tune-000007")
    assert json.loads(text) == {"time_s": 12.5, "alpha": 0.3, "reason": "tune-000007"}
    change = schema.decode_alpha_change(text.encode())
    assert change == schema.AlphaChange(12.5, 0.3, "tune-000007")
    assert schema.AlphaChange.from_json(change.to_json()) == change
    assert "tuner:alpha_history" in schema.RETIRED_KEYS
    assert "tuner:alpha_history" not in schema.TUNER_KEYS
    assert schema.classify_key("hf:", "hf:tuner:alpha_history") == (
        "retired",
        "tuner:alpha_history",
    )
    for garbage in ("{}", '{"time_s": 1, "alpha": "x", "reason": ""}', "[]"):
        with pytest.raises((ValueError, KeyError, TypeError)):
            schema.decode_alpha_change(garbage)


def test_admitted_and_finished_entries_decode() -> None:
    admitted = {"query_id": "q1", "tenant": "t", "arrival_s": "1.5", "slo_s": "30.0"}
    raw = _as_redis(dict(admitted)) | {b"submit": b"\x0a\x02q1"}
    assert [*admitted, "submit"] == list(schema.ADMITTED_FIELDS)
    got = schema.decode_query_entry(raw)
    assert got == AdmittedEntry("q1", "t", 1.5, 30.0, b"\x0a\x02q1")
    assert type(got) is AdmittedEntry and schema.decode_admitted(raw) == got
    done = raw | {b"finished_s": b"9.25"}
    assert schema.decode_query_entry(done) == FinishedEntry(
        "q1", "t", 1.5, 30.0, raw[b"submit"], 9.25
    )
    assert schema.decode_finished(done).finished_s == 9.25


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({b"submit": None}, "field 'submit' is missing"),
        ({b"arrival_s": None}, "field 'arrival_s' is missing"),
        ({b"slo_s": b"inf"}, "field 'slo_s' is not finite"),
        ({b"arrival_s": b"nan"}, "field 'arrival_s' is not finite"),
    ],
)
def test_a_bad_entry_names_its_field(change: dict[bytes, bytes | None], message: str) -> None:
    raw: dict[bytes, bytes] = {
        b"query_id": b"q",
        b"tenant": b"",
        b"arrival_s": b"1",
        b"slo_s": b"2",
        b"submit": b"",
    }
    for k, v in change.items():
        if v is None:
            raw.pop(k)
        else:
            raw[k] = v
    with pytest.raises(ValueError, match=message):
        schema.decode_admitted(raw)
