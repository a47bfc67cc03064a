"""The synthetic responder: plausible text for the Text-to-SQL agent's prompts, so that the
agent's whole pipeline (the SQL sandbox included) runs on simulated engines, in CI,
without a model. It is SYNTHETIC TEXT FROM HEURISTICS, NOT A MODEL.

It recognises the agent's prompts by their marker line (the contract in
docs/text-to-sql.md, "The prompt contract"; the agent's side is
``hexgen_sql.prompts``, which a worker may not import, so this module parses the text
itself)::

    ### hexgen-sql-agent v1 task=<keywords|candidate|revise> [candidate=<i>] [round=<r>]

and answers:

- ``keywords``: a JSON array of the question's words (stop words dropped, plurals stripped,
  quoted strings and runs of capitalised words kept whole);
- ``candidate``: one SQL query in a ```sql fence, built from the question and the CREATE
  TABLE text of the prompt: the best-matching table by name, filters on sample values that
  the question quotes, joins along REFERENCES, COUNT/AVG/SUM/MAX/MIN for "how many",
  "average", "total", "highest", "lowest", LIMIT for "top N". A share `BROKEN_SHARE` of the
  candidates get one identifier deliberately misspelt (``Name`` -> ``Nmae``), so that SQLite
  fails with "no such column" and revise rounds happen, and a share `ALTERNATIVE_SHARE`
  project another column, so that the agent's vote has something to decide;
- ``revise``: for "no such column/table: X", the query with X replaced by the closest name of
  the schema; for any other error, the heuristic query again, unbroken.

Every answer starts with the line `LABEL` (``-- synthetic text from hexgen-flow's simulated
engine: heuristics, not a model``), so that whoever reads it, the agent included, can tell.
Answers are deterministic: every choice is drawn from a generator seeded by the prompt's
SHA-256. Any other prompt gets None (the simulated engine keeps its placeholder text).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import random
import re
from collections import deque
from dataclasses import dataclass

__all__ = [
    "AGENT_MARKER",
    "ALTERNATIVE_SHARE",
    "BROKEN_SHARE",
    "LABEL",
    "SqlColumn",
    "SqlTable",
    "heuristic_sql",
    "is_agent_prompt",
    "parse_schema",
    "respond",
]

AGENT_MARKER = "### hexgen-sql-agent v1"
LABEL = "-- synthetic text from hexgen-flow's simulated engine: heuristics, not a model"
"""The first line of every answer (an SQL comment: harmless before a query)."""
BROKEN_SHARE = 0.3
"""Share of candidate answers with one identifier misspelt (fails in SQLite)."""
ALTERNATIVE_SHARE = 0.15
"""Share of candidate answers that project another column (a different result)."""

_TASK = re.compile(r"### hexgen-sql-agent v1 task=(\w+)([ \t]+\w+=\w+)*")
_QUESTION = re.compile(r"^Question: (.*)$", re.MULTILINE)
_TABLE = re.compile(r"CREATE TABLE (\w+) \(\n(.*?)\n\);", re.DOTALL)
_SAMPLE = re.compile(r"'((?:[^']|'')*)'")
_REFERENCES = re.compile(r"REFERENCES (\w+)\((\w+)\)")
_FAILED = re.compile(r"^Query:\n```sql\n(.*?)\n```$", re.DOTALL | re.MULTILINE)
_ERROR = re.compile(r"^Error: (.*)$", re.MULTILINE)
_MISSING = re.compile(r"no such (column|table): ([\w.]+)")
_WORD = re.compile(r"[^\W_]+(?:[/&'.\-][^\W_]+)*")
_CAMEL = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+")
_TOP = re.compile(r"\b(?:top|first|last)\s+(\d+)\b", re.IGNORECASE)
_EACH = re.compile(r"\b(?:each|per|every)\s+(\w+(?:\s+\w+)?)")
_NUMERIC = ("INT", "REAL", "NUMERIC", "DECIMAL", "FLOAT", "DOUBLE")
# fmt: off
_STOP = frozenset({
    "a", "all", "an", "and", "any", "are", "as", "at", "be", "by", "can", "did", "do",
    "does", "each", "for", "from", "give", "has", "have", "how", "in", "is", "it", "its",
    "list", "many", "me", "much", "of", "on", "or", "show", "that", "the", "their", "them",
    "there", "these", "this", "those", "to", "was", "were", "what", "when", "where", "which",
    "who", "whose", "with", "find", "tell", "please", "return", "database", "name", "names",
})
_AGGREGATES = (
    ("COUNT", ("how many", "number of", "count")),
    ("AVG", ("average", "mean")),
    ("MAX", ("maximum", "highest", "largest", "most expensive", "longest", "latest")),
    ("MIN", ("minimum", "lowest", "smallest", "cheapest", "shortest", "earliest")),
    ("SUM", ("total", "sum of", "combined")),
)
# fmt: on


@dataclass(frozen=True, slots=True)
class SqlColumn:
    name: str
    type: str
    samples: tuple[str, ...] = ()
    ref: tuple[str, str] | None = None
    """(table, column) it REFERENCES."""
    primary_key: bool = False

    @property
    def numeric(self) -> bool:
        return any(t in self.type.upper() for t in _NUMERIC)

    @property
    def text(self) -> bool:
        return any(t in self.type.upper() for t in ("CHAR", "TEXT", "CLOB"))


@dataclass(frozen=True, slots=True)
class SqlTable:
    name: str
    columns: tuple[SqlColumn, ...]


def is_agent_prompt(prompt: str) -> bool:
    return AGENT_MARKER in prompt


def _stem(word: str) -> str:
    if len(word) <= 3 or not word.isalpha():
        return word
    if word.endswith("ies"):
        return word[:-3] + "y"
    if word.endswith(("sses", "xes", "ches", "shes")):
        return word[:-2]
    if word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    return word


def _tokens(name: str) -> list[str]:
    """CamelCase / snake_case words, lower case and singular: InvoiceLine -> invoice, line."""
    return [_stem(w.lower()) for part in re.split(r"[\W_]+", name) for w in _CAMEL.findall(part)]


def parse_schema(prompt: str) -> list[SqlTable]:
    """The CREATE TABLE blocks of a prompt (render_schema's text): columns, types, the
    REFERENCES and the sample values of the ``-- e.g.`` comments (cut ones dropped)."""
    tables: list[SqlTable] = []
    for name, body in _TABLE.findall(prompt):
        columns: list[SqlColumn] = []
        for raw in body.splitlines():
            line, _, comment = raw.partition(" -- e.g. ")
            parts = line.strip().rstrip(",").split()
            if len(parts) < 2 or parts[0] == "PRIMARY":
                continue
            samples = tuple(
                s.replace("''", "'") for s in _SAMPLE.findall(comment) if not s.endswith("…")
            )
            ref = _REFERENCES.search(line)
            columns.append(
                SqlColumn(
                    parts[0],
                    parts[1],
                    samples,
                    (ref.group(1), ref.group(2)) if ref else None,
                    "PRIMARY KEY" in line,
                )
            )
        tables.append(SqlTable(name, tuple(columns)))
    return tables


def _keywords(question: str) -> list[str]:
    found = [a or b for a, b in re.findall(r"\"([^\"]+)\"|'([^']+)'", question)]
    words = _WORD.findall(question)
    run: list[str] = []
    for index, word in enumerate([*words, ""]):
        if index > 0 and word[:1].isupper() and word.lower() not in _STOP:
            run.append(word)
            continue
        if len(run) >= 2:
            found.append(" ".join(run))
        run = []
    found += [_stem(w.lower().removesuffix("'s")) for w in words if w.lower() not in _STOP]
    return list(dict.fromkeys(k.lower() for k in found if k))


def _path(tables: list[SqlTable], start: str, goal: str) -> list[tuple[str, str, str, str]]:
    """Join steps (table, column, other table, other column) from `start` to `goal` along
    REFERENCES (either way); [] when they are not connected."""
    edges: dict[str, list[tuple[str, str, str, str]]] = {}
    for table in tables:
        for column in table.columns:
            if column.ref is not None and column.ref[0] != table.name:
                a, b = (table.name, column.name), column.ref
                edges.setdefault(a[0], []).append((a[0], a[1], b[0], b[1]))
                edges.setdefault(b[0], []).append((b[0], b[1], a[0], a[1]))
    previous: dict[str, tuple[str, str, str, str] | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if node == goal:
            steps: list[tuple[str, str, str, str]] = []
            while (step := previous[node]) is not None:
                steps.append(step)
                node = step[0]
            return steps[::-1]
        for step in edges.get(node, []):
            if step[2] not in previous:
                previous[step[2]] = step
                queue.append(step[2])
    return []


def heuristic_sql(question: str, tables: list[SqlTable], *, alternative: bool = False) -> str:
    """A SELECT for `question` over `tables` (see the module docstring); `alternative`
    projects the second choice of column."""
    if not tables:
        return "SELECT 1"
    lower = question.lower()
    words = {_stem(w.lower()) for w in _WORD.findall(question)}

    def mentioned(column: SqlColumn) -> bool:
        tokens = [t for t in _tokens(column.name) if t != "id"]
        return bool(tokens) and all(t in words for t in tokens)

    def score(table: SqlTable) -> float:
        tokens = _tokens(table.name)
        name_score = 3.0 * sum(t in words for t in tokens) / max(1, len(tokens))
        return name_score + sum(1.0 for c in table.columns if mentioned(c) and not c.ref)

    each = _EACH.search(lower)
    each_words = {_stem(w) for w in each.group(1).split()} if each else set()
    group = next((t for t in tables if set(_tokens(t.name)) <= each_words), None)
    others = [t for t in tables if t is not group] or tables
    main = max(others, key=score)  # max keeps the first of equals: the prompt's order
    filters: list[tuple[str, str, str]] = []
    taken: list[tuple[int, int]] = []
    # the main table's columns first; a value is used once, and not inside a longer one
    for table in sorted(tables, key=lambda t: t is not main):
        for column in table.columns:
            for value in sorted(column.samples, key=len, reverse=True):
                pattern = r"(?<!\w)" + re.escape(value) + r"(?!\w)"
                found = re.search(pattern, question) if len(value) >= 3 else None
                if found and not any(a <= found.start() < b for a, b in taken):
                    filters.append((table.name, column.name, value))
                    taken.append(found.span())
                    break
    joined = [main.name]
    joins: list[str] = []
    for table_name in [t for t, _, _ in filters] + ([group.name] if group else []):
        for here, col, there, other in _path(tables, main.name, table_name):
            if there not in joined:
                joined.append(there)
                joins.append(f"JOIN {there} ON {here}.{col} = {there}.{other}")
    filtered = {(t, c) for t, c, _ in filters}
    plain = [c for c in main.columns if not c.ref and not c.primary_key]
    numeric = [c for c in plain if c.numeric]
    number = next((c for c in numeric if mentioned(c)), numeric[0] if numeric else None)
    aggregate = next((fn for fn, cues in _AGGREGATES if any(c in lower for c in cues)), None)
    ranked = aggregate in ("MAX", "MIN") and number is not None and group is None
    if ranked and ("which" in words or "name" in words):
        # "the name of the longest track": the row at the top, not the extreme value
        assert number is not None
        direction = "DESC" if aggregate == "MAX" else "ASC"
        aggregate, top_n = None, f" ORDER BY {main.name}.{number.name} {direction} LIMIT 1"
    else:
        top_n = ""
    group_by = ""
    if group is not None and aggregate is not None and group.name in joined:
        label = next((c for c in group.columns if c.text), group.columns[0])
        group_by = f" GROUP BY {group.name}.{label.name}"
        fn = "COUNT(*)" if aggregate == "COUNT" or number is None else None
        select = f"{group.name}.{label.name}, " + (
            fn or f"{aggregate}({main.name}.{number.name if number else '*'})"
        )
    elif aggregate == "COUNT" or (aggregate is not None and number is None):
        select = "COUNT(*)"
    elif aggregate is not None and number is not None:
        select = f"{aggregate}({main.name}.{number.name})"
    else:
        shown = [c for c in plain if mentioned(c) and (main.name, c.name) not in filtered]
        named = [c for c in plain if c.name.lower() in ("name", "title")]
        texts = [c for c in plain if c.text]
        choices = list(dict.fromkeys([*shown, *named, *texts, *main.columns]))
        picked = choices[1:2] if alternative and len(choices) > 1 else (shown or choices[:1])
        select = ", ".join(f"{main.name}.{c.name}" for c in picked)
    sql = f"SELECT {select} FROM {main.name}"
    if joins:
        sql += " " + " ".join(joins)
    if filters:
        conditions = [f"{t}.{c} = '{v.replace(chr(39), chr(39) * 2)}'" for t, c, v in filters]
        sql += " WHERE " + " AND ".join(conditions)
    sql += group_by + top_n
    top = _TOP.search(question)
    if top and aggregate is None and not top_n:
        if number is not None:
            sql += f" ORDER BY {main.name}.{number.name} DESC"
        sql += f" LIMIT {int(top.group(1))}"
    return sql


def _misspell(name: str, known: set[str]) -> str:
    wrong = name[0] + name[2] + name[1] + name[3:] if len(name) >= 4 else name + "s"
    while wrong == name or wrong.lower() in known:
        wrong += "s"
    return wrong


def _break(sql: str, tables: list[SqlTable], rng: random.Random) -> str:
    """`sql` with one identifier misspelt: a qualified column where there is one, else the
    table after FROM."""
    known = {t.name.lower() for t in tables} | {c.name.lower() for t in tables for c in t.columns}
    refs = list(re.finditer(r"\b(\w+)\.(\w+)\b", sql))
    if refs:
        ref = rng.choice(refs)
        return sql[: ref.start(2)] + _misspell(ref.group(2), known) + sql[ref.end(2) :]
    match = re.search(r"\bFROM (\w+)", sql)
    if match is None:
        return sql + " FROM nowhere"
    return sql[: match.start(1)] + _misspell(match.group(1), known) + sql[match.end(1) :]


def _revise(prompt: str, question: str, tables: list[SqlTable]) -> str:
    failed = _FAILED.search(prompt)
    error = _ERROR.search(prompt)
    sql = failed.group(1).strip() if failed else ""
    missing = _MISSING.search(error.group(1)) if error else None
    if sql and missing:
        wrong = missing.group(2).rsplit(".", 1)[-1]
        if missing.group(1) == "column":
            names = sorted({c.name for t in tables for c in t.columns})
        else:
            names = [t.name for t in tables]
        close = difflib.get_close_matches(wrong, names, n=1, cutoff=0.5)
        if close:
            return re.sub(rf"\b{re.escape(wrong)}\b", close[0], sql)
    return heuristic_sql(question, tables)


def respond(prompt: str) -> str | None:
    """The synthetic answer to an agent prompt; None for any other prompt."""
    task = _TASK.search(prompt)
    if task is None:
        return None
    seed = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big")
    rng = random.Random(seed)
    found = _QUESTION.search(prompt)
    question = found.group(1).strip() if found else ""
    kind = task.group(1)
    if kind == "keywords":
        return f"{LABEL}\n{json.dumps(_keywords(question), ensure_ascii=False)}"
    tables = parse_schema(prompt)
    if kind == "candidate":
        draw = rng.random()
        alternative = BROKEN_SHARE <= draw < BROKEN_SHARE + ALTERNATIVE_SHARE
        sql = heuristic_sql(question, tables, alternative=alternative)
        if draw < BROKEN_SHARE:
            sql = _break(sql, tables, rng)
        return f"{LABEL}\n```sql\n{sql}\n```"
    if kind == "revise":
        return f"{LABEL}\n```sql\n{_revise(prompt, question, tables)}\n```"
    return None
