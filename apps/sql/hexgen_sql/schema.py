"""Schema linking by lexical retrieval: which tables and columns a question is about.

- `read_schema`: a SQLite database's tables, columns, types, primary and foreign keys, a
  few sample values per text column, and an index of each text column's distinct values
  (up to a cap) for matching question words against data ("AC/DC" -> ``Artist.Name``);
- `extract_keywords`: the question's content words (lower case, stop words dropped, plurals
  stripped), quoted strings, numbers and capitalised multi-word names kept whole;
- `link_schema`: tables and columns scored by overlap of the keywords with their names
  (snake_case and CamelCase split) and values; the top tables, the tables that join them
  (shortest foreign-key paths) and the join keys between them;
- `render_schema`: compact CREATE TABLE text with sample values, for a prompt.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from hexgen_sql.sandbox import open_read_only

__all__ = [
    "Column",
    "ForeignKey",
    "LinkedSchema",
    "LinkedTable",
    "Schema",
    "Table",
    "extract_keywords",
    "link_schema",
    "name_tokens",
    "read_schema",
    "render_schema",
    "stem",
]

# fmt: off
STOP_WORDS = frozenset({
    "a", "about", "above", "after", "again", "against", "all", "also", "am", "an", "and", "any",
    "are", "as", "at", "be", "been", "before", "being", "below", "between", "both", "but", "by",
    "can", "could", "did", "do", "does", "doing", "done", "down", "during", "each", "either",
    "every", "few", "for", "from", "further", "get", "gets", "give", "had", "has", "have",
    "having", "he", "her", "here", "hers", "him", "his", "how", "i", "if", "in", "into", "is",
    "it", "its", "itself", "just", "list", "many", "may", "me", "more", "most", "much",
    "must", "my", "no", "nor", "not", "of", "off", "on", "once", "one", "only", "or", "other",
    "our", "out", "over", "own", "per", "please", "return", "returns", "same", "shall", "she",
    "should", "show", "so", "some", "such", "than", "that", "the", "their", "them", "then",
    "there", "these", "they", "this", "those", "through", "to", "too", "under", "until", "up",
    "us", "very", "was", "we", "were", "what", "whatever", "when", "where", "whether", "which",
    "while", "who", "whom", "whose", "why", "will", "with", "would", "you", "your", "find",
    "display", "tell", "provide",
})
# fmt: on
"""Function words and request verbs: never evidence for a table or column."""

_WORD = re.compile(r"[^\W_]+(?:[/&'.\-][^\W_]+)*")
_NUMBER = re.compile(r"^\d+(?:\.\d+)?$")
_QUOTED = re.compile(r"(?<!\w)\"([^\"]+)\"|(?<!\w)'([^']+)'(?!\w)")
_CAMEL = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+")
_TEXT_TYPES = ("CHAR", "CLOB", "TEXT")


def stem(word: str) -> str:
    """A crude singular: countries -> country, addresses -> address, tracks -> track; words
    of 3 letters or fewer, numbers and words with punctuation are left alone."""
    if len(word) <= 3 or not word.isalpha():
        return word
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "y"
    if word.endswith(("sses", "xes", "ches", "shes", "zes")):
        return word[:-2]
    if word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    return word


def name_tokens(name: str) -> list[str]:
    """The words of an identifier, lower case and stemmed: ``InvoiceLine`` -> [invoice,
    line], ``billing_postal_code`` -> [billing, postal, code], ``MediaTypeId`` -> [media,
    type, id]."""
    words: list[str] = []
    for part in re.split(r"[\W_]+", name):
        words.extend(_CAMEL.findall(part))
    return [stem(w.lower()) for w in words if w]


def _words(text: str) -> list[str]:
    return [m.group(0).lower() for m in _WORD.finditer(text)]


def extract_keywords(question: str) -> list[str]:
    """The question's keywords, in order of first appearance, without duplicates: quoted
    strings (whole, lower case), runs of two or more capitalised words ("Iron Maiden" ->
    "iron maiden", besides "iron" and "maiden"), numbers, and the other words lower case
    and singular ("'s" dropped), stop words dropped."""
    found: list[str] = []
    for match in _QUOTED.finditer(question):
        found.append((match.group(1) or match.group(2)).strip().lower())
    unquoted = _QUOTED.sub(" ", question)
    tokens = list(_WORD.finditer(unquoted))
    run: list[str] = []
    for index, token in enumerate([*tokens, None]):
        text = token.group(0) if token is not None else ""
        capitalised = bool(text) and (text[0].isupper() or text[0].isdigit()) and index > 0
        if capitalised and text.lower() not in STOP_WORDS:
            run.append(text.lower())
            continue
        if len(run) >= 2:
            found.append(" ".join(run))
        run = []
    for token in tokens:
        word = token.group(0).lower().replace("’", "'").removesuffix("'s")
        if word in STOP_WORDS:
            continue
        found.append(word if _NUMBER.match(word) else stem(word))
    return list(dict.fromkeys(k for k in found if k))


# --- the schema ------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    """One column; `samples` are a few distinct values (text columns only) and `values`
    all its distinct values (by lower-case spelling) when there are at most
    `read_schema`'s cap."""

    name: str
    type: str
    primary_key: bool = False
    not_null: bool = False
    samples: tuple[str, ...] = ()
    values: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    """Distinct values by their lower-case spelling (empty past the cap)."""

    @property
    def is_text(self) -> bool:
        return any(t in self.type.upper() for t in _TEXT_TYPES)

    @cached_property
    def value_words(self) -> dict[str, int]:
        """Word of the values -> how many distinct values hold it (computed once)."""
        counts: dict[str, int] = {}
        for value in self.values:
            for word in set(_words(value)):
                counts[word] = counts.get(word, 0) + 1
        return counts


