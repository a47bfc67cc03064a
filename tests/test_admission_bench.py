"""benchmarks/admission_predictor.py at its smallest, run as a user runs it (a subprocess of
the script): every setting of the set gets a row whose counts add up, the totals are the
rows' sums, and the table prints. The figures themselves are docs/admission.md's business."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "admission_predictor.py"


def _run(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--queries", "20", "--workers", "1", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_every_setting_gets_a_row_whose_counts_add_up() -> None:
    doc = json.loads(_run("--set", "holdout", "--json"))
    rows = doc["rows"]
    assert len(rows) == 22
    for row in rows:
        assert row["admitted"] + row["rejected"] == 20
        assert 0 <= row["met_admitted"] <= row["admitted"]
        assert 0 <= row["met_without_admission"] <= 20
    assert doc["met"] == sum(r["met_admitted"] for r in rows)
    assert doc["met_without_admission"] == sum(r["met_without_admission"] for r in rows)
    shares = [r["met_admitted"] / r["admitted"] for r in rows if r["admitted"]]
    assert doc["worst_admitted_share"] == min(shares)
    # At 2 q/s on H100 x 2 the cluster is overloaded: admission control refuses some.
    assert any(r["rejected"] > 0 for r in rows)


def test_the_table_names_each_setting_and_the_totals() -> None:
    out = _run("--set", "paper", "--seeds", "3")
    assert "H100 x 4" in out and "A100,A100,A6000,L40S" in out and "A100 x 2" in out
    assert "met their SLO:" in out and "with admission control" in out
    assert "worst share of admitted queries within their SLO" in out
