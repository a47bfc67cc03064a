"""The SQL sandbox: model-written SQL reads and never writes, runs one statement, stops in
time, and explains every refusal in one line."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from hexgen_sql.sandbox import (
    QueryResult,
    Sandbox,
    SandboxError,
    check_statement,
    run_query,
    strip_code,
)
from sql_fixtures import chinook_db_fixture, sha256  # noqa: F401


@pytest.fixture
def small_db(tmp_path: Path) -> Path:
    path = tmp_path / "small.db"
    conn = sqlite3.connect(path)
    conn.executescript(
        """
        CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT, score REAL);
        INSERT INTO t VALUES (1, 'a;b', 1.5), (2, 'it''s', 2.5), (3, '--x', NULL);
        """
    )
    conn.commit()
    conn.close()
    return path


REFUSED: list[tuple[str, str]] = [
    ("DROP TABLE Artist", "only SELECT or WITH statements may run"),
    ("ATTACH DATABASE ':memory:' AS x", "only SELECT or WITH statements may run"),
    ("PRAGMA writable_schema=ON", "only SELECT or WITH statements may run"),
    ("INSERT INTO Artist (Name) VALUES ('x')", "only SELECT or WITH statements may run"),
    ("UPDATE Artist SET Name = 'x'", "only SELECT or WITH statements may run"),
    ("CREATE TABLE x (a)", "only SELECT or WITH statements may run"),
    ("SELECT 1; SELECT 2", "only one SQL statement may run at a time"),
    ("SELECT 'a;b'; DROP TABLE Artist", "only one SQL statement may run at a time"),
    ("SELECT 1; 'x'", "only one SQL statement may run at a time"),
    ("", "the query is empty"),
    (" ; -- nothing\n", "the query is empty"),
    # past the statement check, the authorizer refuses
    ("WITH x AS (SELECT 1) DELETE FROM Artist", "DELETE of Artist is not allowed"),
    ("WITH x AS (SELECT 1) INSERT INTO Genre (Name) SELECT 'x'", "INSERT of Genre is not allowed"),
    ("SELECT load_extension('/tmp/evil')", "function load_extension() is not allowed"),
    ("SELECT randomblob(1000000000)", "function randomblob() is not allowed"),
    (
        "SELECT * FROM pragma_table_info('Artist')",
        "schema changes and PRAGMA functions are not allowed",
    ),
    # SQLite's own errors, one line
    ("SELECT * FROM Artist WHERE", "incomplete input"),
    ("SELECT Name FROM FROM Artist", 'near "FROM": syntax error'),
    ("SELECT nope FROM Artist", "no such column: nope"),
    ("SELECT * FROM Nope", "no such table: Nope"),
]


@pytest.mark.parametrize(("sql", "reason"), REFUSED)
def test_refused_with_a_clear_reason_and_the_file_unchanged(
    chinook_db: Path, sql: str, reason: str
) -> None:
    before = sha256(chinook_db)
    with pytest.raises(SandboxError) as caught:
        run_query(chinook_db, sql)
    assert caught.value.reason == reason
    assert "\n" not in str(caught.value)
    assert sha256(chinook_db) == before


def test_runaway_recursive_cte_is_stopped_in_time(chinook_db: Path) -> None:
    before = sha256(chinook_db)
    sql = "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n+1 FROM r) SELECT count(*) FROM r"
    with pytest.raises(SandboxError, match=r"^query ran longer than 0\.3 s$"):
        run_query(chinook_db, sql, time_limit_s=0.3)
    assert sha256(chinook_db) == before
    # the process (and SQLite in it) is still fine
    assert run_query(chinook_db, "SELECT count(*) FROM Artist").rows == ((275,),)


def test_endless_rows_are_cut_at_the_row_limit(chinook_db: Path) -> None:
    sql = "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n+1 FROM r) SELECT n FROM r"
    result = run_query(chinook_db, sql, max_rows=7)
    assert result.rows == tuple((n,) for n in range(1, 8))
    assert result.truncated


def test_valid_selects_return_the_right_rows(chinook_db: Path) -> None:
    result = run_query(
        chinook_db,
        "/* leading */ SELECT ArtistId, Name FROM Artist ORDER BY ArtistId LIMIT 3; -- done",
    )
    assert isinstance(result, QueryResult)
    assert result.columns == ("ArtistId", "Name")
    assert result.rows == ((1, "AC/DC"), (2, "Accept"), (3, "Aerosmith"))
    assert not result.truncated
    assert 0 <= result.elapsed_s < 2

    joined = run_query(
        chinook_db,
        "WITH a AS (SELECT ArtistId FROM Artist WHERE Name = 'AC/DC') "
        "SELECT Title FROM Album JOIN a USING (ArtistId) ORDER BY Title",
    )
    assert joined.rows == (("For Those About To Rock We Salute You",), ("Let There Be Rock",))
    # quoted identifiers of every kind, window functions, date functions
    assert run_query(
        chinook_db,
        'SELECT "Name", count(*) OVER () FROM [Artist] WHERE `ArtistId` = 1',
    ).rows == (("AC/DC", 1),)
    assert run_query(chinook_db, "SELECT strftime('%Y', min(InvoiceDate)) FROM Invoice").rows == (
        ("2007",),
    )


def test_row_truncation(chinook_db: Path) -> None:
    result = run_query(chinook_db, "SELECT Name FROM Genre ORDER BY GenreId", max_rows=10)
    assert len(result.rows) == 10
    assert result.truncated
    exact = run_query(chinook_db, "SELECT Name FROM Genre", max_rows=25)
    assert len(exact.rows) == 25
    assert not exact.truncated


def test_semicolons_and_comment_marks_inside_strings(small_db: Path) -> None:
    rows = run_query(small_db, "SELECT name FROM t WHERE name IN ('a;b', '--x') ORDER BY id;")
    assert rows.rows == (("a;b",), ("--x",))
    assert run_query(small_db, "SELECT name FROM t WHERE name = 'it''s'").rows == (("it's",),)


def test_check_statement() -> None:
    assert check_statement("  select 1 ;  ;  -- c\n /* d */") == "select 1"
    assert check_statement("WITH x AS (SELECT ';') SELECT * FROM x") == (
        "WITH x AS (SELECT ';') SELECT * FROM x"
    )
    with pytest.raises(SandboxError, match="only SELECT or WITH"):
        check_statement("VALUES (1)")
    with pytest.raises(SandboxError, match="only SELECT or WITH"):
        check_statement("EXPLAIN SELECT 1")
    assert strip_code("SELECT 'x;y' -- c\nFROM \"t\"").split() == ["SELECT", "?", "FROM", "?"]


def test_the_file_cannot_be_written_even_by_a_crafted_statement(tmp_path: Path) -> None:
    path = tmp_path / "w.db"
    sqlite3.connect(path).executescript("CREATE TABLE t (a); INSERT INTO t VALUES (1);")
    before = sha256(path)
    for sql in (
        "WITH x AS (SELECT 1) UPDATE t SET a = 2",
        "WITH x AS (SELECT 1) REPLACE INTO t VALUES (5)",
        "SELECT * FROM t; ATTACH ':memory:' AS m",
    ):
        with pytest.raises(SandboxError):
            run_query(path, sql)
    assert sha256(path) == before
    assert not (tmp_path / "w.db-journal").exists()


def test_missing_database(tmp_path: Path) -> None:
    with pytest.raises(SandboxError, match="database file not found"):
        run_query(tmp_path / "absent.db", "SELECT 1")
    assert not (tmp_path / "absent.db").exists()


def test_sandbox_object_and_threads(chinook_db: Path) -> None:
    box = Sandbox(chinook_db, time_limit_s=1.0, max_rows=5)
    assert box.run("SELECT count(*) FROM Track").rows == ((3503,),)
    error = box.try_run("DELETE FROM Track")
    assert isinstance(error, SandboxError)
    results: list[object] = []

    def worker() -> None:
        results.append(box.try_run("SELECT count(*) FROM InvoiceLine"))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(isinstance(r, QueryResult) and r.rows == ((2240,),) for r in results)


def test_the_authorizer_alone_refuses_what_the_statement_check_already_does(
    chinook_db: Path,
) -> None:
    """Defence in depth: even on a writable connection, the authorizer by itself stops
    ATTACH, PRAGMA, writes and schema changes."""
    from hexgen_sql.sandbox import _authorizer

    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t (a)")
    denials: list[str] = []
    conn.set_authorizer(_authorizer(denials))
    for sql, reason in [
        ("PRAGMA writable_schema=ON", "PRAGMA writable_schema is not allowed"),
        (f"ATTACH DATABASE '{chinook_db}' AS c", "ATTACH is not allowed"),
        ("DETACH DATABASE main", "DETACH is not allowed"),
        ("INSERT INTO t VALUES (1)", "INSERT of t is not allowed"),
        ("DROP TABLE t", "schema changes and PRAGMA functions are not allowed"),
        ("CREATE TEMP VIEW v AS SELECT 1", "schema changes and PRAGMA functions are not allowed"),
        ("BEGIN", "transaction control is not allowed"),
    ]:
        denials.clear()
        with pytest.raises(sqlite3.DatabaseError, match="not authorized"):
            conn.execute(sql)
        assert denials[0] == reason
    assert conn.execute("SELECT count(*) FROM t").fetchone() == (0,)
