"""The simulated engine's synthetic responder (heuristic text, not a model): it reads the
agent's prompts (the contract of hexgen_sql.prompts) and answers with keywords and
SQL that SQLite runs, breaking a documented share of the candidates on purpose."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from hexgen_sql import prompts
from hexgen_sql.schema import extract_keywords, link_schema, read_schema, render_schema
from hexgen_worker.engines import responder
from hexgen_worker.engines.simulated import SimulatedEngine
from sql_fixtures import chinook_db_fixture  # noqa: F401

SCHEMA = """CREATE TABLE Artist (
  ArtistId INTEGER PRIMARY KEY,
  Name NVARCHAR(120) -- e.g. 'AC/DC', 'Accept', 'Aerosmith'
);
CREATE TABLE Album (
  AlbumId INTEGER PRIMARY KEY,
  Title NVARCHAR(160), -- e.g. 'Let There Be Rock', 'Big Ones', 'A very long title that was cut…'
  ArtistId INTEGER REFERENCES Artist(ArtistId)
);"""


def gateway_prompt(user: str) -> str:
    """The prompt as the gateway hands a chat to the engine (one `role: content` line each)."""
    return f"system: {prompts.SYSTEM}\nuser: {user}\nassistant:"


def body(answer: str | None) -> str:
    """The answer without its first line, the label every synthetic answer starts with."""
    assert answer is not None
    label, _, rest = answer.partition("\n")
    assert label == responder.LABEL and label.startswith(prompts.SYNTHETIC_LABEL)
    return rest


def sql_of(answer: str | None) -> str:
    text = body(answer)
    assert text.startswith("```sql\n") and text.endswith("\n```")
    assert prompts.extract_sql(answer or "") == text.removeprefix("```sql\n").removesuffix("\n```")
    return text.removeprefix("```sql\n").removesuffix("\n```")


def test_the_marker_is_the_agents() -> None:
    assert responder.AGENT_MARKER == prompts.MARKER
    assert responder.respond("user: How many tracks are there?\nassistant:") is None
    assert responder.respond("[simulated A100] 64 tokens") is None
    assert not responder.is_agent_prompt("SELECT 1")


def test_keywords_are_a_json_list() -> None:
    answer = responder.respond(gateway_prompt(prompts.keywords_prompt("List all tracks by AC/DC")))
    assert json.loads(body(answer)) == ["track", "ac/dc"]
    assert prompts.parse_keywords(answer or "") == ["track", "ac/dc"]
    quoted = responder.respond(prompts.keywords_prompt("Albums of the artist 'Iron Maiden'?"))
    assert "iron maiden" in json.loads(body(quoted))


def test_the_schema_is_read_back_from_the_prompt() -> None:
    tables = responder.parse_schema(prompts.candidate_prompt("q", SCHEMA, 0))
    assert [t.name for t in tables] == ["Artist", "Album"]
    album = tables[1]
    assert [c.name for c in album.columns] == ["AlbumId", "Title", "ArtistId"]
    assert album.columns[0].primary_key and album.columns[2].ref == ("Artist", "ArtistId")
    # a sample cut by render_schema ("…") is not a value
    assert album.columns[1].samples == ("Let There Be Rock", "Big Ones")


@pytest.mark.parametrize(
    ("question", "sql"),
    [
        ("How many artists are there?", "SELECT COUNT(*) FROM Artist"),
        ("List the titles of the albums by AC/DC.",
         "SELECT Album.Title FROM Album JOIN Artist ON Album.ArtistId = Artist.ArtistId "
         "WHERE Artist.Name = 'AC/DC'"),
        ("How many albums does each artist have?",
         "SELECT Artist.Name, COUNT(*) FROM Album JOIN Artist ON Album.ArtistId = "
         "Artist.ArtistId GROUP BY Artist.Name"),
    ],
)  # fmt: skip
def test_heuristic_sql(question: str, sql: str) -> None:
    assert responder.heuristic_sql(question, responder.parse_schema(SCHEMA)) == sql


def test_answers_are_deterministic_and_differ_by_candidate() -> None:
    answers = {
        i: responder.respond(prompts.candidate_prompt("List all album titles.", SCHEMA, i))
        for i in range(40)
    }
    again = {
        i: responder.respond(prompts.candidate_prompt("List all album titles.", SCHEMA, i))
        for i in range(40)
    }
    assert answers == again
    assert len(set(answers.values())) >= 3  # base, misspelt, another column


def test_a_share_of_candidates_fails_and_revise_fixes_them(chinook_db: Path) -> None:
    """Over 300 candidate prompts, about BROKEN_SHARE fail with SQLite's "no such ..." and
    every revise answer to such a failure runs."""
    schema = read_schema(chinook_db)
    questions = [
        "How many tracks are there?",
        "List the names of all genres.",
        "What is the average invoice total?",
        "Which customers live in Brazil?",
        "List the titles of the albums by AC/DC.",
        "How many tracks are in each genre?",
    ]
    failed = total = 0
    with sqlite3.connect(f"file:{chinook_db}?mode=ro", uri=True) as conn:
        for question in questions:
            linked = render_schema(link_schema(schema, extract_keywords(question)))
            for index in range(50):
                user = prompts.candidate_prompt(question, linked, index)
                sql = sql_of(responder.respond(gateway_prompt(user)))
                total += 1
                try:
                    conn.execute(sql).fetchall()
                    continue
                except sqlite3.OperationalError as error:
                    reason = str(error)
                failed += 1
                assert reason.startswith(("no such column: ", "no such table: ")), reason
                fix = prompts.revise_prompt(question, linked, sql, reason, 1)
                fixed = sql_of(responder.respond(gateway_prompt(fix)))
                assert fixed != sql
                conn.execute(fixed).fetchall()  # runs
    assert abs(failed / total - responder.BROKEN_SHARE) < 0.08, (failed, total)


def test_revise_of_another_error_answers_the_heuristic_query() -> None:
    question = "How many artists are there?"
    prompt = prompts.revise_prompt(question, SCHEMA, "SELEC 1", 'near "SELEC": syntax error', 1)
    assert sql_of(responder.respond(prompt)) == "SELECT COUNT(*) FROM Artist"


def test_the_simulated_engine_keeps_its_placeholder_for_other_prompts() -> None:
    from hexgen_worker.engines.base import CallRequest
    from hexgen_worker.engines.simulated import _synthetic_answer

    assert _synthetic_answer(CallRequest(None)) is None
    assert _synthetic_answer(CallRequest("user: hello\nassistant:")) is None
    prompt = gateway_prompt(prompts.keywords_prompt("How many albums?"))
    answer = _synthetic_answer(CallRequest(prompt))
    assert answer is not None and body(answer[0]) == '["album"]'
    assert SimulatedEngine.kind == "simulated"
