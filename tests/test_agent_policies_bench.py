"""benchmarks/agent_policies.py at its smallest: two policies, five questions, one load
level, run as a user runs it (a subprocess of the script), its table and JSON checked for
their fields and sane values. The figures themselves are the benchmark's business
(docs/text-to-sql.md, "The agent under load"), not this test's."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sql_fixtures import chinook_db_fixture  # noqa: F401

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "agent_policies.py"

needs_redis_server = pytest.mark.skipif(
    shutil.which("redis-server") is None,
    reason="redis-server is not installed (apt install redis-server)",
)


@needs_redis_server
def test_smallest_configuration(tmp_path: Path, chinook_db: Path) -> None:
    out = tmp_path / "agent-policies.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT),
         "--policies", "vllm", "hexgen-flow",
         "--questions", "5",
         "--rates", "1",
         "--time-scale", "50",
         "--slo-s", "60",
         "--db", str(chinook_db),
         "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    # progress on stderr, the table on stdout
    assert "vllm at 1 q/s, seed 0: starting the mesh" in proc.stderr
    assert "5/5 workflows done" in proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "load 1 questions/s (Poisson, seed 0), SLO 60 s:"
    header = lines[1].split()
    for column in ("policy", "workflows", "P50", "P95", "SLO", "accuracy", "hexgen-flow"):
        assert column in header, lines[1]
    vllm_row = next(line.split() for line in lines if line.split()[:1] == ["vllm"])
    flagship_row = next(line.split() for line in lines if line.split()[:1] == ["hexgen-flow"])
    assert vllm_row[1] == flagship_row[1] == "5/5"
    assert float(vllm_row[-1]) > 0  # hexgen-flow's P95 over vllm's
    assert flagship_row[-1] == "-"
    assert "synthetic" in proc.stdout.lower()

    doc = json.loads(out.read_text())
    assert doc["config"]["policies"] == ["vllm", "hexgen-flow"]
    assert doc["config"]["cluster"] == "A100,A100,A6000,L40S"
    rows = {r["policy"]: r for r in doc["rows"]}
    assert set(rows) == {"vllm", "hexgen-flow"}
    for row in rows.values():
        assert row["sent"] == row["workflows"] == 5 and row["failed"] == 0, row["errors"]
        assert row["rate"] == 1.0 and row["seed"] == 0
        assert 0 < row["p50_s"] <= row["p95_s"] <= row["max_s"]
        assert row["client_p95_s"] > 0 and row["lag_p95_ms"] >= 0
        assert 0.0 <= row["slo_attainment"] <= 1.0
        assert 0.0 <= row["execution_accuracy"] <= 1.0
        assert row["llm_calls"] >= 5 * 4  # keywords and three candidates each, at least
    # the same synthetic answers whatever the schedule: the same calls, the same accuracy
    assert rows["vllm"]["execution_accuracy"] == rows["hexgen-flow"]["execution_accuracy"]
    assert rows["vllm"]["llm_calls"] == rows["hexgen-flow"]["llm_calls"]
    assert rows["hexgen-flow"]["flagship_p95_ratio"] == 1.0
    assert rows["vllm"]["flagship_p95_ratio"] == pytest.approx(
        rows["hexgen-flow"]["p95_s"] / rows["vllm"]["p95_s"]
    )
