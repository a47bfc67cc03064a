"""Natural-language questions over Chinook with gold SQL (package data,
``hexgen_sql/data/chinook_questions.jsonl``).

One JSON object a line: ``id`` (unique), ``question``, ``sql`` (the gold query, SQLite),
``difficulty`` (easy: one table; medium: joins of two or three tables, GROUP BY/HAVING,
dates; hard: three or more tables, subqueries, CTEs, window functions) and, optionally,
``rows``: how many rows the gold query returns on the database that
``scripts/build_chinook.py`` builds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

__all__ = ["DIFFICULTIES", "Question", "load_questions"]

DIFFICULTIES = ("easy", "medium", "hard")
CHINOOK_QUESTIONS = "chinook_questions.jsonl"


@dataclass(frozen=True, slots=True)
class Question:
    id: str
    question: str
    sql: str
    difficulty: str
    rows: int | None = None


def _parse(line: str, where: str) -> Question:
    try:
        record = json.loads(line)
    except ValueError as error:
        raise ValueError(f"{where}: not JSON: {error}") from error
    if not isinstance(record, dict):
        raise ValueError(f"{where}: not a JSON object")
    for key in ("id", "question", "sql", "difficulty"):
        if not isinstance(record.get(key), str) or not record[key].strip():
            raise ValueError(f"{where}: {key!r} must be a non-empty string")
    if record["difficulty"] not in DIFFICULTIES:
        raise ValueError(f"{where}: difficulty must be one of {', '.join(DIFFICULTIES)}")
    rows = record.get("rows")
    if rows is not None and (not isinstance(rows, int) or isinstance(rows, bool) or rows < 0):
        raise ValueError(f"{where}: rows must be a non-negative integer")
    unknown = set(record) - {"id", "question", "sql", "difficulty", "rows"}
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    return Question(record["id"], record["question"], record["sql"], record["difficulty"], rows)


def load_questions(path: str | Path | None = None) -> list[Question]:
    """The questions in the JSON-lines file at `path` (default: the Chinook set shipped
    with the package); `ValueError` on a malformed line or a repeated id."""
    if path is None:
        text = resources.files("hexgen_sql").joinpath("data", CHINOOK_QUESTIONS)
        content, name = text.read_text(encoding="utf-8"), CHINOOK_QUESTIONS
    else:
        content, name = Path(path).read_text(encoding="utf-8"), str(path)
    questions: list[Question] = []
    seen: set[str] = set()
    for number, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue
        question = _parse(line, f"{name}:{number}")
        if question.id in seen:
            raise ValueError(f"{name}:{number}: repeated id {question.id!r}")
        seen.add(question.id)
        questions.append(question)
    return questions
