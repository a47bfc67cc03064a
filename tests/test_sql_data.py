"""The Chinook database that scripts/build_chinook.py builds, and the questions with gold
SQL shipped with the client: every gold query runs in the sandbox and returns rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from hexgen_sql.evaluate import execution_match, has_order_by
from hexgen_sql.questions import DIFFICULTIES, Question, load_questions
from hexgen_sql.sandbox import run_query
from sql_fixtures import BUILD_SCRIPT, build_with_script, chinook_db_fixture, sha256  # noqa: F401

QUESTIONS = load_questions()

ROW_COUNTS = {
    "Artist": 275,
    "Album": 347,
    "Genre": 25,
    "MediaType": 5,
    "Track": 3503,
    "Playlist": 18,
    "PlaylistTrack": 8715,
    "Employee": 8,
    "Customer": 59,
    "Invoice": 412,
    "InvoiceLine": 2240,
}


def test_tables_hold_the_chinook_rows(chinook_db: Path) -> None:
    for table, count in ROW_COUNTS.items():
        assert run_query(chinook_db, f"SELECT count(*) FROM {table}").rows == ((count,),)
    # keys hold, and the values look like Chinook's own SQLite file
    orphans = run_query(
        chinook_db,
        "SELECT count(*) FROM Track t LEFT JOIN Album a USING (AlbumId) "
        "WHERE t.AlbumId IS NOT NULL AND a.AlbumId IS NULL",
    )
    assert orphans.rows == ((0,),)
    first = run_query(chinook_db, "SELECT InvoiceDate, Total FROM Invoice WHERE InvoiceId = 1")
    assert first.rows == (("2007-01-01 00:00:00", 1.98),)


def test_the_build_is_quick_and_reproducible(tmp_path: Path, chinook_db: Path) -> None:
    start = time.monotonic()
    again = build_with_script(tmp_path / "again.db")
    assert time.monotonic() - start < 60
    assert sha256(again) == sha256(chinook_db)
    # rebuilding over an existing file replaces it
    build_with_script(again)
    assert sha256(again) == sha256(chinook_db)
    assert not list(tmp_path.glob("*.partial"))


def test_the_build_script_reports_missing_data(tmp_path: Path) -> None:
    env = dict(os.environ, HEXGEN_CHINOOK_FIXTURE=str(tmp_path / "missing.json"))
    done = subprocess.run(
        [sys.executable, str(BUILD_SCRIPT), str(tmp_path / "x.db")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert "HEXGEN_CHINOOK_FIXTURE" in done.stderr
    assert not (tmp_path / "x.db").exists()


def test_the_question_set() -> None:
    assert len(QUESTIONS) >= 50
    assert len({q.id for q in QUESTIONS}) == len(QUESTIONS)
    assert len({q.question for q in QUESTIONS}) == len(QUESTIONS)
    by_difficulty = Counter(q.difficulty for q in QUESTIONS)
    assert set(by_difficulty) == set(DIFFICULTIES)
    assert min(by_difficulty.values()) >= 10
    sql = [q.sql.upper() for q in QUESTIONS]

    def count(word: str) -> int:
        return sum(word in s for s in sql)

    assert count(" JOIN ") >= 20
    assert count("GROUP BY") >= 15
    assert count("HAVING") >= 5
    assert count("LIMIT") >= 5
    assert count("(SELECT") >= 4
    assert count("STRFTIME") + count("JULIANDAY") >= 5
    assert sum(s.count(" JOIN ") >= 2 for s in sql) >= 8  # three tables or more
    assert sum(s.count(" JOIN ") >= 3 for s in sql) >= 3  # four or more
    assert sum(has_order_by(q.sql) for q in QUESTIONS) >= 5
    assert all(q.rows is not None for q in QUESTIONS)


@pytest.mark.parametrize("question", QUESTIONS, ids=[q.id for q in QUESTIONS])
def test_every_gold_query_runs_in_the_sandbox(chinook_db: Path, question: Question) -> None:
    result = run_query(chinook_db, question.sql, max_rows=10_000)
    assert not result.truncated
    assert len(result.rows) >= 1
    if question.rows is not None:
        assert len(result.rows) == question.rows
    assert execution_match(chinook_db, question.sql, question.sql).match


def test_load_questions_rejects_malformed_lines(tmp_path: Path) -> None:
    good = {"id": "q1", "question": "How many?", "sql": "SELECT 1", "difficulty": "easy"}
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps({**good, "rows": 1}) + "\n")
    with pytest.raises(ValueError, match="repeated id"):
        load_questions(path)
    for bad, message in [
        ({**good, "difficulty": "trivial"}, "difficulty"),
        ({**good, "sql": ""}, "'sql'"),
        ({**good, "rows": -1}, "rows"),
        ({**good, "extra": 1}, "unknown keys"),
    ]:
        path.write_text(json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match=message):
            load_questions(path)
    path.write_text(json.dumps(good) + "\n")
    assert load_questions(path) == [Question("q1", "How many?", "SELECT 1", "easy")]


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        "[1, 2]",
        '[{"model": "chinook.artist", "pk": 1, "fields": {"name": "A"}}]',
    ],
)
def test_the_build_script_rejects_a_wrong_fixture(tmp_path: Path, content: str) -> None:
    fixture = tmp_path / "fixture.json"
    fixture.write_text(content)
    out = tmp_path / "x.db"
    done = subprocess.run(
        [sys.executable, str(BUILD_SCRIPT), str(out), "--fixture", str(fixture)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("build_chinook: ")
    assert done.stderr.count("\n") == 1
    assert not out.exists()
    assert not list(tmp_path.glob("*.partial"))
