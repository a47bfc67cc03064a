"""Run model-written SQL against a SQLite database without letting it change anything.

Every query gets its own connection, opened read-only at the file level
(``file:PATH?mode=ro``), with ``PRAGMA query_only=ON`` and an authorizer that allows reading
and a list of pure functions and nothing else (no ATTACH, no PRAGMA, no writes, no schema
changes, no ``load_extension``). Before SQLite sees the text, it must be exactly one
statement that starts with SELECT or WITH. A progress handler aborts a query past its wall
time, and rows are fetched only up to a limit (the result says whether it was cut).

Whatever is refused or fails raises `SandboxError`, whose `reason` is one line meant to go
back into a revise prompt ("only SELECT or WITH statements may run", ``near "FROM": syntax
error``, "query ran longer than 2.0 s"). See docs/text-to-sql.md.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ALLOWED_FUNCTIONS",
    "QueryResult",
    "Sandbox",
    "SandboxError",
    "check_statement",
    "open_read_only",
    "run_query",
    "strip_code",
]

DEFAULT_TIME_LIMIT_S = 2.0
DEFAULT_MAX_ROWS = 1000
MAX_VALUE_BYTES = 10_000_000
"""SQLITE_LIMIT_LENGTH per connection: no string or blob bigger than this (memory bombs)."""
MAX_SQL_BYTES = 1_000_000
"""SQLITE_LIMIT_SQL_LENGTH per connection: the longest statement SQLite will compile."""
PROGRESS_EVERY_N_OPS = 1000
"""How many VM instructions run between two checks of the wall clock."""

ALLOWED_FUNCTIONS: frozenset[str] = frozenset(
    {
        # aggregates
        "avg", "count", "group_concat", "string_agg", "max", "min", "sum", "total",
        # core scalar functions (no randomblob/zeroblob: allocation; no load_extension)
        "abs", "char", "coalesce", "concat", "concat_ws", "format", "glob", "hex", "ifnull",
        "iif", "instr", "length", "like", "likelihood", "likely", "lower", "ltrim",
        "nullif", "octet_length", "printf", "quote", "random", "replace", "round", "rtrim",
        "sign", "soundex", "substr", "substring", "trim", "typeof", "unicode", "unlikely",
        "upper", "unhex", "sqlite_version",
        # dates and times
        "date", "datetime", "julianday", "strftime", "time", "timediff", "unixepoch",
        # math
        "acos", "acosh", "asin", "asinh", "atan", "atan2", "atanh", "ceil", "ceiling", "cos",
        "cosh", "degrees", "exp", "floor", "ln", "log", "log10", "log2", "mod", "pi", "pow",
        "power", "radians", "sin", "sinh", "sqrt", "tan", "tanh", "trunc",
        # window functions
        "cume_dist", "dense_rank", "first_value", "lag", "last_value", "lead", "nth_value",
        "ntile", "percent_rank", "rank", "row_number",
        # JSON (read-only)
        "json", "json_array", "json_array_length", "json_extract", "json_object", "json_type",
        "json_valid", "json_quote", "json_group_array", "json_group_object", "json_each",
        "json_tree",
    }
)  # fmt: skip
"""Functions a query may call (lower case). Everything else is refused by the authorizer."""

_ALLOWED_ACTIONS = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE})

_ACTION_NAMES: dict[int, str] = {
    sqlite3.SQLITE_ATTACH: "ATTACH",
    sqlite3.SQLITE_DETACH: "DETACH",
    sqlite3.SQLITE_PRAGMA: "PRAGMA",
    sqlite3.SQLITE_INSERT: "INSERT",
    sqlite3.SQLITE_UPDATE: "UPDATE",
    sqlite3.SQLITE_DELETE: "DELETE",
    sqlite3.SQLITE_TRANSACTION: "transaction control",
    sqlite3.SQLITE_SAVEPOINT: "SAVEPOINT",
    sqlite3.SQLITE_ANALYZE: "ANALYZE",
    sqlite3.SQLITE_REINDEX: "REINDEX",
    sqlite3.SQLITE_ALTER_TABLE: "ALTER TABLE",
}


_WRITES = frozenset({sqlite3.SQLITE_INSERT, sqlite3.SQLITE_UPDATE, sqlite3.SQLITE_DELETE})
_SCHEMA_TABLES = frozenset({"sqlite_master", "sqlite_schema", "sqlite_temp_master"})


def _best_denial(denials: list[str]) -> str:
    """The denial to report: a PRAGMA before anything else, else the first."""
    return next((d for d in denials if d.startswith("PRAGMA")), denials[0])


class SandboxError(Exception):
    """A query was refused or failed; `reason` is one line for a revise prompt."""

    def __init__(self, reason: str) -> None:
        self.reason = " ".join(reason.split()) or "query failed"
        super().__init__(self.reason)


@dataclass(frozen=True, slots=True)
class QueryResult:
    """What a query returned: column names, rows (at most the row limit), whether rows were
    cut off at the limit, and the wall time it took."""

    columns: tuple[str, ...]
    rows: tuple[tuple[object, ...], ...]
    truncated: bool
    elapsed_s: float


# --- lexing: strings, quoted identifiers and comments, so that `;` and keywords inside
# them are not mistaken for real ones ---------------------------------------------------


def _segments(sql: str) -> Iterator[tuple[str, str]]:
    """Split `sql` into (kind, text) pieces: kind is "code", "string" (a '...' literal or a
    "..."/`...`/[...] identifier), or "comment". An unterminated piece runs to the end."""
    i, n = 0, len(sql)
    start = 0
    while i < n:
        c = sql[i]
        if c in "'\"`[":
            if start < i:
                yield "code", sql[start:i]
            close = "]" if c == "[" else c
            j = i + 1
            while j < n:
                if sql[j] == close:
                    if close != "]" and j + 1 < n and sql[j + 1] == close:  # '' escape
                        j += 2
                        continue
                    break
                j += 1
            yield "string", sql[i : j + 1]
            i = start = j + 1
        elif sql.startswith("--", i):
            if start < i:
                yield "code", sql[start:i]
            j = sql.find("\n", i)
            j = n if j < 0 else j
            yield "comment", sql[i:j]
            i = start = j
        elif sql.startswith("/*", i):
            if start < i:
                yield "code", sql[start:i]
            j = sql.find("*/", i + 2)
            j = n if j < 0 else j + 2
            yield "comment", sql[i:j]
            i = start = j
        else:
            i += 1
    if start < n:
        yield "code", sql[start:n]


def strip_code(sql: str) -> str:
    """`sql` with comments removed and every string or quoted identifier replaced by a
    placeholder, for looking at keywords and punctuation only."""
    parts: list[str] = []
    for kind, text in _segments(sql):
        if kind == "code":
            parts.append(text)
        elif kind == "string":
            parts.append(" ? ")
        else:
            parts.append(" ")
    return "".join(parts)


def check_statement(sql: str) -> str:
    """The single statement of `sql`, without a trailing semicolon; `SandboxError` unless
    `sql` is exactly one SELECT or WITH statement (comments and whitespace aside)."""
    statement: list[str] = []
    ended = False
    for kind, text in _segments(sql):
        if kind == "comment":
            if not ended:
                statement.append(text if text.startswith("/*") else text + "\n")
            continue
        if kind == "string":
            if ended:
                raise SandboxError("only one SQL statement may run at a time")
            statement.append(text)
            continue
        head, sep, tail = text.partition(";")
        if ended:
            if text.replace(";", "").strip():
                raise SandboxError("only one SQL statement may run at a time")
            continue
        statement.append(head)
        if sep:
            ended = True
            if tail.replace(";", "").strip():
                raise SandboxError("only one SQL statement may run at a time")
    text = "".join(statement).strip()
    words = strip_code(text).split()
    if not words:
        raise SandboxError("the query is empty")
    first = words[0].split("(")[0].upper()
    if first not in {"SELECT", "WITH"}:
        raise SandboxError("only SELECT or WITH statements may run")
    return text


# --- connections -------------------------------------------------------------------


def _authorizer(
    denials: list[str],
) -> Callable[[int, str | None, str | None, str | None, str | None], int]:
    def authorize(
        action: int, arg1: str | None, arg2: str | None, _db: str | None, _trigger: str | None
    ) -> int:
        if action in _ALLOWED_ACTIONS:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_FUNCTION and arg2 is not None:
            if arg2.lower() in ALLOWED_FUNCTIONS:
                return sqlite3.SQLITE_OK
            denials.append(f"function {arg2}() is not allowed")
            return sqlite3.SQLITE_DENY
        name = _ACTION_NAMES.get(action)
        if name is None:
            denials.append("only reading statements are allowed (no schema changes)")
        elif action == sqlite3.SQLITE_PRAGMA:
            denials.append(f"PRAGMA {arg1 or ''} is not allowed".replace("  ", " "))
        elif action in _WRITES and arg1 in _SCHEMA_TABLES:
            # what compiling a table-valued pragma (pragma_table_info(...)) asks first
            denials.append("schema changes and PRAGMA functions are not allowed")
        elif arg1 and action in _WRITES:
            denials.append(f"{name} of {arg1} is not allowed")
        else:
            denials.append(f"{name} is not allowed")
        return sqlite3.SQLITE_DENY

    return authorize


def open_read_only(path: str | Path) -> sqlite3.Connection:
    """A connection to the existing database file at `path` that cannot write it:
    ``mode=ro`` and ``PRAGMA query_only=ON`` (no authorizer: for trusted code such as
    schema reading; model-written SQL goes through `run_query`)."""
    file = Path(path).resolve()
    if not file.is_file():
        raise SandboxError(f"database file not found: {file}")
    try:
        conn = sqlite3.connect(
            f"{file.as_uri()}?mode=ro", uri=True, isolation_level=None, check_same_thread=False
        )
    except sqlite3.Error as error:
        raise SandboxError(f"cannot open the database: {error}") from error
    try:
        conn.execute("PRAGMA query_only=ON")
        conn.execute("SELECT count(*) FROM sqlite_master").fetchall()  # load the schema now
    except sqlite3.Error as error:
        conn.close()
        raise SandboxError(f"cannot read the database: {_one_line(error)}") from error
    return conn


def _seconds(value: float) -> str:
    """2 -> "2.0", 0.25 -> "0.25": one decimal unless more are needed."""
    return f"{value:.1f}" if round(value, 1) == value else f"{value:g}"


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def run_query(
    path: str | Path,
    sql: str,
    *,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    max_rows: int = DEFAULT_MAX_ROWS,
) -> QueryResult:
    """Run one SELECT/WITH statement on the database at `path`, read-only, within
    `time_limit_s` of wall time, returning at most `max_rows` rows."""
    if max_rows < 0:
        raise ValueError("max_rows must be >= 0")
    statement = check_statement(sql)
    conn = open_read_only(path)
    denials: list[str] = []
    deadline = [0.0]
    timed_out = [False]

    def progress() -> int:
        if time.monotonic() > deadline[0]:
            timed_out[0] = True
            return 1  # non-zero: SQLite interrupts the statement
        return 0

    try:
        conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
        conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, MAX_SQL_BYTES)
        conn.set_authorizer(_authorizer(denials))
        conn.set_progress_handler(progress, PROGRESS_EVERY_N_OPS)
        start = time.monotonic()
        deadline[0] = start + time_limit_s
        try:
            cursor = conn.execute(statement)
            rows = cursor.fetchmany(max_rows + 1)
        except sqlite3.Error as error:
            if timed_out[0]:
                raise SandboxError(f"query ran longer than {_seconds(time_limit_s)} s") from error
            if denials:
                raise SandboxError(_best_denial(denials)) from error
            raise SandboxError(_one_line(error)) from error
        except (OverflowError, MemoryError, ValueError) as error:
            raise SandboxError(_one_line(error)) from error
        elapsed = time.monotonic() - start
        columns = tuple(d[0] for d in cursor.description or ())
        cursor.close()
    finally:
        conn.close()
    truncated = len(rows) > max_rows
    return QueryResult(
        columns=columns,
        rows=tuple(tuple(row) for row in rows[:max_rows]),
        truncated=truncated,
        elapsed_s=elapsed,
    )


@dataclass(frozen=True, slots=True)
class Sandbox:
    """One database and its limits; `run` is `run_query` with them. Safe to share between
    threads (each query opens its own connection)."""

    path: Path
    time_limit_s: float = DEFAULT_TIME_LIMIT_S
    max_rows: int = DEFAULT_MAX_ROWS

    def run(self, sql: str) -> QueryResult:
        return run_query(self.path, sql, time_limit_s=self.time_limit_s, max_rows=self.max_rows)

    def try_run(self, sql: str) -> QueryResult | SandboxError:
        """`run`, returning the error instead of raising it."""
        try:
            return self.run(sql)
        except SandboxError as error:
            return error
