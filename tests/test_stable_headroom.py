"""``benchmarks/stable_headroom.py`` end to end on a small stable plan: each row's floor
(workflows served as if alone, on the row's engines) lies under every policy's P95 at every
load, so it bounds the lead any scheduler can take; and a file that is not a stable one is
refused, naming it."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hexgen_flow.bench.plan import BASELINE, FLAGSHIP
from hexgen_flow.bench.stable import QUICK_STABLE_PLAN, run_stable

PLAN = replace(QUICK_STABLE_PLAN, presets=(BASELINE, "least-requests", FLAGSHIP), num_queries=40)
"""The quick plan, smaller still: two information models (two engine tables), one trace."""

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "stable_headroom.py"


@pytest.fixture(scope="module")
def quick_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("headroom") / "stable.json"
    path.write_text(json.dumps(run_stable(PLAN, workers=1)))
    return path


def _headroom(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--results", str(path), "--workers", "1", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_the_floor_lies_under_every_policy_and_bounds_the_lead(quick_file: Path) -> None:
    done = _headroom(quick_file, "--json")
    assert done.returncode == 0, done.stderr
    cells: list[dict[str, Any]] = json.loads(done.stdout)["cells"]
    doc = json.loads(quick_file.read_text())
    measured = [(row, cell) for row in doc["rows"] for cell in row["loads"]]
    assert len(cells) == len(measured) == len(doc["rows"]) * len(PLAN.loads)
    floor_of: dict[str, float] = {}
    for c, (row, cell) in zip(cells, measured, strict=True):
        assert (c["information"], c["trace"], c["load"]) == (
            row["information"],
            row["trace"],
            cell["load"],
        )
        # Queueing only adds: no policy at any load of the row finishes under the floor.
        assert 0 < c["floor_s"] <= min(cell["p95_s"].values()), (c, cell["p95_s"])
        assert c["bound"] >= c["lead"] > 0
        assert c["share_removed"] is not None and c["share_removed"] <= 1
        floor_of[doc["meta"]["information"][row["information"]]["calibration"]] = c["floor_s"]
    # Each row's floor is its engines' own: chess-measured engines are the slower here.
    assert floor_of["chess-measured"] > 1.1 * floor_of["aiconfigurator"], floor_of


def test_the_table_flags_the_rows_out_of_any_schedulers_reach(quick_file: Path) -> None:
    done = _headroom(quick_file, "--target", "100")
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")][1:]
    assert rows and all("(below target)" in line for line in rows)
    assert f"{len(rows)} of {len(rows)} cells have a bound below 100.00×" in done.stdout


def test_a_file_that_is_not_a_stable_one_is_refused() -> None:
    other = ROOT / "benchmarks" / "readme-results.json"
    done = _headroom(other)
    assert done.returncode == 2
    assert "readme-results.json" in done.stderr and "--stable" in done.stderr
