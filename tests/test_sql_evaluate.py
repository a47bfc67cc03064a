"""Execution accuracy: result sets compared as multisets of normalised rows (as lists when
the gold query orders them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hexgen_sql.evaluate import (
    execution_match,
    has_order_by,
    normalize_value,
    results_match,
)
from hexgen_sql.sandbox import QueryResult, SandboxError
from sql_fixtures import chinook_db_fixture  # noqa: F401


def test_normalize_value() -> None:
    assert normalize_value(3) == normalize_value(3.0) == normalize_value(2.999999999)
    assert normalize_value(True) == normalize_value(1)
    assert normalize_value(-0.0) == normalize_value(0)
    assert normalize_value(1.23456, digits=2) == 1.23
    assert normalize_value(None) is None
    assert normalize_value("3") == "3"  # text is not a number
    assert normalize_value("3") != normalize_value(3)
    assert normalize_value(b"\x00") == ("blob", b"\x00")
    assert normalize_value(float("nan")) == normalize_value(float("nan"))
    assert normalize_value(float("inf")) == float("inf")


def test_rows_as_multisets() -> None:
    gold = [(1, "a"), (2, "b"), (2, "b")]
    assert results_match([(2, "b"), (1, "a"), (2, "b")], gold)
    assert not results_match([(2, "b"), (1, "a"), (1, "a")], gold)  # multiplicity counts
    assert not results_match([(1, "a"), (2, "b")], gold)
    assert results_match([], [])
    assert not results_match([(1,)], [])
    assert results_match([(None, 1.0000001)], [(None, 1)])
    assert not results_match([(None,)], [(0,)])


def test_order_matters_only_when_asked() -> None:
    gold = [(1,), (2,), (3,)]
    assert results_match([(3,), (2,), (1,)], gold)
    assert not results_match([(3,), (2,), (1,)], gold, ordered=True)
    assert results_match([(1,), (2,), (3,)], gold, ordered=True)


def test_column_order() -> None:
    gold = [("a", 1), ("b", 2)]
    swapped = [(2, "b"), (1, "a")]
    assert results_match(swapped, gold)
    assert not results_match(swapped, gold, ignore_column_order=False)
    # a pairing must work for whole rows, not column by column
    assert not results_match([(1, 2), (2, 1)], [(1, 1), (2, 2)])
    # equal columns: any pairing is tried
    assert results_match([(1, 1, "x"), (2, 2, "y")], [("x", 1, 1), ("y", 2, 2)])
    assert results_match([(2, "b"), (1, "a")], [("b", 2), ("a", 1)], ordered=True)
    assert not results_match([(1, "a"), (2, "b")], [("b", 2), ("a", 1)], ordered=True)
    # extra or missing columns never match
    assert not results_match([("a", 1, 0)], [("a", 1)])


def test_query_results_are_accepted() -> None:
    left = QueryResult(("x",), ((1.0,), (2.0,)), False, 0.0)
    right = QueryResult(("y",), ((2,), (1,)), False, 0.0)
    assert results_match(left, right)


@pytest.mark.parametrize(
    ("sql", "ordered"),
    [
        ("SELECT a FROM t ORDER BY a", True),
        ("select a from t order\n  by a desc limit 3", True),
        ("SELECT a FROM (SELECT a FROM t ORDER BY a) LIMIT 2", False),
        ("SELECT a, rank() OVER (ORDER BY a) FROM t", False),
        ("WITH x AS (SELECT a FROM t ORDER BY a) SELECT * FROM x", False),
        ("SELECT 'ORDER BY' FROM t -- ORDER BY a", False),
        ('SELECT "order" FROM t', False),
        ("SELECT a FROM t WHERE a IN (SELECT a FROM u) ORDER BY a", True),
    ],
)
def test_has_order_by(sql: str, ordered: bool) -> None:
    assert has_order_by(sql) is ordered


def test_execution_match_on_chinook(chinook_db: Path) -> None:
    gold = (
        "SELECT Album.Title FROM Album JOIN Artist ON Album.ArtistId = Artist.ArtistId "
        "WHERE Artist.Name = 'AC/DC'"
    )
    same = (
        "SELECT Title FROM Album WHERE ArtistId = "
        "(SELECT ArtistId FROM Artist WHERE Name = 'AC/DC') ORDER BY Title DESC"
    )
    assert execution_match(chinook_db, same, gold).match
    wrong = "SELECT Title FROM Album WHERE ArtistId = 2"
    outcome = execution_match(chinook_db, wrong, gold)
    assert not outcome.match
    assert outcome.error is None
    assert outcome.gold is not None
    assert len(outcome.gold.rows) == 2


def test_execution_match_respects_the_gold_order(chinook_db: Path) -> None:
    gold = "SELECT Name FROM Genre ORDER BY GenreId DESC LIMIT 3"
    assert execution_match(
        chinook_db, "SELECT Name FROM Genre WHERE GenreId > 22 ORDER BY GenreId DESC", gold
    ).match
    assert not execution_match(
        chinook_db, "SELECT Name FROM Genre WHERE GenreId > 22 ORDER BY GenreId", gold
    ).match


def test_numbers_are_compared_rounded(chinook_db: Path) -> None:
    gold = "SELECT SUM(Total) FROM Invoice WHERE strftime('%Y', InvoiceDate) = '2009'"
    assert execution_match(
        chinook_db,
        "SELECT ROUND(SUM(Total), 2) FROM Invoice WHERE InvoiceDate LIKE '2009%'",
        gold,
    ).match


def test_a_failing_prediction_does_not_match(chinook_db: Path) -> None:
    gold = "SELECT count(*) FROM Track"
    outcome = execution_match(chinook_db, "SELECT count(*) FROM Tracks", gold)
    assert not outcome.match
    assert outcome.error == "no such table: Tracks"
    refused = execution_match(chinook_db, "DELETE FROM Track", gold)
    assert refused.error == "only SELECT or WITH statements may run"
    cut = execution_match(chinook_db, "SELECT TrackId FROM Track", gold, max_rows=10)
    assert not cut.match
    assert cut.error == "more than 10 rows"


def test_a_broken_gold_query_raises(chinook_db: Path) -> None:
    with pytest.raises(SandboxError):
        execution_match(chinook_db, "SELECT 1", "SELECT * FROM Nope")


def test_many_interchangeable_columns_stay_cheap() -> None:
    import time

    width = 15
    gold = [tuple([None] * width)] * 3
    start = time.monotonic()
    assert results_match([tuple([None] * width)] * 3, gold)
    # every column holds {0, 1} on both sides, so all 15! pairings are candidates, and
    # none makes whole rows match: the search gives up after its budget
    gold_rows = [tuple([0] * width), tuple([1] * width)]
    mixed = [tuple([0] * 7 + [1] * 8), tuple([1] * 7 + [0] * 8)]
    assert not results_match(mixed, gold_rows)
    # and a pairing that works is still found
    assert results_match([tuple(reversed(r)) for r in gold_rows], gold_rows)
    assert time.monotonic() - start < 5