@dataclass(frozen=True)
class ForeignKey:
    """``table.column`` refers to ``ref_table.ref_column``."""

    table: str
    column: str
    ref_table: str
    ref_column: str


@dataclass(frozen=True)
class Table:
    name: str
    columns: tuple[Column, ...]
    foreign_keys: tuple[ForeignKey, ...] = ()

    def column(self, name: str) -> Column:
        for column in self.columns:
            if column.name.lower() == name.lower():
                return column
        raise KeyError(f"{self.name} has no column {name}")

    @property
    def primary_key(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.primary_key)


@dataclass(frozen=True)
class Schema:
    tables: tuple[Table, ...]

    def table(self, name: str) -> Table:
        for table in self.tables:
            if table.name.lower() == name.lower():
                return table
        raise KeyError(f"no table {name}")

    @property
    def foreign_keys(self) -> tuple[ForeignKey, ...]:
        return tuple(fk for table in self.tables for fk in table.foreign_keys)


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def read_schema(path: str | Path, *, samples: int = 3, max_values: int = 5000) -> Schema:
    """The schema of the SQLite database at `path` (read-only): every table but SQLite's
    own, `samples` sample values per text column, and each text column's distinct values
    when it has at most `max_values` of them (for value matching)."""
    conn = open_read_only(path)
    try:
        names = [
            row[0]
            for row in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' "
                "AND name NOT LIKE 'sqlite_%' ORDER BY rowid"
            )
        ]

        def _pk(table: str) -> str:
            info = conn.execute(f"PRAGMA table_info({_quote(table)})").fetchall()
            keys = [row[1] for row in sorted(info, key=lambda row: row[5]) if row[5]]
            return str(keys[0]) if keys else "rowid"

        tables: list[Table] = []
        for name in names:
            info = conn.execute(f"PRAGMA table_info({_quote(name)})").fetchall()
            fks = conn.execute(f"PRAGMA foreign_key_list({_quote(name)})").fetchall()
            # (id, seq, table, from, to, ...); `to` is None for "REFERENCES t" alone,
            # which means t's primary key
            foreign_keys = tuple(
                ForeignKey(name, fk[3], fk[2], fk[4] if fk[4] is not None else _pk(fk[2]))
                for fk in sorted(fks, key=lambda fk: (fk[0], fk[1]))
            )
            columns: list[Column] = []
            for _cid, cname, ctype, notnull, _default, pk in info:
                column = Column(cname, ctype or "", bool(pk), bool(notnull))
                if column.is_text:
                    q = f"SELECT DISTINCT {_quote(cname)} FROM {_quote(name)} "
                    q += f"WHERE {_quote(cname)} IS NOT NULL"
                    distinct = [str(v[0]) for v in conn.execute(f"{q} LIMIT {max_values + 1}")]
                    column = Column(
                        cname,
                        ctype or "",
                        bool(pk),
                        bool(notnull),
                        tuple(distinct[:samples]),
                        {v.lower(): v for v in distinct} if len(distinct) <= max_values else {},
                    )
                columns.append(column)
            tables.append(Table(name, tuple(columns), foreign_keys))
    finally:
        conn.close()
    return Schema(tuple(tables))


