"""Execution accuracy: does a predicted query return the same result as the gold one?

Results are compared as multisets of rows (as lists when the gold query's outermost
SELECT has ORDER BY), after normalising values: numbers (int, float, bool) become floats
rounded to `digits` places, so that ``3``, ``3.0`` and ``2.99999999`` agree; text and None
are compared as they are. By default the columns may come in another order (as Spider's
test-suite evaluation allows): some one-to-one pairing of the columns must make the rows
match. Extra or missing columns do not match.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hexgen_sql.sandbox import (
    DEFAULT_TIME_LIMIT_S,
    QueryResult,
    SandboxError,
    run_query,
    strip_code,
)

__all__ = [
    "ExecutionMatch",
    "execution_match",
    "has_order_by",
    "normalize_value",
    "results_match",
]

DEFAULT_DIGITS = 4
EVAL_MAX_ROWS = 100_000
MAX_SEARCH_STEPS = 20_000
"""At most this many steps of the search for a column pairing (then: no match)."""


def normalize_value(value: object, digits: int = DEFAULT_DIGITS) -> Hashable:
    """A comparable, hashable form of one result value."""
    if value is None:
        return None
    if isinstance(value, bool | int | float):
        number = float(value)
        if math.isnan(number):
            return ("nan",)
        if math.isinf(number):
            return number
        rounded = round(number, digits)
        return 0.0 if rounded == 0 else rounded  # -0.0 -> 0.0
    if isinstance(value, bytes | bytearray | memoryview):
        return ("blob", bytes(value))
    return str(value)


def has_order_by(sql: str) -> bool:
    """Whether the outermost query of `sql` ends in ORDER BY (not one inside a subquery,
    a CTE or a window's OVER (...))."""
    depth = 0
    previous = ""
    for token in (
        strip_code(sql).replace("(", " ( ").replace(")", " ) ").replace(",", " , ").split()
    ):
        upper = token.upper()
        if upper == "(":
            depth += 1
        elif upper == ")":
            depth = max(0, depth - 1)
        elif depth == 0 and upper == "BY" and previous == "ORDER":
            return True
        previous = upper
    return False


def _rows(rows: Sequence[Sequence[object]], digits: int) -> list[tuple[Hashable, ...]]:
    return [tuple(normalize_value(v, digits) for v in row) for row in rows]


def _same(
    predicted: list[tuple[Hashable, ...]], gold: list[tuple[Hashable, ...]], ordered: bool
) -> bool:
    if ordered:
        return predicted == gold
    return Counter(predicted) == Counter(gold)


def results_match(
    predicted: Sequence[Sequence[object]] | QueryResult,
    gold: Sequence[Sequence[object]] | QueryResult,
    *,
    ordered: bool = False,
    ignore_column_order: bool = True,
    digits: int = DEFAULT_DIGITS,
) -> bool:
    """Whether two results hold the same rows: as multisets, or in the same order when
    `ordered`; values normalised by `normalize_value`."""
    p_rows = _rows(predicted.rows if isinstance(predicted, QueryResult) else predicted, digits)
    g_rows = _rows(gold.rows if isinstance(gold, QueryResult) else gold, digits)
    if len(p_rows) != len(g_rows):
        return False
    if not g_rows:
        return True
    width = len(g_rows[0])
    if any(len(r) != width for r in itertools.chain(p_rows, g_rows)):
        return False
    if _same(p_rows, g_rows, ordered):
        return True
    if not ignore_column_order or width < 2:
        return False
    # candidate pairings: gold column j may take predicted column i only if both hold the
    # same multiset of values
    p_cols = [Counter(row[i] for row in p_rows) for i in range(width)]
    g_cols = [Counter(row[j] for row in g_rows) for j in range(width)]
    options = [[i for i in range(width) if p_cols[i] == g_cols[j]] for j in range(width)]
    if any(not o for o in options):
        return False
    budget = [MAX_SEARCH_STEPS]

    def search(pairing: list[int]) -> bool:
        """Depth-first over one-to-one pairings that respect `options`."""
        budget[0] -= 1
        if len(pairing) == width:
            permuted = [tuple(row[i] for i in pairing) for row in p_rows]
            return _same(permuted, g_rows, ordered)
        for i in options[len(pairing)]:
            if budget[0] <= 0:
                return False
            if i not in pairing and search([*pairing, i]):
                return True
        return False

    return search([])


@dataclass(frozen=True, slots=True)
class ExecutionMatch:
    """The outcome of one comparison: `match`, and when the prediction did not run, the
    sandbox's reason in `error`."""

    match: bool
    error: str | None = None
    predicted: QueryResult | None = None
    gold: QueryResult | None = None


def execution_match(
    db_path: str | Path,
    predicted_sql: str,
    gold_sql: str,
    *,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    max_rows: int = EVAL_MAX_ROWS,
    ignore_column_order: bool = True,
    digits: int = DEFAULT_DIGITS,
) -> ExecutionMatch:
    """Run both queries in the sandbox and compare their results (ordered when the gold
    query has ORDER BY). A prediction that fails, or is cut at `max_rows`, does not match;
    a gold query that fails raises `SandboxError` (the gold is broken, not the model)."""
    gold = run_query(db_path, gold_sql, time_limit_s=time_limit_s, max_rows=max_rows)
    try:
        predicted = run_query(db_path, predicted_sql, time_limit_s=time_limit_s, max_rows=max_rows)
    except SandboxError as error:
        return ExecutionMatch(False, error.reason, None, gold)
    if predicted.truncated or gold.truncated:
        return ExecutionMatch(False, f"more than {max_rows} rows", predicted, gold)
    match = results_match(
        predicted,
        gold,
        ordered=has_order_by(gold_sql),
        ignore_column_order=ignore_column_order,
        digits=digits,
    )
    return ExecutionMatch(match, None, predicted, gold)
