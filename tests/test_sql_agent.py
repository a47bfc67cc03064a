"""The Text-to-SQL agent: its answer parsing and vote as units, and the whole pipeline for
real, against `hexgen-flow up`'s gateway with simulated engines, whose text for the
agent's prompts is the synthetic responder's (heuristics, not a model)."""

from __future__ import annotations

import sqlite3
import subprocess
import uuid
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import openai
import pytest

from hexgen_client.client import CoordinatorClient
from hexgen_sql import prompts
from hexgen_sql.agent import AgentResult, SqlAgent, vote
from hexgen_sql.evaluate import results_match
from hexgen_sql.questions import load_questions
from hexgen_sql.sandbox import QueryResult
from sql_fixtures import chinook_db_fixture  # noqa: F401
from up_runner import Up, running_up

TIME_SCALE = 50.0

needs_redis_server = pytest.mark.skipif(
    subprocess.run(["which", "redis-server"], capture_output=True, check=False).returncode != 0,
    reason="redis-server is not installed (apt install redis-server)",
)

# ------------------------------------------------------------------ answer parsing (units)


@pytest.mark.parametrize(
    ("answer", "sql"),
    [
        ("```sql\nSELECT Name FROM Artist;\n```", "SELECT Name FROM Artist"),
        ("Here it is:\n```SQL\nselect 1\n```\nDone.", "select 1"),
        ("```\nWITH t AS (SELECT 1) SELECT * FROM t\n```", "WITH t AS (SELECT 1) SELECT * FROM t"),
        ("The query is SELECT Title FROM Album WHERE Title = 'a;b'; it works.",
         "SELECT Title FROM Album WHERE Title = 'a;b'"),
        ("```text\nno sql\n```\n```sql\nSELECT 2\n```", "SELECT 2"),
        ("SELECT 3\n\nThis returns three.", "SELECT 3"),
        ("I cannot answer that.", None),
        ("```sql\n\n```", None),
    ],
)  # fmt: skip
def test_extract_sql(answer: str, sql: str | None) -> None:
    assert prompts.extract_sql(answer) == sql


def test_parse_keywords() -> None:
    assert prompts.parse_keywords('["Track", "AC/DC"]') == ["track", "ac/dc"]
    assert prompts.parse_keywords('Keywords: ```json\n["genre"]\n```') == ["genre"]
    assert prompts.parse_keywords("- track\n- Iron Maiden\n") == ["track", "iron maiden"]
    assert prompts.parse_keywords("album, artist") == ["album", "artist"]
    assert prompts.parse_keywords("") is None
    assert prompts.parse_keywords("I am not sure what the keywords of this question are.") is None


def _result(*rows: tuple[object, ...]) -> QueryResult:
    return QueryResult(("a",), tuple(rows), False, 0.0)


def test_vote_takes_the_largest_group_and_the_earliest_of_ties() -> None:
    one, two = _result((1,), (2,)), _result((3,))
    assert vote([two, one, _result((2,), (1,)), None]) == 1  # {1, 2} twice, as multisets
    assert vote([two, one]) == 0  # a tie: the earliest
    assert vote([None, one, two, two]) == 2
    assert vote([_result(), one]) == 1  # rows beat an empty result
    assert vote([_result(), None]) == 0
    assert vote([None, None]) is None
    assert vote([_result((1.00001,)), _result((1,)), two]) == 0  # evaluate's normalisation


# ------------------------------------------------------------------ through the mesh


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    with running_up(
        tmp_path_factory.mktemp("sql-agent"),
        "--cluster", "A100,A6000",
        "--time-scale", str(TIME_SCALE),
        "--no-tuner",
        "--gateway-listen", "127.0.0.1:0",
    ) as running:  # fmt: skip
        yield running


def _agent(up: Up, db: Path, **options: object) -> SqlAgent:
    url = up.banner["gateway"].split(" ", 1)[0]
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
    return SqlAgent(client, db, time_scale=TIME_SCALE, **options)  # type: ignore[arg-type]