# --- linking -----------------------------------------------------------------------------

NAME_WEIGHT = 3.0
"""A keyword that is a table's name (a share of it for one of several words: InvoiceLine)."""
COLUMN_NAME_WEIGHT = 1.5
"""A keyword that is a word of a column's name (key columns aside)."""
VALUE_WEIGHT = 3.0
"""A keyword that is one of a column's values, whole (case-insensitive)."""
VALUE_WORD_WEIGHT = 1.0
"""A keyword that is a word of a few of a column's values."""
COMMON_VALUE_SHARE = 0.02
COMMON_VALUE_MIN = 3
"""A value word found in more than this share of a column's values, and in more than
`COMMON_VALUE_MIN` of them, counts half."""


@dataclass(frozen=True)
class LinkedTable:
    """A chosen table, the columns kept, its score, and why it was chosen: matched
    keywords, or "join" for a table that only connects others."""

    table: Table
    columns: tuple[Column, ...]
    score: float
    reasons: tuple[str, ...]
    matched_values: dict[str, tuple[str, ...]] = field(
        default_factory=dict, compare=False, hash=False
    )


@dataclass(frozen=True)
class LinkedSchema:
    tables: tuple[LinkedTable, ...]
    foreign_keys: tuple[ForeignKey, ...]

    @property
    def table_names(self) -> tuple[str, ...]:
        return tuple(t.table.name for t in self.tables)


def _column_score(
    column: Column, keywords: Sequence[str], index: dict[str, int], *, key: bool
) -> tuple[float, list[str], list[str]]:
    """(score, matched keywords, matched values) of one column."""
    score = 0.0
    reasons: list[str] = []
    values: list[str] = []
    # keys echo table names (AlbumId, ArtistId): the table's own name counts for them
    tokens = set() if key else set(name_tokens(column.name)) - {"id"}
    for keyword in keywords:
        if keyword in tokens:
            score += COLUMN_NAME_WEIGHT
            reasons.append(keyword)
        if not column.values:
            continue
        if keyword in column.values:
            score += VALUE_WEIGHT
            reasons.append(f"{keyword} (value)")
            values.append(column.values[keyword])
        elif " " not in keyword and keyword in index:
            common = index[keyword] > max(COMMON_VALUE_MIN, COMMON_VALUE_SHARE * len(column.values))
            score += VALUE_WORD_WEIGHT * (0.5 if common else 1.0)
            reasons.append(f"{keyword} (in values)")
    return score, reasons, values


def _path(graph: dict[str, set[str]], sources: set[str], target: str) -> list[str]:
    """A shortest path from any of `sources` to `target` in `graph` (tables linked by
    foreign keys), or [] when there is none."""
    previous: dict[str, str | None] = dict.fromkeys(sources)
    queue = deque(sorted(sources))
    while queue:
        node = queue.popleft()
        if node == target:
            path = [node]
            while (before := previous[path[-1]]) is not None:
                path.append(before)
            return path[::-1]
        for nxt in sorted(graph.get(node, ())):
            if nxt not in previous:
                previous[nxt] = node
                queue.append(nxt)
    return []


