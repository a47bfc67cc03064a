"""The Markdown pieces the benchmark's reports are written with: a number formatted or
``n/a``, and a table. Both reports use them (bench/report.py, the whole benchmark's
results.md, and bench/shifting_report.py, its shifting-load section), so they live below
both."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

__all__ = ["fmt", "md_table"]


def fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    return f"{value:{spec}}{suffix}"


def md_table(header: Sequence[str], rows: Iterable[Sequence[str]], *, left: int = 1) -> list[str]:
    """A Markdown table; the first `left` columns are labels, the rest right-aligned numbers."""
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if i < left else "---:" for i in range(len(header))) + "|",
    ]
    lines.extend("| " + " | ".join(row) + " |" for row in rows)
    return lines
