"""The Text-to-SQL agent's prompts, and how its answers are read back.

The prompts are a contract (docs/text-to-sql.md, "The prompt contract"): the synthetic
responder of the simulated engine (``hexgen_worker.engines.responder``) recognises them by
their first line and parses them itself, since the worker may not import this package. Any
model reads them as plain instructions. Each user message is::

    ### hexgen-sql-agent v1 task=<keywords|candidate|revise> [candidate=<i>] [round=<r>]
    Question: <the question, on one line>
    Schema:                              (candidate and revise)
    CREATE TABLE ... (render_schema's text)
    End of schema.
    Query:                               (revise: the failed query, in a ```sql fence)
    ```sql
    ...
    ```
    Error: <the sandbox's one-line reason, or "the query returned no rows">
    <one line saying what to answer>

``candidate=<i>`` makes the N candidate prompts differ, so that a sampler seeded by the
prompt (the responder) gives each its own answer.
"""

from __future__ import annotations

import json
import re

__all__ = [
    "MARKER",
    "NO_ROWS",
    "SYNTHETIC_LABEL",
    "SYSTEM",
    "candidate_prompt",
    "extract_sql",
    "keywords_prompt",
    "parse_keywords",
    "revise_prompt",
]

MARKER = "### hexgen-sql-agent v1"
"""The first line of every agent prompt starts with this (then ``task=...``)."""
SYSTEM = (
    "You are a careful Text-to-SQL assistant for SQLite. Use only the tables and columns "
    "of the schema given. Answer exactly in the form asked, without explanations."
)
SYNTHETIC_LABEL = "-- synthetic text from hexgen-flow's simulated engine"
"""How the simulated engine's synthetic responder starts every answer (no model wrote it)."""
NO_ROWS = "the query returned no rows"
"""The revise prompt's error line for a query that ran but found nothing."""

MAX_KEYWORDS = 30
"""More keywords than this is not a keyword list (a model that rambled)."""
MAX_KEYWORD_CHARS = 60
MAX_KEYWORD_WORDS = 4
"""A longer item is a sentence, not a keyword."""

_FENCE = re.compile(r"```[ \t]*([A-Za-z]*)[ \t]*\n?(.*?)(?:```|$)", re.DOTALL)
_SQL_START = re.compile(r"\b(SELECT|WITH)\b", re.IGNORECASE)
_ARRAY = re.compile(r"\[[^\[\]]*\]", re.DOTALL)
_BULLET = re.compile(r"^\s*(?:[-*•]|\d+[.)])\s*")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def keywords_prompt(question: str) -> str:
    return (
        f"{MARKER} task=keywords\n"
        f"Question: {_one_line(question)}\n"
        "List the question's keywords (names, quoted values, numbers and the nouns that may "
        "name tables or columns) as a JSON array of strings, and nothing else."
    )


def _schema_block(schema_text: str) -> str:
    return f"Schema:\n{schema_text.strip()}\nEnd of schema.\n"


def candidate_prompt(question: str, schema_text: str, index: int) -> str:
    return (
        f"{MARKER} task=candidate candidate={index}\n"
        f"Question: {_one_line(question)}\n"
        f"{_schema_block(schema_text)}"
        "Write one SQLite SELECT query that answers the question. Answer with the query in "
        "a ```sql block and nothing else."
    )


def revise_prompt(question: str, schema_text: str, sql: str, error: str, round_: int) -> str:
    return (
        f"{MARKER} task=revise round={round_}\n"
        f"Question: {_one_line(question)}\n"
        f"{_schema_block(schema_text)}"
        f"Query:\n```sql\n{sql.strip()}\n```\n"
        f"Error: {_one_line(error)}\n"
        "Fix the query so that it runs on this schema and answers the question. Answer with "
        "the corrected query in a ```sql block and nothing else."
    )


def _cut_statement(text: str) -> str:
    """`text` up to its first `;` outside quotes (or a blank line: prose after the query)."""
    quote = ""
    for index, char in enumerate(text):
        if quote:
            if char == quote:
                quote = ""
        elif char in "'\"`":
            quote = char
        elif char == ";" or text.startswith("\n\n", index):
            return text[:index]
    return text


def extract_sql(answer: str) -> str | None:
    """The SQL query in a model's answer: the first fenced block holding SELECT/WITH (a
    ```sql fence preferred), else the text from the first SELECT/WITH on; None when the
    answer holds no query."""
    fences = [(lang.lower(), body) for lang, body in _FENCE.findall(answer)]
    ordered = [f for f in fences if f[0] == "sql"] + [f for f in fences if f[0] != "sql"]
    for _lang, body in ordered:
        start = _SQL_START.search(body)
        if start:
            sql = _cut_statement(body[start.start() :]).strip()
            if sql:
                return sql
    start = _SQL_START.search(answer)
    if start is None:
        return None
    sql = _cut_statement(answer[start.start() :]).strip().rstrip("`").strip()
    return sql or None


def _clean(item: str) -> str:
    return _BULLET.sub("", item).strip().strip("\"'`").strip().lower()


def parse_keywords(answer: str) -> list[str] | None:
    """The keywords of a model's answer: a JSON array of strings, else one item a line or
    comma-separated; None when nothing usable came back (the caller falls back)."""
    items: list[str] = []
    for match in _ARRAY.finditer(answer):
        try:
            parsed = json.loads(match.group(0))
        except ValueError:
            continue
        if isinstance(parsed, list) and all(isinstance(p, str) for p in parsed):
            items = [_clean(p) for p in parsed]
            break
    else:
        text = answer.replace("```", "\n")
        pieces = [p for line in text.splitlines() for p in line.split(",")]
        items = [_clean(p) for p in pieces]
    keywords = [
        k
        for k in dict.fromkeys(items)
        if k and len(k) <= MAX_KEYWORD_CHARS and len(k.split()) <= MAX_KEYWORD_WORDS
    ]
    if not keywords or len(keywords) > MAX_KEYWORDS:
        return None
    return keywords