def link_schema(
    schema: Schema,
    keywords: Iterable[str],
    top_k: int = 4,
    *,
    column_top_k: int | None = None,
    min_score_ratio: float = 0.3,
) -> LinkedSchema:
    """The tables (at most `top_k` by score, each scoring at least `min_score_ratio` of the
    best, plus those needed to join them) and columns that `keywords` point at. With
    `column_top_k`, each table keeps its `column_top_k` best-scoring columns besides its
    keys; by default all its columns. When no keyword matches anything, the whole schema.
    A self-referencing key (Employee.ReportsTo) is kept with its table."""
    words = [k.lower() for k in keywords if k]
    scored: dict[str, tuple[float, list[str], dict[str, float], dict[str, tuple[str, ...]]]] = {}
    for table in schema.tables:
        table_tokens = name_tokens(table.name)
        keys = set(table.primary_key) | {fk.column for fk in table.foreign_keys}
        score = 0.0
        reasons: list[str] = []
        for keyword in words:
            if keyword == table.name.lower():
                share = 1.0
            else:
                share = sum(t == keyword for t in table_tokens) / max(1, len(table_tokens))
            if share > 0:
                score += NAME_WEIGHT * share
                reasons.append(keyword)
        column_scores: dict[str, float] = {}
        matched: dict[str, tuple[str, ...]] = {}
        for column in table.columns:
            c_score, c_reasons, c_values = _column_score(
                column, words, column.value_words, key=column.name in keys
            )
            column_scores[column.name] = c_score
            score += c_score
            reasons.extend(f"{column.name}: {r}" for r in c_reasons)
            if c_values:
                matched[column.name] = tuple(c_values)
        scored[table.name] = (score, reasons, column_scores, matched)

    ranked = sorted(
        (name for name, entry in scored.items() if entry[0] > 0),
        key=lambda name: (-scored[name][0], name),
    )
    if ranked:
        floor = min_score_ratio * scored[ranked[0]][0]
        ranked = [name for name in ranked if scored[name][0] >= floor]
    chosen = ranked[: max(1, top_k)]
    if not chosen:
        chosen = [t.name for t in schema.tables]

    graph: dict[str, set[str]] = {}
    for fk in schema.foreign_keys:
        if fk.table != fk.ref_table:
            graph.setdefault(fk.table, set()).add(fk.ref_table)
            graph.setdefault(fk.ref_table, set()).add(fk.table)
    selected = [chosen[0]]
    for name in chosen[1:]:
        if name in selected:
            continue
        path = _path(graph, set(selected), name)
        selected.extend(n for n in (path or [name]) if n not in selected)

    selected_set = set(selected)
    joins = tuple(
        fk
        for fk in schema.foreign_keys
        if fk.table in selected_set and fk.ref_table in selected_set
    )
    linked: list[LinkedTable] = []
    for name in selected:
        table = schema.table(name)
        score, reasons, column_scores, matched = scored[name]
        keys = set(table.primary_key)
        keys.update(fk.column for fk in joins if fk.table == name)
        keys.update(fk.ref_column for fk in joins if fk.ref_table == name)
        if column_top_k is None:
            columns = table.columns
        else:
            best = sorted(
                (c for c in table.columns if column_scores[c.name] > 0),
                key=lambda c: -column_scores[c.name],
            )[:column_top_k]
            keep = keys | {c.name for c in best}
            columns = tuple(c for c in table.columns if c.name in keep)
        linked.append(
            LinkedTable(
                table,
                columns,
                score,
                tuple(reasons) if name in chosen else ("join",),
                matched,
            )
        )
    return LinkedSchema(tuple(linked), joins)


# --- rendering ---------------------------------------------------------------------------


def _literal(value: str, limit: int = 40) -> str:
    text = value if len(value) <= limit else value[: limit - 1] + "…"
    return "'" + text.replace("'", "''") + "'"


def render_schema(linked: LinkedSchema | Schema) -> str:
    """Compact CREATE TABLE statements for a prompt: types, keys, references, and a comment
    with sample values on text columns (matched values first)."""
    tables: list[tuple[Table, tuple[Column, ...], dict[str, tuple[str, ...]]]]
    if isinstance(linked, Schema):
        tables = [(t, t.columns, {}) for t in linked.tables]
    else:
        tables = [(t.table, t.columns, t.matched_values) for t in linked.tables]
    blocks: list[str] = []
    for table, columns, matched in tables:
        refs = {fk.column: fk for fk in table.foreign_keys}
        single_pk = len(table.primary_key) == 1
        lines: list[str] = []
        for column in columns:
            line = f"  {column.name} {column.type}".rstrip()
            if column.primary_key and single_pk:
                line += " PRIMARY KEY"
            if column.name in refs:
                fk = refs[column.name]
                line += f" REFERENCES {fk.ref_table}({fk.ref_column})"
            lines.append(line)
        if not single_pk and table.primary_key:
            lines.append(f"  PRIMARY KEY ({', '.join(table.primary_key)})")
        rendered: list[str] = []
        for index, line in enumerate(lines):
            comma = "," if index < len(lines) - 1 else ""
            described = columns[index] if index < len(columns) else None
            examples: list[str] = []
            if described is not None and described.is_text:
                hits = matched.get(described.name, ())
                examples = list(dict.fromkeys([*hits, *described.samples]))[:3]
            note = f" -- e.g. {', '.join(_literal(e) for e in examples)}" if examples else ""
            rendered.append(f"{line}{comma}{note}")
        blocks.append(f"CREATE TABLE {table.name} (\n" + "\n".join(rendered) + "\n);")
    return "\n".join(blocks)