def _sqlite_error(db: Path, sql: str) -> str:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        try:
            conn.execute(sql).fetchall()
        except sqlite3.Error as error:
            return str(error)
    raise AssertionError(f"{sql!r} runs")


@needs_redis_server
async def test_a_question_runs_every_stage(up: Up, chinook_db: Path) -> None:
    agent = _agent(up, chinook_db, slo_s=600.0)
    workflow = f"t-{uuid.uuid4().hex[:8]}"
    result = await agent.answer("How many tracks are there?", workflow=workflow)
    assert result.workflow == workflow
    assert result.sql.upper().startswith("SELECT COUNT(")
    assert result.rows == [(3503,)]
    stages = [s.stage for s in result.stages]
    assert stages[:3] == ["extract_keywords", "information_retriever", "generate_candidate"]
    assert stages[-1] == "select"
    assert [s.calls for s in result.stages[:3]] == [1, 0, 3]
    assert all(a.end_s <= b.start_s + 1e-9 for a, b in pairwise(result.stages))
    # every call reached the coordinator as its declared stage, and came back with usage
    # (the responder's text is shorter than max_tokens: it reports its own length)
    assert result.deadline_s is not None and result.deadline_s > 0
    async with CoordinatorClient(up.coordinator) as coordinator:
        for call in result.calls:
            assert call.query_id is not None
            info = await coordinator.get(call.query_id)
            assert call.stage in [s.step for s in info.stages]
            assert 1 <= call.completion_tokens <= 256
    assert result.calls[0].stage == "extract_keywords"
    assert result.synthetic  # every answer carries the responder's label
    # the agent closed its workflow: one session at the coordinator, holding every call,
    # whose arrival-to-finish on the cluster clock is the latency judged against the SLO
    assert result.closed is not None, "the gateway did not answer the close"
    assert result.closed["state"] == "succeeded"
    # (the chess template's stages the agent never called are skipped: counted as done)
    assert result.closed["calls_done"] == result.closed["calls_total"] >= len(result.calls)
    assert result.closed["slo_s"] == 600.0
    latency = result.closed["finished_s"] - result.closed["arrival_s"]
    assert result.cluster_latency_s == latency
    assert 0 < latency <= result.latency_s * TIME_SCALE
    assert result.slo_met is True


def _groups(result: AgentResult) -> list[list[int]]:
    groups: list[list[int]] = []
    ran = [c for c in result.candidates if c.result is not None]
    for candidate in [c for c in ran if c.result and c.result.rows] or ran:
        assert candidate.result is not None
        for group in groups:
            first = result.candidates[group[0]].result
            assert first is not None
            if results_match(candidate.result, first):
                group.append(candidate.index)
                break
        else:
            groups.append([candidate.index])
    return groups


@needs_redis_server
async def test_broken_candidates_are_revised_and_the_vote_takes_the_majority(
    up: Up, chinook_db: Path
) -> None:
    """Over the first questions (the responder misspells 30 % of its candidates and
    projects another column for 15 %), a revise prompt carries the failed SQL with SQLite's
    own error, the revised query runs, and the chosen result is the largest group's."""
    agent = _agent(up, chinook_db, candidates=5, rounds=2)
    revised = split = 0
    for question in load_questions()[:8]:
        result = await agent.answer(question.question)
        for candidate in result.candidates:
            for (round_, sql, error), (_, fixed, after) in pairwise(candidate.history):
                if error is None or not error.startswith("no such"):
                    continue
                assert error == _sqlite_error(chinook_db, sql)  # the real error, verbatim
                revise = [c for c in result.calls if c.stage == "revise" and sql in c.prompt]
                assert revise and f"Error: {error}\n" in revise[0].prompt
                assert revise[0].round == round_ + 1
                assert after is None and fixed != sql  # the revised query runs
                revised += 1
        groups = _groups(result)
        if groups:
            largest = max(len(g) for g in groups)
            chosen = next(g for g in groups if len(g) == largest)[0]
            assert result.sql == result.candidates[chosen].sql
            split += len(groups) > 1
        if revised and split:
            break
    assert revised, "no candidate was broken and revised"
    assert split, "the candidates never disagreed"
